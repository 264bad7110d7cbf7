"""Ranks that torch's launchers started: torchrun, the elastic agent of runner's local launcher, and the
variables submitit exports (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from runner.cluster.base import ClusterEnvironment


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
