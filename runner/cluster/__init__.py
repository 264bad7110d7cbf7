"""Is this process already one rank of a job started by a launcher (torchrun, srun, Ray, our own)? The cluster
environments (`ClusterEnvironment`: one class per place ranks come from, in this package), and the
process's own facts (its cores, its rank variables)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from runner.cluster.base import ClusterEnvironment
from runner.cluster.ray import RayEnvironment, ray_attempt
from runner.cluster.slurm import SlurmEnvironment, slurm_job_id
from runner.cluster.torchelastic import TorchElasticEnvironment, restart_count
from runner.cluster.trainjob import TrainJobNode

__all__ = [
    "ENVIRONMENTS",
    "ClusterEnvironment",
    "RayEnvironment",
    "SlurmEnvironment",
    "TorchElasticEnvironment",
    "TrainJobNode",
    "available_cores",
    "export_local_rank",
    "launched_environment",
    "launched_node",
    "patch_environment",
    "rank_variables",
    "time_before_start",
]

# The places a rank may come from, tried in order: the first whose variables are set says where it sits.
# (Ray's workers also have torch's variables: Ray first.)
ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    RayEnvironment,
    TorchElasticEnvironment,
    SlurmEnvironment,
)


def launched_environment() -> ClusterEnvironment | None:
    """The rank this process is, when a launcher started it; None when it is a plain process."""
    return next((found for kind in ENVIRONMENTS if (found := kind.detect()) is not None), None)


def launched_node() -> TrainJobNode | None:
    """The node this process is the agent of, where a cluster started it as one (a TrainJob's pod) to start
    that node's ranks itself; None elsewhere."""
    return TrainJobNode.detect()


def time_before_start(otherwise: str) -> str:
    """What the time before this process started was, as the goodput ledger names it: "restart" in a rank
    group that torch's agent or Ray restarted, "queued" in a SLURM job (its queue, a requeue), else
    `otherwise`."""
    if restart_count() or ray_attempt() > 1:
        return "restart"
    if slurm_job_id() is not None:
        return "queued"
    return otherwise


def export_local_rank(local_rank: int) -> None:
    """Set `LOCAL_RANK` where no launcher did (a process group of one formed in this process): DeepSpeed reads
    it from the environment. `RANK` and `WORLD_SIZE` stay unset, so this process is still not a launched
    rank for `launched_environment`."""
    os.environ.setdefault("LOCAL_RANK", str(local_rank))


# What `python -m runner.env` shows of the variables the environments read.
RANK_VARIABLES = (*(name for kind in ENVIRONMENTS for name in kind.variables), *TrainJobNode.variables)


def rank_variables() -> dict[str, str]:
    """Those of `RANK_VARIABLES` that are set."""
    return {name: os.environ[name] for name in RANK_VARIABLES if name in os.environ}


def available_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables inside (names upper-cased, values as strings), restored after."""
    before = {key.upper(): os.environ.get(key.upper()) for key in kwargs}
    os.environ.update({key.upper(): str(value) for key, value in kwargs.items()})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
