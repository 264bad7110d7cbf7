"""Data sources: what the `data` config group instantiates."""

from runner.data.base import DataSource, TensorDictDataset
from runner.data.builtin import digits, sonnets
from runner.data.synthetic import RandomTokens, SyntheticRegression
from runner.data.table import TableFile
from runner.data.text import TextFile
from runner.data.tokens import TokenShards

__all__ = [
    "DataSource",
    "RandomTokens",
    "SyntheticRegression",
    "TableFile",
    "TensorDictDataset",
    "TextFile",
    "TokenShards",
    "digits",
    "sonnets",
]
