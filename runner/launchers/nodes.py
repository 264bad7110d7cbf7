"""A job whose nodes each run an agent (a TrainJob's pods, an elastic job's `runner join`): the first node's
command composes the job and serves it, through a store at the nodes' meeting point, to the others; each of
them takes it from there and starts its node's ranks, which meet as one job."""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import TCPStore

from runner.errors import EXIT_INTERRUPTED, RankFailedError, TrainingInterrupted
from runner.launchers.base import Job

log = logging.getLogger("runner")

NODE_WAIT_S = 900  # how long the nodes of a job wait for each other (pods start minutes apart: image pulls)
# The store's keys: the first node's verdict, its job and restarts, and how many nodes read them.
VERDICT, JOB, RESTARTS, READ = "runner/verdict", "runner/job", "runner/restarts", "runner/read"
LAUNCH = "launch"  # the verdict that the job runs; any other is why not


class FirstNode:
    """The first node's side: it serves the store at the nodes' meeting point (`host:port`), which torch's
    rendezvous then shares (a multi-tenant store), and puts its verdict there for the `others` nodes
    expected. The store lives as long as this object: keep it until the ranks are done."""

    def __init__(self, host: str, port: int, others: int) -> None:
        self.others = others
        self.store = TCPStore(
            host,
            port,
            is_master=True,
            timeout=timedelta(seconds=NODE_WAIT_S),
            wait_for_workers=False,
            multi_tenant=True,
        )

    def launch(self, job: Job, restarts: int) -> None:
        """The other nodes run `job`, their ranks restarted up to `restarts` times as the first node's."""
        self.store.set(JOB, pickle.dumps(job.for_other_processes()))
        self.store.set(RESTARTS, str(restarts))
        self.store.set(VERDICT, LAUNCH)

    def skip(self, reason: str, wait_s: float = NODE_WAIT_S) -> None:
        """The other nodes run nothing: `reason`. Returns once they read it (at most `wait_s`)."""
        self.store.set(VERDICT, reason)
        deadline = time.monotonic() + wait_s
        while self.store.add(READ, 0) < self.others and time.monotonic() < deadline:
            time.sleep(0.1)


@dataclass(frozen=True)
class Verdict:
    """What the first node said: the `job` to run with its `restarts`, or (job None) why there is none."""

    job: Job | None
    restarts: int
    reason: str


def first_nodes_verdict(host: str, port: int, wait_s: float = NODE_WAIT_S) -> Verdict:
    """The first node's verdict, waited for at its meeting point `host:port` (at most `wait_s`);
    RuntimeError where none came (the first node failed before launch, or never started)."""
    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait_s))
    verdict = store.get(VERDICT).decode()
    job: Job | None = pickle.loads(store.get(JOB)) if verdict == LAUNCH else None
    restarts = int(store.get(RESTARTS)) if job is not None else 0
    store.add(READ, 1)
    return Verdict(job, restarts, verdict)


def node_exit_code(ranks: Callable[[], object]) -> int:
    """Run this node's `ranks`; the node's exit code: 0, 1 (a rank failed), 75 (stopped by a signal,
    checkpointed), what happened logged."""
    try:
        ranks()
    except RankFailedError as err:
        log.error("Training failed: %s", err)
        return 1
    except (TrainingInterrupted, KeyboardInterrupt) as err:
        log.warning("Training interrupted: %s", err)
        return EXIT_INTERRUPTED
    return 0
