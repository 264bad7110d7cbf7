"""`hardware=cpu`: one process on one device."""

from __future__ import annotations

from typing import Any

import torch

from runner.hardware.base import Strategy
from runner.state import ProcessState


class SingleDevice(Strategy):
    """Train in this process on one device (`cpu` by default; `cuda`, `cuda:1`, `mps` also work).

    Args:
        device: the torch device to train on.
        num_threads: intra-op CPU threads (`torch.set_num_threads`); None keeps torch's default.
    """

    def __init__(self, device: str = "cpu", num_threads: int | None = None) -> None:
        self.device = torch.device(device)
        self.num_threads = num_threads

    def setup_environment(self) -> ProcessState:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        return ProcessState(device=self.device)

    def barrier(self) -> None:
        pass

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object_list(self, objects: list[Any], src: int = 0) -> list[Any]:
        return objects

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]
