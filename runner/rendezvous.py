"""Where the ranks of a SLURM job step meet: rank 0 hosts the store at the step's first host, each rank
writes down its host, and rank 0 names the ranks (and the hosts SLURM put them on) that did not come."""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from runner.cluster import RankEnvironment
from runner.errors import RendezvousError

log = logging.getLogger(__name__)

JOINED = "runner/joined"  # a counter: ranks that arrived
POLL_S = 0.1


def host_key(rank: int) -> str:
    return f"runner/host/{rank}"


def rendezvous(env: RankEnvironment, timeout: timedelta) -> dist.Store:
    """The store the job's process group is formed over, once every rank has arrived (rank 0 waits up to
    `timeout` and raises `RendezvousError` naming the ranks and hosts that did not; another rank raises it
    when it cannot reach rank 0's store in that time). Rank 0 logs where each rank runs."""
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


def _wait_for_everyone(store: dist.Store, env: RankEnvironment, timeout: timedelta) -> None:
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
