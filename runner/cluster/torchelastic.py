"""Ranks that torch's launchers started: torchrun, the elastic agent of runner's local launcher, and the
variables submitit exports (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from runner.cluster.base import ClusterEnvironment

ROUND_VARIABLE = "RUNNER_ELASTIC_ROUND"  # the name of the elastic job's current round (`launchers.rendezvous`)

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class TorchElasticEnvironment(ClusterEnvironment):
    """A rank that `RANK` and `WORLD_SIZE` place; the ranks meet by `env://` at `MASTER_ADDR:MASTER_PORT`."""

    variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def detect(cls) -> TorchElasticEnvironment | None:
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world_size = int(env["WORLD_SIZE"])
        return cls(
            rank=int(env["RANK"]),
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )

    def rendezvous(self, timeout: timedelta) -> dist.Store | None:
        """After a restart of the rank group (`TORCHELASTIC_RESTART_COUNT` > 0), or in any round of an elastic
        job's nodes (`ROUND_VARIABLE`, which a round that only takes a node in changes alone): the agent's
        store, under a prefix of its own for this attempt. The agent keeps one store across attempts, and
        the keys that an earlier attempt's ranks wrote there (their gloo addresses) would make the new ranks
        connect to ranks that are gone. The first attempt of a fixed job meets by torch's `env://` (None)."""
        attempt = os.environ.get(ROUND_VARIABLE) or restart_count()
        if not attempt:
            return None
        import torch.distributed as dist  # here: the tracker's sender reads this package without torch

        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            self.master_addr,
            self.master_port,
            self.world_size,
            is_master=not agent_store and self.rank == 0,
            timeout=timeout,
        )
        return dist.PrefixStore(f"runner/attempt_{attempt}", store)


def restart_count() -> int:
    """How many times torch's elastic agent restarted this rank's group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
