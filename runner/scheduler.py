"""The learning-rate scheduler that `Accelerator.prepare` returns."""

from __future__ import annotations

from typing import Any

from runner.optimizer import AcceleratedOptimizer
from runner.state import GradientState


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
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.num_processes):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses to step past its end
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

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
