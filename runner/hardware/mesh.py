"""One description of how a job's ranks are laid out: the degrees of each parallelism, checked against the
world size, and the `DeviceMesh` built from them (torchtitan's `ParallelDims`); `MeshStrategy`, the base of
the strategies that lay their ranks out on it (FSDP, tensor parallel)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runner.config import PythonOnly
from runner.errors import ConfigError
from runner.hardware.context_parallel import ContextParallel
from runner.hardware.process_group import ParallelStrategy
from runner.models.sequence_shares import share_problem
from runner.state import ProcessState
from runner.task import POSITIONS, trains_by_loss
from runner.torch_internals import flatten_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Degrees whose product is the world size, outermost first.

    pp: pipeline stages (ranks that each hold a slice of the model's blocks and pass activations on).
    dp_replicate: groups that each hold a whole copy of the (sharded) model and average gradients
        across (HSDP's replicas; DDP when dp_shard is 1).
    dp_shard: ranks of one group that shard parameters, gradients and optimizer states (FSDP); -1: what
        the world leaves once the other degrees are set.
    cp: ranks each sequence is split over (context parallel): they read the same batches and, like
        data-parallel ranks, average their gradients (FSDP shards over dp_shard x cp).
    tp: ranks each layer is split over (tensor parallel).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1

    NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

    def resolved(self, world_size: int) -> ParallelDims:
        """These degrees for `world_size` ranks (`dp_shard=-1` filled in); ConfigError naming the degrees
        set when they do not multiply to it."""
        settings = {
            "pp_size": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp_size": self.cp,
            "tp_size": self.tp,
        }
        defaults = {"pp_size": 1, "dp_replicate": 1, "dp_shard": -1, "cp_size": 1, "tp_size": 1}
        named = (
            ", ".join(f"hardware.{k}={v}" for k, v in settings.items() if v != defaults[k]) or "the defaults"
        )
        if min(self.pp, self.dp_replicate, self.cp, self.tp) < 1 or self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(
                f"{named}: each degree must be >= 1 (dp_shard may be -1: the rest of the world)."
            )
        others = self.pp * self.dp_replicate * self.cp * self.tp
        fixed = others * max(self.dp_shard, 1)
        if world_size % fixed or (self.dp_shard != -1 and fixed != world_size):
            rest = " (dp_shard takes the rest of the ranks)" if self.dp_shard == -1 else ""
            factors = " x ".join(name for name in settings if name != "cp_size" or self.cp > 1)
            raise ConfigError(
                f"{named}: the parallel degrees ({factors} = {fixed}{rest}) must multiply to the world size, "
                f"{world_size} ranks. Change them, or run a multiple of {fixed} ranks."
            )
        return replace(self, dp_shard=world_size // others)

    @property
    def dp(self) -> int:
        """Ranks that read different data: every data-parallel rank, replicated or sharded."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str, always: tuple[str, ...] = ()) -> DeviceMesh:
        """The mesh over the world: one named dimension per degree above 1 or named in `always` (a
        world of one: "dp_shard" of size 1). Call on resolved degrees."""
        assert self.dp_shard > 0, "resolved() first"
        dims = [(name, size) for name, size in self.degrees().items() if size > 1 or name in always]
        dims = dims or [("dp_shard", 1)]
        return init_device_mesh(
            device_type, tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims)
        )

    def describe(self, shown_ranks: int = 8) -> str:
        """The mesh in words, with each rank's coordinates (the first `shown_ranks`). Call on resolved
        degrees."""
        degrees = self.degrees()
        world = self.pp * self.dp * self.cp * self.tp
        sizes = list(degrees.values())
        coordinates = []
        for rank in range(min(world, shown_ranks)):
            position, rest = [], rank
            for size in reversed(sizes):
                rest, index = divmod(rest, size)
                position.append(index)
            coordinates.append(f"{rank}:({','.join(map(str, reversed(position)))})")
        more = f" ... ({world} ranks)" if world > shown_ranks else ""
        mesh = " x ".join(f"{name} {size}" for name, size in degrees.items())
        return f"{mesh}; rank:({','.join(degrees)}) {' '.join(coordinates)}{more}"

    def degrees(self) -> dict[str, int]:
        """Each degree by name; "cp" only where it is above 1 (a job without context parallel reads as
        before it existed)."""
        return {name: getattr(self, name) for name in self.NAMES if name != "cp" or self.cp > 1}

    @staticmethod
    def flattened(mesh: DeviceMesh, names: tuple[str, ...], name: str) -> DeviceMesh | None:
        """The dimensions `names` of `mesh` that it has, as one (flattened into `name` where there are
        several); None: it has none of them."""
        present = tuple(n for n in names if n in (mesh.mesh_dim_names or ()))
        if len(present) < 2:
            return mesh[present[0]] if present else None
        return flatten_mesh(mesh[present], name)


ACCELERATE_FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


