"""Accelerate's `accelerate.utils` names, for scripts that import them from here (`from runner.utils import
set_seed`): re-exported from the modules that hold them."""

from runner.big_modeling import load_checkpoint_in_model
from runner.checkpoint import ProjectConfiguration
from runner.rng import set_seed

__all__ = ["ProjectConfiguration", "load_checkpoint_in_model", "set_seed"]
