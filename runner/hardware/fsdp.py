"""`hardware=fsdp`: fully sharded data parallel (FSDP2, `fully_shard`): each rank holds a shard of every
parameter, gradient and optimizer state."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from runner.config import PositiveInt, ShardDegree, checked
from runner.hardware.mesh import MeshStrategy, ParallelDims
from runner.hardware.parallelize import ShardedState, apply_cp, apply_fsdp, check_units, sharding_units
from runner.precision import MixedPrecision, Precision, ShardedMixedPrecision, refuse_fp16
from runner.state import DistributedType


class FSDP(ShardedState, MeshStrategy):
    """Shard the model over all ranks with `fully_shard`: each module whose class is named in
    `shard_modules` (e.g. the transformer block) is one unit, gathered just before its forward and
    backward; the root module holds the rest.

    Args (beyond `ParallelStrategy`'s):
        shard_modules: class names of the sharding units; None: those the model declares indivisible
            (`_no_split_modules`, transformers' convention: its decoder layer; GPT's Block); []: the root
            module only.
        reshard_after_forward: free gathered parameters after each unit's forward (saves memory, costs a
            second all-gather in backward).
        cpu_offload: keep parameter shards, gradients and optimizer states in CPU memory.
        dp_replicate: HSDP: the ranks form this many replica groups, each sharding the model over its
            world_size / dp_replicate ranks (all-gathers stay within a group, e.g. a node; gradients are
            averaged across groups). 1: one group of all ranks (plain FSDP).
        dp_shard: ranks each parameter is sharded over (-1: world_size / dp_replicate / cp_size); the
            degrees must multiply to the world size.
        cp_size: context parallel: ranks each training sequence is split over (`MeshStrategy`); they read
            the same batches, and parameters are sharded over dp_shard x cp_size.

    bf16 comes from the precision group as FSDP's MixedPrecisionPolicy (parameters gathered in bf16,
    gradients reduced in fp32, outputs fp32). Checkpoints are sharded (torch.distributed.checkpoint);
    `save_model` gathers the full weights on rank 0.
    """

    distributed_type = DistributedType.FSDP

    @checked("hardware")
    def __init__(
        self,
        shard_modules: list[str] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        dp_replicate: PositiveInt = 1,
        dp_shard: ShardDegree = -1,
        cp_size: PositiveInt = 1,
        **process_group: Any,
    ) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        super().__init__(
            ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp_size), **process_group
        )
        self.shard_modules = None if shard_modules is None else list(shard_modules)
        self.reshard_after_forward = reshard_after_forward
        # pinned host memory only where there is a device to copy to and from
        self.offload_policy = (
            CPUOffloadPolicy(pin_memory=self.device_type == "cuda") if cpu_offload else OffloadPolicy()
        )
        self.mp_policy = MixedPrecisionPolicy()

    def setup_precision(self, precision: Precision) -> Precision:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        refuse_fp16(precision, "fsdp", "loss scaling of sharded gradients is not supported here")
        if isinstance(precision, MixedPrecision):
            self.mp_policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
            return ShardedMixedPrecision(precision)
        return precision

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        super().check_model(model, world_size)
        check_units(model, self.shard_modules or [])

    def block_classes(self, module: torch.nn.Module) -> list[str]:
        return sharding_units(module, self.shard_modules)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # dp_shard stays in the mesh at size 1: FSDP over (dp_replicate, 1) replicates, over one dim shards.
        mesh = self.sharding_mesh()
        assert mesh is not None, "dp_shard is always in the mesh"
        if self.context_parallel is not None:
            apply_cp(module, self.context_parallel)
        self.apply_compute(module)
        self.replace_parameters(
            module,
            lambda: apply_fsdp(
                module,
                mesh,
                sharding_units(module, self.shard_modules),
                self.reshard_after_forward,
                self.mp_policy,
                self.offload_policy,
            ),
        )
        return module

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
