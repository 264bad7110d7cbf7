"""Character-level (byte-level) language-modelling data from a text file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import torch
from torch.utils.data import Dataset

from runner.config import Exists, Fraction, PositiveInt, checked
from runner.data.base import DataSource
from runner.errors import ConfigError

VOCAB_SIZE = 256  # one token per byte: any text file, no tokenizer to ship


class StridedWindows(Dataset):
    """Windows of `seq_len` tokens of an in-memory `tokens` every `stride` tokens; targets are the inputs
    shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int) -> None:
        self.tokens, self.seq_len, self.stride = tokens, seq_len, stride

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - self.seq_len - 1) // self.stride + 1)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.stride
        chunk = self.tokens[start : start + self.seq_len + 1]
        return {"inputs": chunk[:-1], "targets": chunk[1:]}


class TextFile(DataSource):
    """A text file as bytes; the last `eval_fraction` of it is the eval split (no overlap with training).

    Args:
        path: the text file.
        seq_len: tokens per training sequence.
        stride: distance between consecutive training windows (eval windows do not overlap).
        eval_fraction: share of the file, at its end, held out for evaluation.
    """

    @checked("data")
    def __init__(
        self,
        path: Annotated[str, Exists("file", "a text file")],
        seq_len: PositiveInt = 64,
        stride: PositiveInt = 1,
        eval_fraction: Fraction = 0.1,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.path = Path(path).expanduser()
        if seq_len < 1 or stride < 1:
            raise ConfigError(f"data.seq_len={seq_len}, data.stride={stride}: both must be >= 1.")
        self.seq_len, self.stride, self.eval_fraction = seq_len, stride, eval_fraction

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        tokens = torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8).long()
        split = int(len(tokens) * (1 - self.eval_fraction))
        train = StridedWindows(tokens[:split], self.seq_len, self.stride)
        eval_ = StridedWindows(tokens[split:], self.seq_len, self.seq_len)
        if len(train) == 0 or len(eval_) == 0:
            raise ConfigError(
                f"data.path={str(self.path)!r}: {len(tokens)} bytes are too few for data.seq_len={self.seq_len} "
                f"with data.eval_fraction={self.eval_fraction}; use a longer file or a shorter seq_len."
            )
        return train, eval_, {"vocab_size": VOCAB_SIZE}
