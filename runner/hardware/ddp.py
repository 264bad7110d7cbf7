"""`hardware=multi_gpu`: data parallel, one model replica per rank (DistributedDataParallel)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from runner.hardware.parallel import ParallelStrategy
from runner.hardware.parallelize import apply_ddp


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
        find_unused_parameters: bool = False,
        bucket_cap_mb: float | None = None,
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

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.apply_compute(module)
        return apply_ddp(module, self.device, **self.ddp_kwargs)

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_sync(self, module: torch.nn.Module) -> AbstractContextManager:
        return module.no_sync() if isinstance(module, DistributedDataParallel) else nullcontext()
