"""The dataloader that `Accelerator.prepare` returns."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader

from runner.ops import send_to_device
from runner.state import GradientState

_END = object()


class DataLoaderShard:
    """Iterates a DataLoader, puts each batch on the device and knows when it yields the last batch.

    It reads one batch ahead, so `end_of_dataloader` is already True while the last batch is being used
    (gradient accumulation then syncs on it). Attributes it does not define (`dataset`, `batch_size`,
    `sampler`, ...) are the wrapped loader's.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        gradient_state: GradientState,
        device: torch.device | None = None,
        num_processes: int = 1,
    ) -> None:
        self.base_dataloader = dataloader
        self.gradient_state = gradient_state
        self.device = device
        self.end_of_dataloader = False
        self.iteration = 0
        self._place: Callable[[Any], Any] = (
            (lambda batch: batch) if device is None else partial(send_to_device, device=device)
        )
        self.remainder = _remainder(dataloader, num_processes)

    def __iter__(self) -> Iterator[Any]:
        self.end_of_dataloader = False
        self.gradient_state.active_dataloaders.append(self)
        try:
            iterator = iter(self.base_dataloader)
            batch = next(iterator, _END)
            while batch is not _END:
                upcoming = next(iterator, _END)
                self.end_of_dataloader = upcoming is _END
                yield self._place(batch)
                batch = upcoming
            self.iteration += 1
        finally:
            self.gradient_state.active_dataloaders.remove(self)

    def __len__(self) -> int:
        return len(self.base_dataloader)

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler (and a dataset that wants it) which epoch starts, so shuffles differ per epoch."""
        self.iteration = epoch
        for obj in (self.base_dataloader.sampler, self.base_dataloader.batch_sampler, self.dataset):
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name == "base_dataloader":  # not yet set (unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)


def _remainder(dataloader: DataLoader, num_processes: int) -> int:
    """Samples in the last global batch, or -1 where the dataset length is unknown."""
    try:
        total_batch_size = (dataloader.batch_size or 1) * num_processes
        return len(dataloader.dataset) % total_batch_size  # type: ignore[arg-type]
    except TypeError:
        return -1
