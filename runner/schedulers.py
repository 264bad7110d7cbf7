"""Learning-rate schedules for `conf/scheduler/`: each is `f(optimizer, num_training_steps, ...)`.

`num_training_steps` counts scheduler steps; the runner passes optimizer steps x processes, since a
prepared scheduler advances once per process on each optimizer step (Accelerate's convention).
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from torch.optim.lr_scheduler import LambdaLR

from runner.config import Probability, Range
from runner.errors import ConfigError


def _fraction(name: str, value: float, upper_open: bool = True) -> float:
    """`scheduler.<name>`, a fraction: in [0, 1) (or [0, 1])."""
    if not (0 <= value < 1 if upper_open else 0 <= value <= 1):
        raise ConfigError(
            f"scheduler.{name}={value}: must be in [0, 1{')' if upper_open else ']'} (a fraction of "
            + ("training)." if name == "warmup_ratio" else "the learning rate).")
        )
    return value


def constant(
    optimizer: torch.optim.Optimizer, num_training_steps: int, warmup_ratio: Probability = 0.0
) -> LambdaLR:
    """Linear warm-up over `warmup_ratio` of training, then the optimizer's learning rate."""
    warmup = int(num_training_steps * _fraction("warmup_ratio", warmup_ratio))
    return LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))


def cosine(
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
    warmup_ratio: Probability = 0.0,
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.0,
) -> LambdaLR:
    """Linear warm-up, then cosine decay to `min_lr_ratio` x the learning rate at the last step."""
    warmup = int(num_training_steps * _fraction("warmup_ratio", warmup_ratio))
    _fraction("min_lr_ratio", min_lr_ratio, upper_open=False)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, num_training_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
