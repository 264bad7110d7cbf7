"""`hardware=tensor_parallel`: Megatron-style tensor parallelism on DTensor, pipeline parallel, context parallel,
and data parallel (FSDP2) over the rest of the world, on one ("pp", "dp_shard", "cp", "tp") mesh
(`ParallelDims`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from runner.config import ActivationCheckpointingConfig, CompileConfig, PositiveInt, ShardDegree, checked
from runner.errors import ConfigError
from runner.hardware.mesh import MeshStrategy, ParallelDims
from runner.hardware.parallelize import (
    ShardedState,
    apply_cp,
    apply_fsdp,
    apply_tp,
    check_units,
    compute_settings,
    declared_tp_plan,
    sharding_units,
)
from runner.hardware.pipeline import (
    PipelinedModel,
    check_microbatches,
    check_pipeline,
    describe_stages,
    in_flight,
    split_stages,
    tied_across_stages,
)
from runner.precision import Precision, refuse_fp8, refuse_fp16
from runner.state import DistributedType
from runner.task import POSITIONS, trains_by_loss


class TensorParallel(ShardedState, MeshStrategy):
    """Split each layer of the model over `tp_size` ranks by the model's own plan (`model.tp_plan(tp_size,
    sequence_parallel)`, declared next to its definition: column-wise then row-wise linear layers, one
    all-reduce per sub-layer). A world of `tp_size` x N ranks is N-way data parallel too: FSDP2 shards the
    model over the "dp_shard" dimension of the mesh (`apply_tp`, then `apply_fsdp`). Ranks of one
    tensor-parallel group read the same batches: the data is split over "dp_shard" only, and
    `gather`/`reduce` collect over it.
    Checkpoints are sharded (DCP, any layout reads them), the final `model/` holds the full weights.

    Args (beyond `ParallelStrategy`'s):
        tp_size: ranks each layer is split over; must divide the world size and the model's heads and widths.
        sequence_parallel: also split the activations between the tensor-parallel layers along the
            sequence (the plan's `sequence_parallel`).
        shard_modules, reshard_after_forward: FSDP2's, for the data-parallel dimension (`hardware=fsdp`'s:
            None, the model's `_no_split_modules`; [], the root only).
        dp_replicate, dp_shard: the data-parallel ranks as `hardware=fsdp` has them (HSDP: replica groups
            that each shard over dp_shard ranks; -1: the rest of the world).
        pp_size: pipeline stages. Above 1 the model's blocks are split into `pp_size x virtual_stages`
            stages (`runner.hardware.pipeline`), each then split by tensor parallel and sharded over
            "dp_shard", and the loss comes from `training_loss`, which runs `pp_schedule` ("gpipe",
            "1f1b", "interleaved_1f1b") over `microbatches` slices of each batch.
        cp_size: context parallel: ranks each training sequence is split over (`MeshStrategy`), within
            each data-parallel rank; FSDP2 shards over dp_shard x cp_size. Not with pp_size above 1.
    """

    distributed_type = DistributedType.MEGATRON_LM
    always = ("dp_shard", "tp")  # indexed even at size 1

    @checked("hardware")
    def __init__(
        self,
        tp_size: PositiveInt = 2,
        sequence_parallel: bool = False,
        shard_modules: list[str] | None = None,
        reshard_after_forward: bool = True,
        pp_size: PositiveInt = 1,
        dp_replicate: PositiveInt = 1,
        dp_shard: ShardDegree = -1,
        pp_schedule: str = "1f1b",
        microbatches: PositiveInt = 4,
        virtual_stages: PositiveInt = 1,
        cp_size: PositiveInt = 1,
        **process_group: Any,
    ) -> None:
        super().__init__(
            ParallelDims(pp=pp_size, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp_size, tp=tp_size),
            **process_group,
        )
        self.tp_size, self.pp_size = tp_size, pp_size
        self.sequence_parallel = sequence_parallel
        self.shard_modules = None if shard_modules is None else list(shard_modules)
        self.reshard_after_forward = reshard_after_forward
        self.pp_schedule, self.microbatches, self.virtual_stages = pp_schedule, microbatches, virtual_stages
        self.precision: Precision | None = None
        self._norm_duplicates: set[int] = set()  # tied weights' second copies (a pipeline's head)

    def setup_precision(self, precision: Precision) -> Precision:
        """bf16 by autocast around the forward (parameters stay fp32 on every mesh); fp16 is refused."""
        refuse_fp16(precision, "tensor_parallel", "loss scaling of DTensor gradients is not supported here")
        refuse_fp8(
            precision,
            "tensor_parallel",
            "float8 linears need torchao's float8 tensor-parallel styles, not used here",
        )
        self.precision = precision  # each pipeline stage runs its forward in it
        return precision

    def setup_compute(self, compile: CompileConfig, checkpointing: ActivationCheckpointingConfig) -> None:
        """Either compute option works with tensor parallel; both at once do not (torch 2.13 cannot save a
        compiled block's DTensor inputs for its checkpointed backward: its device mesh is not a tensor)."""
        asked = compute_settings(compile, checkpointing)
        if len(asked) > 1:
            raise ConfigError(
                f"{' and '.join(asked)} with hardware=tensor_parallel: a compiled block that is also checkpointed fails "
                "under tensor parallel in this torch (its backward cannot save the DTensors' device mesh). Keep "
                "one of them: trainer.compile.scope=none, or trainer.activation_checkpointing.mode=none."
            )
        super().setup_compute(compile, checkpointing)

    def layout(self, world_size: int) -> str:
        layout = super().layout(world_size)
        if self.pp_size == 1:
            return layout
        stages = self.pp_size * self.virtual_stages
        return (
            f"{layout}; {stages} pipeline stages ({self.virtual_stages} per pp rank), {self.pp_schedule} over "
            f"{self.microbatches} microbatches"
        )

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        super().check_model(model, world_size)
        check_units(model, self.shard_modules or [])
        if self.pp_size > 1 and self.dims.cp > 1:
            raise ConfigError(
                f"hardware.pp_size={self.pp_size} with hardware.cp_size={self.dims.cp}: context parallel is not "
                "built into the pipeline stages here. Use one of them."
            )
        if self.tp_size > 1:
            self._plan(model)
        if self.pp_size > 1:
            check_pipeline(model, self.pp_size, self.pp_schedule, self.microbatches, self.virtual_stages)

    def activation_share(self) -> float:
        """Under pipeline parallel: a stage's share of the blocks, times the microbatches in flight on the
        first stage (`in_flight`) over all of them."""
        if self.pp_size == 1:
            return super().activation_share()
        return in_flight(self.pp_schedule, self.microbatches, self.pp_size * self.virtual_stages) / (
            self.microbatches * self.pp_size
        )

    def describe_stages(self, model: torch.nn.Module) -> str | None:
        if self.pp_size == 1:
            return None
        return describe_stages(model, self.pp_size, self.virtual_stages, self.pp_schedule, self.microbatches)

    def check_training(self, task: Any, batch_size: int, sample: Any = None) -> None:
        super().check_training(task, batch_size, sample)
        if self.pp_size == 1:
            return
        if not trains_by_loss(task):
            raise ConfigError(
                f"hardware.pp_size={self.pp_size}: the task {type(task).__name__} has its own training_step; under "
                "pipeline parallel the last stage computes the loss per microbatch, so the task must define "
                "`loss(outputs, batch)` and keep runner.task.Task's training_step (which applies it). Move the "
                "loss there, or use hardware.pp_size=1."
            )
        if isinstance(sample, dict) and POSITIONS in sample:
            raise ConfigError(
                f"hardware.pp_size={self.pp_size} with samples that mask attention by document (data.document_mask"
                "=true): the pipeline's stages take the token ids only. Use data.document_mask=false, or "
                "hardware.pp_size=1."
            )
        check_microbatches(batch_size, self.microbatches)

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
            f"hardware=tensor_parallel: {type(model).__name__} declares no tensor-parallel plan (a `tp_plan(tp_size, sequence_parallel)` "
            "method returning {module name pattern: ParallelStyle}, as runner.models.GPT has, or transformers' "
            "`_tp_plan`). Add one, or use hardware=fsdp or ddp."
        )

    def block_classes(self, module: torch.nn.Module) -> list[str]:
        return sharding_units(module, self.shard_modules)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Split the model into this rank's pipeline stages (`pp_size` > 1), then apply tensor parallel,
        the compute options and FSDP to each: torchtitan's order."""
        assert self.mesh is not None, "setup_environment() first"
        if self.pp_size == 1:
            return self.replace_parameters(module, lambda: self._parallelize(module))
        return self.replace_parameters(module, lambda: self._pipeline(module))

    def _pipeline(self, module: torch.nn.Module) -> PipelinedModel:
        assert self.mesh is not None and self.precision is not None
        mesh, dp = self.mesh, self.mesh["dp_shard"]  # a tied weight is sharded over dp_shard only
        plan = self._plan(module) if self.tp_size > 1 else {}  # the model's, whose names the stages keep
        stages = split_stages(module, mesh.get_local_rank("pp"), self.pp_size, self.virtual_stages)
        tied = tied_across_stages(module, stages)
        for stage in stages.values():
            self._parallelize(stage, plan)
            self.precision.setup_module(stage)

        def local_shard(shape: torch.Size) -> torch.Size:  # FSDP2's piece of a tied weight on this rank
            if dp.size() == 1:
                return shape
            pieces = torch.empty(shape, device="meta").chunk(dp.size())
            rank = dp.get_local_rank()
            return pieces[rank].shape if rank < len(pieces) else torch.Size([0, *shape[1:]])

        pipelined = PipelinedModel(
            stages,
            self.pp_size * self.virtual_stages,
            mesh.get_group("pp"),
            self.device,
            self.pp_schedule,
            self.microbatches,
            tied,
            local_shard,
            order=[name for name, _ in module.named_children()],
        )
        held = dict(pipelined.named_parameters(remove_duplicate=False))
        self._norm_duplicates = {id(held[t.name]) for t in tied if not t.canonical and t.name in held}
        return pipelined

    def _parallelize(self, module: torch.nn.Module, plan: dict[str, Any] | None = None) -> None:
        """Tensor parallel over "tp" (by `plan`, else the module's own), context parallel over "cp", the
        compute options, FSDP2 over "dp_shard" x "cp": in place."""
        assert self.mesh is not None
        mesh = self.mesh

        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

        if mesh["tp"].size() > 1:
            apply_tp(module, mesh["tp"], plan or self._plan(module))
        if self.context_parallel is not None:
            apply_cp(module, self.context_parallel)
        self.apply_compute(module)
        data = self.sharding_mesh()
        if data is not None and data.size() > 1:
            no_cast, no_offload = MixedPrecisionPolicy(), OffloadPolicy()  # bf16 is autocast's here
            apply_fsdp(
                module,
                data,
                sharding_units(module, self.shard_modules),
                self.reshard_after_forward,
                no_cast,
                no_offload,
            )

    def training_loss(
        self,
        module: torch.nn.Module,
        batch: Any,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        scale: float = 1.0,
        sync_gradients: bool = True,
    ) -> torch.Tensor:
        """Under pipeline parallel: the schedule's forward and backward over the microbatches, the tied
        weights' gradients summed over the stages at a synchronisation step; the mean loss, detached."""
        if self.pp_size == 1:
            return super().training_loss(module, batch, loss_fn, scale, sync_gradients)
        assert isinstance(module, PipelinedModel)
        loss = module.training_loss(batch, loss_fn, scale)
        if sync_gradients:
            module.sync_tied_gradients()
        return loss

    def backward(
        self,
        loss: torch.Tensor,
        precision: Precision,
        sync_gradients: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """Under pipeline parallel the schedule ran the backward in `training_loss`: nothing to do."""
        if self.pp_size == 1:
            super().backward(loss, precision, sync_gradients, options)

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 (a collective); under pipeline parallel each stage's, gathered from
        the first rank of its data-parallel and tensor-parallel groups."""
        if self.pp_size == 1:
            return super().full_state_dict(module)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.mesh is not None
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        assert self._data_mesh is not None
        sends = self._data_mesh.get_local_rank() == 0 and self.mesh["tp"].get_local_rank() == 0
        part = {name: tensor.cpu() for name, tensor in state.items()} if sends else {}
        parts: list[dict[str, torch.Tensor]] | None = (
            [{}] * dist.get_world_size() if dist.get_rank() == 0 else None
        )
        dist.gather_object(part, parts, dst=0)
        return {name: tensor for piece in parts or [] for name, tensor in piece.items()}

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """The norm of all gradients, whatever mesh each lives on (tp, dp x tp, or replicated)."""
        from torch.distributed.tensor import DTensor

        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params]
        norms = [p.grad.norm(norm_type) for p in params if id(p) not in self._norm_duplicates]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        total = (
            torch.linalg.vector_norm(torch.stack(norms), norm_type)
            if norms
            else torch.zeros((), device=self.device)
        )
        if self.pp_size > 1:  # each stage holds some of the gradients: combine the norms over the pipeline
            assert self.mesh is not None
            group = self.mesh.get_group("pp")
            if norm_type == float("inf"):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
            else:
                total = total**norm_type
                dist.all_reduce(total, group=group)
                total = total ** (1.0 / norm_type)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return total
