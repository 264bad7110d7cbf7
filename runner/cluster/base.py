"""The contract of a cluster environment: where this process's rank comes from."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class ClusterEnvironment(ABC):
    """This process as one rank of a job whose processes something outside it started (torch's elastic
    agent, torchrun, SLURM's srun; next a Ray actor or a Kubernetes pod): one subclass per such place, each
    reading its own variables (`detect`). runner's launchers then run the rank in this process instead of
    starting ranks (Fabric's `creates_processes_externally`). A plain process has no environment.

    Args:
        rank, world_size: this rank and the job's ranks.
        local_rank, local_world_size: the same on this node.
        master_addr, master_port: where the ranks meet.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    variables: ClassVar[tuple[str, ...]] = ()  # the ones `python -m runner.env` shows

    @classmethod
    @abstractmethod
    def detect(cls) -> ClusterEnvironment | None:
        """This process's place, read from the variables of this kind of environment; None where they are
        not set."""

    def rendezvous(self, timeout: timedelta) -> dist.Store | None:
        """The store the process group is formed over, once the ranks met; None: torch's `env://` (from
        the variables `export` sets)."""
        return None

    def expected_host(self, rank: int) -> str | None:
        """The host this environment runs `rank` on, where it says (None: it does not)."""
        return None

    def ranks_per_node_problem(self, ranks_per_node: int) -> str | None:
        """Why `ranks_per_node` (the hardware's `num_processes`) cannot be what this environment started on
        each node, where it fixes that; None: it does not, or they agree."""
        return None

    def export(self) -> None:
        """Set the torch variables (`RANK`, `MASTER_ADDR`, ...) that `init_process_group("env://")` reads."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )
