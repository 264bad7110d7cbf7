"""`hardware=megatron`: Megatron-style tensor parallelism on DTensor, data parallel (FSDP2) over the rest
of the world on a 2-D ("dp", "tp") mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from runner.errors import ConfigError
from runner.hardware.fsdp import FSDP
from runner.precision import MixedPrecision, Precision
from runner.state import ProcessState


class TensorParallel(FSDP):
    """Split each layer of the model over `tp_size` ranks by the model's own plan (`model.tp_plan(tp_size, sequence_parallel)`,
    declared next to its definition: column-wise then row-wise linear layers, one all-reduce per
    sub-layer). A world of `tp_size` x N ranks is N-way data parallel too: FSDP2 shards the model over the
    "dp" dimension of the mesh. Ranks of one tensor-parallel group read the same batches: the data is
    split over "dp" only, and `gather`/`reduce` collect over "dp". Checkpoints are sharded (DCP), the final
    `model/` holds the full weights, as with FSDP.

    Args (beyond `ParallelStrategy`'s):
        tp_size: ranks each layer is split over; must divide the world size and the model's heads and widths.
        sequence_parallel: also split the activations between the tensor-parallel layers along the
            sequence (the plan's `sequence_parallel`).
        shard_modules, reshard_after_forward: FSDP2's, for the data-parallel dimension.
    """

    def __init__(
        self,
        num_processes: int | None = None,
        device: str | None = None,
        backend: str | None = None,
        timeout_s: float = 1800.0,
        num_threads: int | None = None,
        tp_size: int = 2,
        sequence_parallel: bool = False,
        shard_modules: list[str] | None = None,
        reshard_after_forward: bool = True,
    ) -> None:
        if tp_size < 1:
            raise ConfigError(f"hardware.tp_size={tp_size}: must be >= 1.")
        super().__init__(
            num_processes, device, backend, timeout_s, num_threads, shard_modules, reshard_after_forward
        )
        self.tp_size = tp_size
        self.sequence_parallel = sequence_parallel
        self.mesh: DeviceMesh | None = None

    @property
    def sharded_states(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset({"weights", "gradients", "optimizer"})  # split over tp, and over dp by FSDP

    def setup_precision(self, precision: Precision) -> Precision:
        """bf16 by autocast around the forward (parameters stay fp32 on every mesh); fp16 is refused."""
        if isinstance(precision, MixedPrecision) and precision.mixed_precision == "fp16":
            raise ConfigError(
                "precision=fp16 with hardware=megatron: loss scaling of DTensor gradients is not supported here. "
                "Use precision=bf16 (no scaling needed) or precision=fp32."
            )
        return precision

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        if world_size % self.tp_size:
            raise ConfigError(
                f"hardware.tp_size={self.tp_size} does not divide the world size {world_size}: the ranks form groups "
                f"of tp_size. Use a tp_size that divides {world_size}, or {self.tp_size} x N processes."
            )
        self._plan(model)

    def _plan(self, model: torch.nn.Module) -> dict[str, Any]:
        if not callable(getattr(model, "tp_plan", None)):
            raise ConfigError(
                f"hardware=megatron: {type(model).__name__} declares no tensor-parallel plan (a `tp_plan(tp_size, sequence_parallel)` "
                "method returning {module name pattern: ParallelStyle}, as runner.models.GPT has). Add one, or use "
                "hardware=fsdp or multi_gpu."
            )
        try:
            return model.tp_plan(self.tp_size, sequence_parallel=self.sequence_parallel)
        except ValueError as err:
            raise ConfigError(f"hardware.tp_size: {err} Pick a tp_size that divides it.") from None

    def setup_environment(self) -> ProcessState:
        state = super().setup_environment()
        if state.num_processes % self.tp_size:
            raise ConfigError(
                f"hardware.tp_size={self.tp_size} does not divide the world size {state.num_processes}."
            )
        shape = (state.num_processes // self.tp_size, self.tp_size)
        self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("dp", "tp"))
        return dataclasses.replace(
            state, data_parallel_index=self.mesh.get_local_rank("dp"), data_parallel_size=shape[0]
        )

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        assert self.mesh is not None, "setup_environment() first"
        before = dict(module.named_parameters())
        parallelize_module(module, self.mesh["tp"], self._plan(module))
        if self.mesh["dp"].size() > 1:
            self.shard_fully(module, self.mesh["dp"])
        # Both replace parameters: remember which, for the optimizers.
        self._sharded.update({id(before[name]): param for name, param in module.named_parameters()})
        return module

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """The norm of all gradients, whatever mesh each lives on (tp, dp x tp, or replicated)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        norms = [g.norm(norm_type) for g in grads]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return total

    # Data collectives run over the data-parallel group: the ranks of one tp group hold the same samples.
    def _dp_group(self) -> dist.ProcessGroup:
        assert self.mesh is not None, "setup_environment() first"
        return self.mesh.get_group("dp")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        reduced = self._on_device(tensor)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=self._dp_group())
        if op == "mean":
            reduced = reduced / self.mesh["dp"].size()  # type: ignore[index]
        return reduced.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        local = self._on_device(tensor if tensor.ndim else tensor[None]).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.mesh["dp"].size())]  # type: ignore[index]
        dist.all_gather(parts, local, group=self._dp_group())
        return torch.cat(parts).to(tensor.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.mesh["dp"].size()  # type: ignore[index]
        dist.all_gather_object(gathered, obj, group=self._dp_group())
        return gathered
