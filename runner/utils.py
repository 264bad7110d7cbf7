"""Small helpers with Accelerate's names (`from runner.utils import set_seed`)."""

from __future__ import annotations

import random

import numpy as np
import torch

from runner.big_modeling import load_checkpoint_in_model
from runner.checkpoint import ProjectConfiguration

__all__ = ["ProjectConfiguration", "load_checkpoint_in_model", "set_seed"]


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices); `deterministic` also asks torch for deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
