"""Tasks shipped with runner: training tasks turn a batch into a loss and metrics; inference tasks run a
loaded model (`conf/task/*.yaml`)."""

from tasks.classification import Classification
from tasks.generation import TextGeneration
from tasks.language_modeling import LanguageModeling
from tasks.regression import Regression

__all__ = ["Classification", "LanguageModeling", "Regression", "TextGeneration"]
