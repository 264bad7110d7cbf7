"""`hardware=megatron`: Megatron-style tensor parallelism on DTensor, data parallel (FSDP2) over the rest
of the world on a 2-D ("dp_shard", "tp") mesh (`ParallelDims`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from runner.config import ActivationCheckpointingConfig, CompileConfig
from runner.errors import ConfigError
from runner.hardware.mesh import ParallelDims
from runner.hardware.parallel import ParallelStrategy
from runner.hardware.parallelize import (
    ShardedState,
    apply_fsdp,
    apply_tp,
    compute_settings,
    declared_tp_plan,
    sharding_units,
)
from runner.precision import Precision, refuse_fp8, refuse_fp16
from runner.state import DistributedType, ProcessState


class TensorParallel(ShardedState, ParallelStrategy):
    """Split each layer of the model over `tp_size` ranks by the model's own plan (`model.tp_plan(tp_size,
    sequence_parallel)`, declared next to its definition: column-wise then row-wise linear layers, one
    all-reduce per sub-layer). A world of `tp_size` x N ranks is N-way data parallel too: FSDP2 shards the
    model over the "dp_shard" dimension of the mesh (`apply_tp`, then `apply_fsdp`). Ranks of one
    tensor-parallel group read the same batches: the data is split over "dp_shard" only, and
    `gather`/`reduce` collect over it.
    Checkpoints are sharded (DCP), the final `model/` holds the full weights, as with FSDP.

    Args (beyond `ParallelStrategy`'s):
        tp_size: ranks each layer is split over; must divide the world size and the model's heads and widths.
        sequence_parallel: also split the activations between the tensor-parallel layers along the
            sequence (the plan's `sequence_parallel`).
        shard_modules, reshard_after_forward: FSDP2's, for the data-parallel dimension (`hardware=fsdp`'s:
            None, the model's `_no_split_modules`; [], the root only).
    """

    distributed_type = DistributedType.MEGATRON_LM

    def __init__(
        self,
        tp_size: int = 2,
        sequence_parallel: bool = False,
        shard_modules: list[str] | None = None,
        reshard_after_forward: bool = True,
        **process_group: Any,
    ) -> None:
        if tp_size < 1:
            raise ConfigError(f"hardware.tp_size={tp_size}: must be >= 1.")
        super().__init__(**process_group)
        self.tp_size = tp_size
        self.sequence_parallel = sequence_parallel
        self.shard_modules = None if shard_modules is None else list(shard_modules)
        self.reshard_after_forward = reshard_after_forward
        self.mesh: DeviceMesh | None = None

    def setup_precision(self, precision: Precision) -> Precision:
        """bf16 by autocast around the forward (parameters stay fp32 on every mesh); fp16 is refused."""
        refuse_fp16(precision, "megatron", "loss scaling of DTensor gradients is not supported here")
        refuse_fp8(
            precision,
            "megatron",
            "float8 linears need torchao's float8 tensor-parallel styles, not used here",
        )
        return precision

    def setup_compute(self, compile: CompileConfig, checkpointing: ActivationCheckpointingConfig) -> None:
        """Either compute option works with tensor parallel; both at once do not (torch 2.13 cannot save a
        compiled block's DTensor inputs for its checkpointed backward: its device mesh is not a tensor)."""
        asked = compute_settings(compile, checkpointing)
        if len(asked) > 1:
            raise ConfigError(
                f"{' and '.join(asked)} with hardware=megatron: a compiled block that is also checkpointed fails "
                "under tensor parallel in this torch (its backward cannot save the DTensors' device mesh). Keep "
                "one of them: trainer.compile.scope=none, or trainer.activation_checkpointing.mode=none."
            )
        super().setup_compute(compile, checkpointing)

    def data_parallel_size(self, world_size: int) -> int:
        return ParallelDims(tp=self.tp_size).resolved(world_size).dp

    def layout(self, world_size: int) -> str:
        return ParallelDims(tp=self.tp_size).resolved(world_size).describe()

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        ParallelDims(tp=self.tp_size).resolved(world_size)
        self._plan(model)

    def _plan(self, model: torch.nn.Module) -> dict[str, Any]:
        """The model's own `tp_plan(tp_size, sequence_parallel)`, else the plan it declares the transformers
        way (`_tp_plan`: module name patterns -> "colwise" / "rowwise")."""
        try:
            if callable(getattr(model, "tp_plan", None)):
                return model.tp_plan(self.tp_size, sequence_parallel=self.sequence_parallel)
            if getattr(model, "_tp_plan", None):
                if self.sequence_parallel:
                    raise ConfigError(
                        f"hardware.sequence_parallel=true: {type(model).__name__}'s tensor-parallel plan comes from "
                        "transformers (`_tp_plan`), which splits its linear layers only. Use "
                        "hardware.sequence_parallel=false."
                    )
                return declared_tp_plan(model, self.tp_size)
        except ValueError as err:
            raise ConfigError(f"hardware.tp_size: {err} Pick a tp_size that divides it.") from None
        raise ConfigError(
            f"hardware=megatron: {type(model).__name__} declares no tensor-parallel plan (a `tp_plan(tp_size, sequence_parallel)` "
            "method returning {module name pattern: ParallelStyle}, as runner.models.GPT has, or transformers' "
            "`_tp_plan`). Add one, or use hardware=fsdp or multi_gpu."
        )

    def setup_environment(self) -> ProcessState:
        state = super().setup_environment()
        dims = ParallelDims(tp=self.tp_size).resolved(state.num_processes)
        self.mesh = dims.build_mesh(self.device.type, always=("dp_shard", "tp"))
        return dataclasses.replace(
            state, data_parallel_index=self.mesh.get_local_rank("dp_shard"), data_parallel_size=dims.dp
        )

    def block_classes(self, module: torch.nn.Module) -> list[str]:
        return sharding_units(module, self.shard_modules)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        assert self.mesh is not None, "setup_environment() first"
        mesh = self.mesh

        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

        def parallelize() -> None:
            apply_tp(module, mesh["tp"], self._plan(module))
            self.apply_compute(module)
            if mesh["dp_shard"].size() > 1:
                no_cast, no_offload = MixedPrecisionPolicy(), OffloadPolicy()  # bf16 is autocast's here
                apply_fsdp(
                    module,
                    mesh["dp_shard"],
                    sharding_units(module, self.shard_modules),
                    self.reshard_after_forward,
                    no_cast,
                    no_offload,
                )

        self.replace_parameters(module, parallelize)
        return module

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """The norm of all gradients, whatever mesh each lives on (tp, dp x tp, or replicated)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in parameters if p.grad is not None]
        norms = [g.norm(norm_type) for g in grads]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return total

    def data_group(self) -> dist.ProcessGroup:
        """The ranks of one tp group hold the same samples: the data collectives run over "dp_shard"."""
        assert self.mesh is not None, "setup_environment() first"
        return self.mesh.get_group("dp_shard")
