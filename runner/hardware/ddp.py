"""`hardware=multi_gpu`: data parallel, one model replica per rank (DistributedDataParallel)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel

from runner.hardware.parallel import ParallelStrategy


class DDP(ParallelStrategy):
    """Replicate the model on every rank and average gradients during backward.

    Args (beyond `ParallelStrategy`'s): DistributedDataParallel's own, passed through.
        find_unused_parameters: allow parameters that get no gradient in a step (slower).
        bucket_cap_mb: gradient bucket size; None: torch's default (25 MB).
        gradient_as_bucket_view: gradients alias the communication buckets (saves memory).
        static_graph: the set of used parameters never changes between steps.
    """

    def __init__(
        self,
        num_processes: int | None = None,
        device: str | None = None,
        backend: str | None = None,
        timeout_s: float = 1800.0,
        num_threads: int | None = None,
        find_unused_parameters: bool = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__(num_processes, device, backend, timeout_s, num_threads)
        self.ddp_kwargs = {
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
        }
        if bucket_cap_mb is not None:
            self.ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_sync(self, module: torch.nn.Module) -> AbstractContextManager:
        return module.no_sync() if isinstance(module, DistributedDataParallel) else nullcontext()
