"""Plain state objects the Accelerator passes around explicitly (no process-wide singletons)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class DistributedType(str, Enum):
    """How a job's processes share the work (Accelerate's names and values): each hardware strategy
    reports its own (`Strategy.distributed_type`, `Accelerator.distributed_type`)."""

    NO = "NO"  # one process
    MULTI_CPU = "MULTI_CPU"  # data parallel over CPU ranks
    MULTI_GPU = "MULTI_GPU"  # data parallel over GPUs
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"
    MEGATRON_LM = "MEGATRON_LM"  # tensor (x data) parallel
    XLA = "XLA"


@dataclass(frozen=True)
class ProcessState:
    """Where this process sits in the job: built once by the hardware strategy."""

    device: torch.device
    process_index: int = 0
    num_processes: int = 1
    local_process_index: int = 0
    # Which share of the data this process reads: its process index among all, unless the model itself
    # is split over several processes that then read the same batches (tensor parallel).
    data_parallel_index: int | None = None
    data_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.data_parallel_index is None:
            object.__setattr__(self, "data_parallel_index", self.process_index)
        if self.data_parallel_size is None:
            object.__setattr__(self, "data_parallel_size", self.num_processes)

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0


@dataclass
class GradientState:
    """Gradient-accumulation bookkeeping shared by the Accelerator, its optimizers, schedulers and loaders.

    `end_of_dataloader` refers to the innermost dataloader being iterated, so an evaluation loop run in
    the middle of a training epoch does not force a gradient sync.
    """

    num_steps: int = 1
    sync_gradients: bool = True
    adjust_scheduler: bool = True  # the Engine's `Accumulation` settings
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    active_dataloaders: list[Any] = field(default_factory=list)

    @property
    def end_of_dataloader(self) -> bool:
        loaders = self.active_dataloaders
        return loaders[-1].end_of_dataloader if loaders else False
