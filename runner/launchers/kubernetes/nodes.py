"""Inside a TrainJob's pods, each the agent of one node: the first pod's command composes the job and tells
the others what to run (the job, or that there is nothing to run) through a store it serves where the pods
meet; every pod then starts its node's ranks, which meet as one job."""

from __future__ import annotations

import logging
import pickle
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore

from runner.cluster import TrainJobNode
from runner.errors import EXIT_INTERRUPTED, RankFailedError, TrainingInterrupted
from runner.launchers.base import Job
from runner.launchers.local import NODE_WAIT_S, LocalLauncher
from runner.run_dir.log import configure_rank_logging

log = logging.getLogger("runner")

VERDICT, JOB, RESTARTS, READ = "runner/verdict", "runner/job", "runner/restarts", "runner/read"  # the store's keys
LAUNCH = "launch"  # the verdict that the job runs; any other is why not


class FirstNode:
    """The first pod's side: it serves the store at the pods' meeting point (`PET_MASTER_ADDR` and
    `PET_MASTER_PORT`), which torch's static rendezvous then shares (a multi-tenant store), and puts its
    verdict there. The store lives as long as this object: keep it until the ranks are done."""

    def __init__(self, node: TrainJobNode) -> None:
        self.others = node.nodes - 1
        self.store = TCPStore(
            node.master_addr,
            node.master_port,
            is_master=True,
            timeout=timedelta(seconds=NODE_WAIT_S),
            wait_for_workers=False,
            multi_tenant=True,
        )

    def launch(self, job: Job, restarts: int) -> None:
        """The other pods run `job`, their ranks restarted up to `restarts` times as the first pod's."""
        self.store.set(JOB, pickle.dumps(job.for_other_processes()))
        self.store.set(RESTARTS, str(restarts))
        self.store.set(VERDICT, LAUNCH)

    def skip(self, reason: str) -> None:
        """The other pods run nothing: `reason`. Returns once they read it (at most `NODE_WAIT_S`)."""
        self.store.set(VERDICT, reason)
        deadline = time.monotonic() + NODE_WAIT_S
        while self.store.add(READ, 0) < self.others and time.monotonic() < deadline:
            time.sleep(0.1)


def run_node(node: TrainJobNode) -> int:
    """The agent of a pod other than the first: wait for the first pod's verdict (at most `NODE_WAIT_S`),
    then start this node's ranks of the job it composed, restarted as the first pod's are. The exit code: 0,
    1 (a rank failed), 75 (stopped by a signal, checkpointed)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    where = f"{node.master_addr}:{node.master_port}"
    log.info("node %d of %d: waiting for the first node's job at %s", node.node_rank, node.nodes, where)
    try:
        store = TCPStore(
            node.master_addr, node.master_port, is_master=False, timeout=timedelta(seconds=NODE_WAIT_S)
        )
        verdict = store.get(VERDICT).decode()
        job: Job | None = pickle.loads(store.get(JOB)) if verdict == LAUNCH else None
        restarts = int(store.get(RESTARTS)) if job is not None else 0
        store.add(READ, 1)
    except RuntimeError as err:  # the first pod never answered (it failed before launch, or never started)
        log.error(
            "node %d: no job from the first node at %s within %d s: %s. Its pod's log says why.",
            node.node_rank,
            where,
            NODE_WAIT_S,
            str(err).splitlines()[0],
        )
        return 1
    del store
    if job is None:
        log.info("node %d: nothing to run: %s", node.node_rank, verdict)
        return 0
    configure_rank_logging(job.logging_config, node.node_rank, "node")
    try:
        LocalLauncher(restarts=restarts).launch_node(job, node, int(node.procs_per_node))
    except RankFailedError as err:
        log.error("Training failed: %s", err)
        return 1
    except (TrainingInterrupted, KeyboardInterrupt) as err:
        log.warning("Training interrupted: %s", err)
        return EXIT_INTERRUPTED
    return 0
