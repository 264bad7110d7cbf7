"""Ranks that Ray Train started: the workers of `launcher=ray`'s worker group, placed by the variables
that runner's Ray backend (`runner.launchers.ray.workers`) sets in each worker before the rank runs."""

from __future__ import annotations

import os
from dataclasses import dataclass

from runner.cluster.base import ClusterEnvironment

ATTEMPT = "RUNNER_RAY_ATTEMPT"  # which start of the worker group this is: 1, then 2 after Ray restarted it


@dataclass(frozen=True)
class RayEnvironment(ClusterEnvironment):
    """A Ray Train worker: its place is torch's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...), which
    the backend derives from Ray's train context, and the ranks meet by `env://` at rank 0's node, on a
    port rank 0 found free for this attempt (a restarted group meets afresh).

    Args (beyond `ClusterEnvironment`'s):
        attempt: 1 for the worker group's first start; n after Ray restarted it n - 1 times.
    """

    attempt: int = 1

    variables = (ATTEMPT, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def detect(cls) -> RayEnvironment | None:
        env = os.environ
        if ATTEMPT not in env or "RANK" not in env:
            return None
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            attempt=int(env[ATTEMPT]),
        )


def ray_attempt() -> int:
    """Which start of a Ray worker group this process belongs to (0: not a Ray worker)."""
    return int(os.environ.get(ATTEMPT, 0))
