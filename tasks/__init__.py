"""Tasks shipped with runner: each turns a batch into a loss and metrics (`conf/task/*.yaml`)."""

from tasks.classification import Classification
from tasks.language_modeling import LanguageModeling
from tasks.regression import Regression

__all__ = ["Classification", "LanguageModeling", "Regression"]