class MeshStrategy(ParallelStrategy):
    """A strategy whose ranks are laid out on one `ParallelDims` mesh (FSDP, tensor parallel): the mesh is
    built when the process joins; ranks that split the model or its sequences (a tp or cp group) read the
    same batches, so the data is split, gathered and reduced over the data-parallel ranks only.

    Context parallel (`dims.cp` above 1): the ranks of a cp group each train on their share of every
    sequence (`runner.hardware.context_parallel`): `training_loss` shards the batch (a ported Accelerate
    script cuts its buffers with `context_parallel.cut_in_place`), the model computes its
    attention over the whole sequences gathered (runner.models.GPT declares `context_parallel(cp)`;
    transformers causal LMs are set up by `runner.models.sequence_shares`), the loss has the whole
    sequences' value, and FSDP averages gradients over dp_shard x cp. Evaluation runs whole sequences
    (the model in `eval()` attends as one process).
    """

    # The mesh dimensions kept at size 1 (the ones a strategy indexes even when they are trivial).
    always: tuple[str, ...] = ("dp_shard",)

    def __init__(self, dims: PythonOnly[ParallelDims], **process_group: Any) -> None:
        super().__init__(**process_group)
        self.dims = dims
        self.mesh: DeviceMesh | None = None  # over the world, once the process has joined
        self.context_parallel: ContextParallel | None = None
        self._data_mesh: DeviceMesh | None = None
        self._sharding_mesh: DeviceMesh | None = None

    def setup_environment(self) -> ProcessState:
        state = super().setup_environment()
        dims = self.dims.resolved(state.num_processes)
        self.mesh = dims.build_mesh(self.device.type, always=self.always)
        self._data_mesh = ParallelDims.flattened(self.mesh, ("dp_replicate", "dp_shard"), "dp")
        shard = ParallelDims.flattened(self.mesh, ("dp_shard", "cp"), "dp_shard_cp")
        if shard is not None and "dp_replicate" in (self.mesh.mesh_dim_names or ()):
            shard = self.mesh["dp_replicate", (shard.mesh_dim_names or ("dp_shard",))[0]]
        self._sharding_mesh = shard
        if dims.cp > 1:
            self.context_parallel = ContextParallel(self.mesh.get_group("cp"))
        # Accelerate's flattened dimensions, which scripts look up (`torch_device_mesh["dp_cp"]`: the
        # ranks a loss value is averaged over), one dimension alone included.
        for name, names in ACCELERATE_FLATTENED.items():
            if present := tuple(n for n in names if n in (self.mesh.mesh_dim_names or ())):
                flatten_mesh(self.mesh[present], name)
        assert self._data_mesh is not None, "dp_shard is always in the mesh"
        return dataclasses.replace(
            state, data_parallel_index=self._data_mesh.get_local_rank(), data_parallel_size=dims.dp
        )

    def data_group(self) -> dist.ProcessGroup:
        """The ranks of one tp or cp group or pipeline hold the same samples: the data collectives run over
        the data-parallel ranks."""
        assert self._data_mesh is not None, "setup_environment() first"
        return self._data_mesh.get_group()

    def sharding_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP shards parameters over: "dp_shard" with "cp" folded in, under "dp_replicate"
        (HSDP); None: it has none of them."""
        assert self.mesh is not None, "setup_environment() first"
        return self._sharding_mesh

    def data_parallel_size(self, world_size: int) -> int:
        return self.dims.resolved(world_size).dp

    def layout(self, world_size: int) -> str:
        return self.dims.resolved(world_size).describe()

    def activation_share(self) -> float:
        """A cp group's ranks each keep the activations of 1/cp of every sequence."""
        return 1.0 / self.dims.cp

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        self.dims.resolved(world_size)
        if self.dims.cp > 1 and (problem := share_problem(model)):
            raise ConfigError(
                f"hardware.cp_size={self.dims.cp}: {problem}. Use a model that can (runner.models.GPT, a "
                "transformers causal LM such as Llama), or hardware.cp_size=1."
            )

    def check_training(self, task: Any, batch_size: int, sample: Any = None) -> None:
        """Under context parallel: the task must train by its `loss` (the strategy shards each batch before
        the forward) and the samples' sequences must split into 2 x cp_size equal chunks."""
        if self.dims.cp == 1:
            return
        if not trains_by_loss(task):
            raise ConfigError(
                f"hardware.cp_size={self.dims.cp}: the task {type(task).__name__} has its own training_step; under "
                "context parallel each rank's share of the sequences is cut from the batch before the forward, "
                "so the task must define `loss(outputs, batch)` and keep runner.task.Task's training_step. Move "
                "the loss there, or use hardware.cp_size=1."
            )
        if isinstance(sample, dict) and POSITIONS in sample:
            raise ConfigError(
                f"hardware.cp_size={self.dims.cp} with samples that mask attention by document (data.document_mask"
                "=true): context parallel's attention over the sequence shares is causal only. Use "
                "data.document_mask=false, or hardware.cp_size=1."
            )
        if sample is not None:
            ContextParallel.check_sample(sample, self.dims.cp)

    def training_loss(
        self,
        module: torch.nn.Module,
        batch: Any,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        scale: float = 1.0,
        sync_gradients: bool = True,
    ) -> torch.Tensor:
        """Under context parallel: the loss of this rank's share of the batch's sequences, with the value
        of the whole sequences' loss."""
        cp = self.context_parallel
        if cp is None:
            return super().training_loss(module, batch, loss_fn, scale, sync_gradients)
        loss = super().training_loss(module, cp.shard(batch), loss_fn, scale, sync_gradients)
        return cp.whole_loss(loss)
