"""runner: a declarative experiment runner for PyTorch with an Accelerate-compatible `Accelerator`."""

from runner.accelerator import Accelerator
from runner.big_modeling import (
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from runner.checkpoint import ProjectConfiguration
from runner.launchers.notebook import notebook_launcher
from runner.rng import set_seed

__all__ = [
    "Accelerator",
    "ProjectConfiguration",
    "dispatch_model",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "set_seed",
]
