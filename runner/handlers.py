"""Accelerate's configuration objects for `Accelerator(...)`: the kwargs handlers (`kwargs_handlers=[...]`),
`DataLoaderConfiguration` and `GradientAccumulationPlugin`, with Accelerate's names, fields and defaults.

The Accelerator hands each handler to what it configures: the process group and DDP to the hardware
strategy, loss scaling and autocast to the precision plugin; the profiler it runs itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

import torch


class KwargsHandler:
    """A handler's `to_kwargs()`: the fields set to something other than their default (the only ones
    that are applied, as in Accelerate)."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }


class DDPCommunicationHookType(str, Enum):
    """How DDP compresses gradients before its all-reduce (`DistributedDataParallelKwargs.comm_hook`)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """DistributedDataParallel's arguments, and a communication hook (`comm_hook`, optionally wrapped by
    `comm_wrapper` to compress PowerSGD's output; `comm_state_option`: PowerSGDState's arguments)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """`torch.distributed.init_process_group`'s backend, init_method and timeout (each applied only when
    set to something other than its default)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """`torch.amp.GradScaler`'s arguments for fp16 loss scaling."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    """`torch.autocast`'s `enabled` and `cache_enabled` for mixed precision."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """`torch.profiler.profile`'s arguments for `Accelerator.profile()`; with `output_trace_dir` each
    process writes its Chrome trace there (`profile_<i>.json`, as Accelerate names it)."""

    activities: list[str] | None = None  # "cpu", "cuda", "xpu"
    schedule_option: dict[str, int] | None = None  # torch.profiler.schedule's wait, warmup, active, ...
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The profiler these settings describe."""
        activities = None
        if self.activities is not None:
            known = {a.name.lower(): a for a in torch.profiler.ProfilerActivity.__members__.values()}
            unknown = [a for a in self.activities if a.lower() not in known]
            if unknown:
                raise ValueError(
                    f"ProfileKwargs.activities: unknown {unknown}; expected some of {sorted(known)}."
                )
            activities = [known[a.lower()] for a in self.activities]
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(**self.schedule_option) if self.schedule_option else None,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@dataclass
class DataLoaderConfiguration:
    """How `prepare` shards dataloaders.

    split_batches: the loader's batch size is the global one, split across processes.
    even_batches: every process gets as many batches (the last ones completed from the start).
    dispatch_batches: process 0 reads every batch and sends the shares: not supported (each process reads
        its own share; True is refused).
    use_seedable_sampler: every process shuffles in the same order (runner's prepared loaders always do:
        their sampler's generator is synchronised from process 0 before each pass).
    data_seed: seed of the prepared loaders' shuffling generator (None: from the global seed).
    non_blocking: copy batches to the device asynchronously (from pinned memory, on CUDA).
    use_stateful_dataloader: prepared loaders with `state_dict()` (runner's always have one).
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        if self.dispatch_batches:
            raise ValueError(
                "DataLoaderConfiguration(dispatch_batches=True) is not supported: each process reads its own "
                "share of the data. Leave dispatch_batches unset (an IterableDataset is sharded sample by "
                "sample)."
            )


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation.

    num_steps: micro-batches per optimizer step.
    adjust_scheduler: on a micro-step, count a scheduler step without taking it (`_step_count`, which
        bounds OneCycleLR) as Accelerate does.
    sync_with_dataloader: the last batch of a dataloader always completes an optimizer step.
    sync_each_batch: all-reduce the gradients of every micro-batch (less memory under FSDP; slower).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
