"""Ranks that SLURM started: the tasks of a job step (`srun`, or submitit's `launcher=slurm`), placed by
`SLURM_PROCID` and `SLURM_NTASKS`; where they meet (rank 0 hosts the store at the step's first host, each
rank writes down its host, and rank 0 names the ranks, and the hosts SLURM put them on, that did not
come); and the SLURM node lists and task counts they are read from. The one place that reads SLURM's
variables (a test keeps it so)."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from runner.cluster.base import ClusterEnvironment
from runner.errors import RendezvousError

if TYPE_CHECKING:  # torch is imported where a rendezvous is made: the tracker's sender reads the job id
    import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlurmEnvironment(ClusterEnvironment):
    """A task of a SLURM job step with more than one task.

    Args (beyond `ClusterEnvironment`'s):
        hosts: the step's hosts in order (the first is the rendezvous).
        tasks_per_host: how many tasks SLURM runs on each.

    The rendezvous is the step's first host, on a port derived from the job id: `MASTER_ADDR` and
    `MASTER_PORT` are not read, since sbatch passes on the submitting shell's environment, where they name
    the login node or localhost.
    """

    hosts: tuple[str, ...] = ()
    tasks_per_host: tuple[int, ...] = ()

    variables = ("SLURM_JOB_ID", "SLURM_NTASKS")

    @classmethod
    def detect(cls) -> SlurmEnvironment | None:
        env = os.environ
        if int(env.get("SLURM_NTASKS", 1)) <= 1 or "SLURM_PROCID" not in env:
            return None  # a plain process, or an sbatch script: runner may start its own ranks
        hosts = expand_hosts(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1")
        tasks = task_counts(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1")
        node = int(env.get("SLURM_NODEID", 0))
        return cls(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=tasks[min(node, len(tasks) - 1)],
            master_addr=hosts[0],
            master_port=20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000,
            hosts=tuple(hosts),
            tasks_per_host=tuple((tasks * len(hosts))[: len(hosts)] if len(tasks) == 1 else tasks),
        )

    def rendezvous(self, timeout: timedelta) -> dist.Store:
        return rendezvous(self, timeout)

    def expected_host(self, rank: int) -> str | None:
        """The host SLURM runs `rank` on (block distribution: the first host's tasks, then the next's)."""
        for host, tasks in zip(self.hosts, self.tasks_per_host, strict=False):
            if rank < tasks:
                return host
            rank -= tasks
        return None

    def ranks_per_node_problem(self, ranks_per_node: int) -> str | None:
        """A step started by hand (`srun python -m runner`) runs one rank per task."""
        if ranks_per_node == self.local_world_size:
            return None
        return (
            f"hardware.num_processes={ranks_per_node} ranks per node, but SLURM started {self.local_world_size} "
            f"task(s) on this node ({self.world_size} in all), each one rank. Set srun's tasks per node "
            "(--ntasks-per-node) to hardware.num_processes, or use launcher=slurm, which asks SLURM for them."
        )


def slurm_job_id() -> str | None:
    """The SLURM job this process runs in, if any."""
    return os.environ.get("SLURM_JOB_ID")


def slurm_step_nodes() -> tuple[int, str]:
    """How many nodes this task's SLURM step spans (else its job; 1 outside SLURM), and the variables that
    say so, as a message quotes them."""
    env = os.environ
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    said = (
        f"SLURM_NTASKS={env.get('SLURM_NTASKS', 'unset')}, "
        f"SLURM_STEP_NUM_NODES={env.get('SLURM_STEP_NUM_NODES', 'unset')}"
    )
    return nodes, said


def expand_hosts(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list, in its order: `node[03-05,09],gpu1` -> node03 node04 node05 node09
    gpu1 (what `scontrol show hostnames` prints)."""
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*),?", nodelist):
        if not ranges:
            hosts += [prefix + suffix] if prefix + suffix else []
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for index in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{index:0{len(first)}d}{suffix}")
    if not hosts:
        raise ValueError(f"cannot read a host name from the SLURM node list {nodelist!r}")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `node[03-05,09],gpu1` -> `node03`."""
    return expand_hosts(nodelist)[0]


def task_counts(tasks_per_node: str) -> list[int]:
    """Read SLURM's compressed task counts: `2(x3),1` is 2 tasks on each of 3 nodes, then 1."""
    counts = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(repeat or 1)
    return counts or [1]


JOINED = "runner/joined"  # a counter: ranks that arrived
POLL_S = 0.1


def host_key(rank: int) -> str:
    return f"runner/host/{rank}"


def rendezvous(env: SlurmEnvironment, timeout: timedelta) -> dist.Store:
    """The store the job's process group is formed over, once every rank has arrived (rank 0 waits up to
    `timeout` and raises `RendezvousError` naming the ranks and hosts that did not; another rank raises it
    when it cannot reach rank 0's store in that time). Rank 0 logs where each rank runs."""
    import torch.distributed as dist

    where = f"{env.master_addr}:{env.master_port}"
    try:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as err:  # torch raises DistNetworkError (a RuntimeError), or socket errors
        if env.rank == 0:
            raise RendezvousError(
                f"rank 0 on {socket.gethostname()} could not open the rendezvous at {where}: {err}. Another job "
                "may hold that port on this node (it is 20000 + the SLURM job id modulo 20000): resubmit."
            ) from err
        raise RendezvousError(
            f"rank {env.rank} on {socket.gethostname()} could not reach the rendezvous at {where} (rank 0, on "
            f"{env.expected_host(0) or env.master_addr}) within {timeout.total_seconds():g} s: {err}. Rank 0 did "
            "not start, or that host's address is not reachable from this one (check the name resolves to the "
            "same interface on every node)."
        ) from err
    store.set(host_key(env.rank), socket.gethostname())
    store.add(JOINED, 1)
    if env.rank == 0:
        _wait_for_everyone(store, env, timeout)
    return store


def _wait_for_everyone(store: dist.Store, env: SlurmEnvironment, timeout: timedelta) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(JOINED, 0) < env.world_size:
        if time.monotonic() > deadline:
            missing = [rank for rank in range(env.world_size) if not store.check([host_key(rank)])]
            hosts = sorted({env.expected_host(rank) or "?" for rank in missing})
            raise RendezvousError(
                f"{len(missing)} of {env.world_size} rank(s) did not join the rendezvous at {env.master_addr}:"
                f"{env.master_port} within hardware.timeout_s={timeout.total_seconds():g}: rank(s) "
                f"{_ranges(missing)}, which SLURM started on {', '.join(hosts)}. Their logs say why (a node that "
                "cannot reach this one, a hung filesystem, a crash at start); raise hardware.timeout_s if they "
                "are only slow."
            )
        time.sleep(POLL_S)
    hosts = [value.decode() for value in store.multi_get([host_key(rank) for rank in range(env.world_size)])]
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    log.info(
        "rendezvous at %s:%d (%s): %d rank(s) on %d host(s): %s",
        env.master_addr,
        env.master_port,
        socket.gethostbyname(env.master_addr),
        env.world_size,
        len(by_host),
        ", ".join(f"{host} [{_ranges(ranks)}]" for host, ranks in by_host.items()),
    )


def _ranges(ranks: list[int]) -> str:
    """`0,1,2,5` -> `0-2,5`."""
    parts: list[str] = []
    for rank in ranks:
        if parts and rank == int(parts[-1].rsplit("-", 1)[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{rank}"
        else:
            parts.append(str(rank))
    return ",".join(parts)
