"""`hardware=ddp`: data parallel, one model replica per rank (DistributedDataParallel)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from runner.config import PositiveFloat, checked
from runner.hardware.parallelize import DDPOptions, apply_ddp, register_comm_hook
from runner.hardware.process_group import ParallelStrategy


class DDP(ParallelStrategy):
    """Replicate the model on every rank and average gradients during backward.

    Args (beyond `ParallelStrategy`'s): DistributedDataParallel's own, passed through.
        find_unused_parameters: allow parameters that get no gradient in a step (slower).
        bucket_cap_mb: gradient bucket size; None: torch's default (25 MB).
        gradient_as_bucket_view: gradients alias the communication buckets (saves memory).
        static_graph: the set of used parameters never changes between steps.
    """

    reshards_checkpoints = True  # the main process writes the whole model: any number of ranks loads it

    @checked("hardware")
    def __init__(
        self,
        find_unused_parameters: bool = False,
        bucket_cap_mb: PositiveFloat | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        **process_group: Any,
    ) -> None:
        super().__init__(**process_group)
        self.ddp_kwargs = {
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
        }
        if bucket_cap_mb is not None:
            self.ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        self.comm = DDPOptions()  # the communication hook

    def use_ddp(self, options: DDPOptions) -> None:
        self.ddp_kwargs.update(options.module)
        self.comm = options

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.apply_compute(module)
        wrapped = apply_ddp(module, self.device, **self.ddp_kwargs)
        register_comm_hook(wrapped, self.comm.comm_hook, self.comm.comm_wrapper, self.comm.comm_state)
        return wrapped

    @contextmanager
    def trigger_sync_in_backward(self, module: torch.nn.Module) -> Iterator[None]:
        if not isinstance(module, DistributedDataParallel):
            yield
            return
        before = module.require_backward_grad_sync, module.require_forward_param_sync
        module.require_backward_grad_sync = module.require_forward_param_sync = True
        module.reducer.prepare_for_backward([])  # what DDP's forward does when it will sync
        try:
            yield
        finally:
            module.require_backward_grad_sync, module.require_forward_param_sync = before

    def join(self, joinables: list[Any]) -> AbstractContextManager:
        return Join(joinables)

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_sync(self, module: torch.nn.Module) -> AbstractContextManager:
        return module.no_sync() if isinstance(module, DistributedDataParallel) else nullcontext()
