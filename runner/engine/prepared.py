"""What `Accelerator.prepare` returns in place of the user's optimizer and learning-rate scheduler: wrappers
that step only on real optimizer steps, through the strategy and the precision plugin (Accelerate's
`AcceleratedOptimizer` and `AcceleratedScheduler`)."""

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
    fp16 step that found inf/nan gradients, and (`skip_nonfinite`) after any step whose gradients were not
    finite, which it left out.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        precision: Precision,
        gradient_state: GradientState,
        skip_nonfinite: bool = False,
    ) -> None:
        # The base __init__ is not called: state, param_groups and defaults are the wrapped optimizer's.
        self.optimizer = optimizer
        self.strategy = strategy
        self.precision = precision
        self.gradient_state = gradient_state
        self.step_was_skipped = False
        # Checked here unless the precision leaves such steps out itself (fp16's loss scaler).
        self.checks_finite = skip_nonfinite and not precision.skips_nonfinite_steps

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
        if not self.gradient_state.sync_gradients:
            return
        if self.checks_finite and not self.strategy.gradients_finite(self.parameters()):
            self.step_was_skipped = True
            return
        self.step_was_skipped = not self.strategy.optimizer_step(self.optimizer, self.precision, closure)

    def parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def train(self) -> None:
        """Put an optimizer that has modes (schedule-free ones) in training mode; others have none."""
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

    def eval(self) -> None:
        """Put an optimizer that has modes (schedule-free ones: their evaluation weights) in eval mode."""
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class AcceleratedScheduler:
    """Steps the wrapped scheduler only after a real optimizer step, as Accelerate's does.

    With `step_with_optimizer` (the default), a call on an accumulation micro-step or after a skipped fp16
    step does nothing, and a real step advances the schedule `num_processes` times unless `split_batches`
    (each optimizer step consumed `num_processes` batches).
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: list[AcceleratedOptimizer],
        gradient_state: GradientState,
        num_processes: int = 1,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.num_processes = 1 if split_batches else num_processes
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        # Each attribute read once: this class's `__getattr__` makes every read of one slower.
        state, scheduler = self.gradient_state, self.scheduler
        if not self.step_with_optimizer:
            scheduler.step(*args, **kwargs)
            return
        if not state.sync_gradients:
            if state.adjust_scheduler:  # counted, not taken (bounds OneCycleLR)
                scheduler._step_count += 1
            return
        for optimizer in self.optimizers:
            if optimizer.step_was_skipped:
                return
        total = getattr(scheduler, "total_steps", None)  # OneCycleLR refuses to step past its end
        for _ in range(self.num_processes):
            if total is None or scheduler._step_count <= total:
                scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found above: expose the wrapped scheduler's (base_lrs, ...).
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
