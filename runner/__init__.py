"""runner: a declarative experiment runner for PyTorch with an Accelerate-compatible `Accelerator`."""

from runner.accelerator import Accelerator
from runner.checkpoint import ProjectConfiguration
from runner.launchers.notebook import notebook_launcher
from runner.model_files import load_checkpoint_in_model
from runner.utils import set_seed

__all__ = ["Accelerator", "ProjectConfiguration", "load_checkpoint_in_model", "notebook_launcher", "set_seed"]
