"""One description of how a job's ranks are laid out: the degrees of each parallelism, checked against the
world size, and the `DeviceMesh` built from them (torchtitan's `ParallelDims`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from runner.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Degrees whose product is the world size, outermost first.

    pp: pipeline stages (ranks that each hold a slice of the model's blocks and pass activations on).
    dp_replicate: groups that each hold a whole copy of the (sharded) model and average gradients
        across (HSDP's replicas; DDP when dp_shard is 1).
    dp_shard: ranks of one group that shard parameters, gradients and optimizer states (FSDP); -1: what
        the world leaves once the other degrees are set.
    tp: ranks each layer is split over (tensor parallel).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1

    NAMES = ("pp", "dp_replicate", "dp_shard", "tp")

    def resolved(self, world_size: int) -> ParallelDims:
        """These degrees for `world_size` ranks (`dp_shard=-1` filled in); ConfigError naming the degrees
        set when they do not multiply to it."""
        settings = {
            "pp_size": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp_size": self.tp,
        }
        defaults = {"pp_size": 1, "dp_replicate": 1, "dp_shard": -1, "tp_size": 1}
        named = (
            ", ".join(f"hardware.{k}={v}" for k, v in settings.items() if v != defaults[k]) or "the defaults"
        )
        if min(self.pp, self.dp_replicate, self.tp) < 1 or self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(
                f"{named}: each degree must be >= 1 (dp_shard may be -1: the rest of the world)."
            )
        fixed = self.pp * self.dp_replicate * self.tp * max(self.dp_shard, 1)
        if world_size % fixed or (self.dp_shard != -1 and fixed != world_size):
            rest = " (dp_shard takes the rest of the ranks)" if self.dp_shard == -1 else ""
            raise ConfigError(
                f"{named}: the parallel degrees (pp_size x dp_replicate x dp_shard x tp_size = {fixed}{rest}) must "
                f"multiply to the world size, {world_size} ranks. Change them, or run a multiple of {fixed} ranks."
            )
        return replace(self, dp_shard=world_size // (self.pp * self.dp_replicate * self.tp))

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
        world = self.pp * self.dp * self.tp
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
        return {name: getattr(self, name) for name in self.NAMES}

    @staticmethod
    def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh | None:
        """The part of `mesh` over the dimensions `names` that it has (None: none of them)."""
        present = tuple(name for name in names if name in (mesh.mesh_dim_names or ()))
        return mesh[present] if present else None
