"""Inside a TrainJob's pods, each the agent of one node: the first pod's command composes the job and tells
the others what to run (the job, or that there is nothing to run) through a store it serves where the pods
meet (`runner.launchers.nodes`); every pod then starts its node's ranks, which meet as one job."""

from __future__ import annotations

import logging
import sys

from runner.cluster import TrainJobNode
from runner.launchers.local import LocalLauncher
from runner.launchers.nodes import NODE_WAIT_S, first_nodes_verdict, node_exit_code
from runner.run_dir.log import configure_rank_logging

log = logging.getLogger("runner")


def run_node(node: TrainJobNode) -> int:
    """The agent of a pod other than the first: wait for the first pod's verdict (at most `NODE_WAIT_S`),
    then start this node's ranks of the job it composed, restarted as the first pod's are. The exit code: 0,
    1 (a rank failed), 75 (stopped by a signal, checkpointed)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    where = f"{node.master_addr}:{node.master_port}"
    log.info("node %d of %d: waiting for the first node's job at %s", node.node_rank, node.nodes, where)
    try:
        verdict = first_nodes_verdict(node.master_addr, node.master_port)
    except RuntimeError as err:  # the first pod never answered (it failed before launch, or never started)
        log.error(
            "node %d: no job from the first node at %s within %d s: %s. Its pod's log says why.",
            node.node_rank,
            where,
            NODE_WAIT_S,
            str(err).splitlines()[0],
        )
        return 1
    if verdict.job is None:
        log.info("node %d: nothing to run: %s", node.node_rank, verdict.reason)
        return 0
    configure_rank_logging(verdict.job.logging_config, node.node_rank, "node")
    launcher, job = LocalLauncher(restarts=verdict.restarts), verdict.job
    return node_exit_code(lambda: launcher.launch_node(job, node, int(node.procs_per_node)))
