"""Local SGD (Accelerate's `accelerate.local_sgd.LocalSGD`): processes train their replicas apart and
average the parameters every few steps, instead of averaging gradients at every step."""

from __future__ import annotations

from contextlib import ExitStack
from types import TracebackType

import torch

from runner.accelerate.accelerator import Accelerator


class LocalSGD:
    """Inside `with LocalSGD(accelerator, model, local_sgd_steps) as local_sgd:`, backward passes do not
    synchronise gradients; `local_sgd.step()` after each optimizer step averages the parameters across
    processes every `local_sgd_steps` calls, and leaving the block averages them once more.

    With one process, or `enabled=False`, it does nothing (training is then ordinary data parallel)."""

    def __init__(
        self, accelerator: Accelerator, model: torch.nn.Module, local_sgd_steps: int, enabled: bool = True
    ) -> None:
        if local_sgd_steps < 1:
            raise ValueError(f"LocalSGD: local_sgd_steps must be >= 1, got {local_sgd_steps}.")
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = enabled and accelerator.use_distributed
        self.num_steps = 0
        self._no_sync = ExitStack()

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._no_sync.close()
        if self.enabled and kind is None:
            self._average_parameters()

    def step(self) -> None:
        """Count an optimizer step; every `local_sgd_steps`-th averages the parameters."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    @torch.no_grad()
    def _average_parameters(self) -> None:
        self.accelerator.wait_for_everyone()
        for param in self.accelerator.unwrap_model(self.model).parameters():
            param.copy_(self.accelerator.reduce(param.data, reduction="mean"))
