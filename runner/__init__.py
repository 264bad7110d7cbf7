"""runner: a declarative experiment runner for PyTorch with an Accelerate-compatible `Accelerator`."""

from runner.accelerator import Accelerator
from runner.utils import set_seed

__all__ = ["Accelerator", "set_seed"]
