"""Learning-rate schedules for `conf/scheduler/`: each is `f(optimizer, num_training_steps, ...)`.

`num_training_steps` counts scheduler steps; the runner passes optimizer steps x processes, since a
prepared scheduler advances once per process on each optimizer step (Accelerate's convention), and that
factor as `steps_per_update` to a schedule that takes it (settings counted in optimizer steps).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Annotated

import torch
from torch.optim.lr_scheduler import LambdaLR

from runner.config import NonNegativeFloat, NonNegativeInt, PositiveInt, Probability, PythonOnly, Range
from runner.errors import ConfigError


def _fraction(name: str, value: float, upper_open: bool = True) -> float:
    """`scheduler.<name>`, a fraction: in [0, 1) (or [0, 1])."""
    if not (0 <= value < 1 if upper_open else 0 <= value <= 1):
        raise ConfigError(
            f"scheduler.{name}={value}: must be in [0, 1{')' if upper_open else ']'} (a fraction of "
            + ("training)." if name == "warmup_ratio" else "the learning rate).")
        )
    return value


def _warmup(updates: int, warmup_ratio: float, warmup_steps: int | None) -> int:
    """The warm-up in optimizer steps: `warmup_steps` where given, else `warmup_ratio` of the `updates`."""
    if warmup_steps is not None:
        return warmup_steps
    return int(updates * _fraction("warmup_ratio", warmup_ratio))


def constant(
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
    warmup_ratio: Probability = 0.0,
    warmup_steps: NonNegativeInt | None = None,
    steps_per_update: PythonOnly[int] = 1,
) -> LambdaLR:
    """Linear warm-up over `warmup_ratio` of training (or `warmup_steps` optimizer steps, which replace
    it), then the optimizer's learning rate. `steps_per_update`: scheduler steps per optimizer step (the
    runner's; see the module): the rate follows the optimizer steps, on any number of processes."""
    warmup = _warmup(num_training_steps // steps_per_update, warmup_ratio, warmup_steps)
    return LambdaLR(optimizer, lambda step: min(1.0, (step // steps_per_update + 1) / (warmup + 1)))


def cosine(
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
    warmup_ratio: Probability = 0.0,
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.0,
    warmup_steps: NonNegativeInt | None = None,
    decay_steps: PositiveInt | None = None,
    min_lr: NonNegativeFloat | None = None,
    steps_per_update: PythonOnly[int] = 1,
) -> LambdaLR:
    """Linear warm-up, then cosine decay to `min_lr_ratio` x the learning rate at the last step.

    Absolute values replace the shares where given (as transformers' `warmup_steps` does its ratio):
    `warmup_steps` optimizer steps of warm-up; `decay_steps`, the optimizer step the decay ends at,
    warm-up included (nanoGPT's `lr_decay_iters`; null: the last step), the rate staying at its minimum
    after it; `min_lr`, the minimum itself, for every parameter group. `steps_per_update`: scheduler
    steps per optimizer step (the runner's; see the module): the rate follows the optimizer steps."""
    updates = num_training_steps // steps_per_update
    warmup = _warmup(updates, warmup_ratio, warmup_steps)
    length = updates if decay_steps is None else decay_steps
    if warmup >= length and (warmup_steps is not None or decay_steps is not None):
        raise ConfigError(
            f"scheduler: the warm-up ({warmup} optimizer steps) leaves nothing of the {length} steps the schedule "
            "decays over (scheduler.decay_steps, else the run's steps). Shorten scheduler.warmup_steps, or "
            "lengthen scheduler.decay_steps."
        )
    _fraction("min_lr_ratio", min_lr_ratio, upper_open=False)
    floors = [_floor(group["lr"], min_lr, min_lr_ratio) for group in optimizer.param_groups]

    def factor(step: int, floor: float) -> float:
        update = step // steps_per_update
        if update < warmup:
            return (update + 1) / (warmup + 1)
        progress = min(1.0, (update - warmup) / max(1, length - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, [partial(factor, floor=floor) for floor in floors])


def _floor(lr: float, min_lr: float | None, min_lr_ratio: float) -> float:
    """The last rate of a group whose peak is `lr`, as a share of it."""
    if min_lr is None:
        return min_lr_ratio
    if lr <= 0 or min_lr > lr:
        raise ConfigError(
            f"scheduler.min_lr={min_lr}: above the learning rate {lr} it would decay to. Give a min_lr at most "
            "optimizer.lr, or scheduler.min_lr=null for min_lr_ratio."
        )
    return min_lr / lr
