"""The optimizer that `Accelerator.prepare` returns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runner.hardware.base import Strategy
from runner.precision import Precision
from runner.state import GradientState


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so that it steps only when gradients are synchronised, through the strategy and
    the precision plugin (fp16 loss scaling), as Accelerate's `AcceleratedOptimizer` does.

    `step()` and `zero_grad()` do nothing on accumulation micro-steps; `step_was_skipped` is True after an
    fp16 step that found inf/nan gradients.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        precision: Precision,
        gradient_state: GradientState,
    ) -> None:
        # The base __init__ is not called: state, param_groups and defaults are the wrapped optimizer's.
        self.optimizer = optimizer
        self.strategy = strategy
        self.precision = precision
        self.gradient_state = gradient_state
        self.step_was_skipped = False

    @property
    def state(self) -> dict:  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.strategy.zero_grad(self.optimizer, set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if self.gradient_state.sync_gradients:
            self.step_was_skipped = not self.strategy.optimizer_step(self.optimizer, self.precision, closure)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
