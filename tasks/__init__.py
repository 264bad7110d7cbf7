"""Tasks shipped with runner: training tasks turn a batch into a loss and metrics; inference tasks run a
loaded model (`conf/task/*.yaml`)."""

from runner.tasks.classification import Classification
from runner.tasks.generation import TextGeneration
from runner.tasks.language_modeling import LanguageModeling
from runner.tasks.regression import Regression

__all__ = ["Classification", "LanguageModeling", "Regression", "TextGeneration"]
