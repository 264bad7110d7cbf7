"""`launcher=elastic`: a job of `min_nodes` to `max_nodes` nodes, each running its agent, that goes on
through the loss of a node and takes a new one in: torch's elastic agents meet through the c10d rendezvous
(`rendezvous.elastic_nodes`) at the first node, where `python -m runner` composed the job; every other node
runs `runner join <host:port>` and takes the job from there (`nodes.FirstNode`)."""

from __future__ import annotations

import json
import logging
import math
import socket
import sys
from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.utils import instantiate
from omegaconf import DictConfig

from runner.cluster import launched_environment
from runner.config import PositiveFloat, PositiveInt, checked
from runner.errors import ConfigError
from runner.hardware.base import Strategy
from runner.launchers.base import Job, Sweep
from runner.launchers.local import LocalLauncher
from runner.launchers.nodes import NODE_WAIT_S, FirstNode, first_nodes_verdict, node_exit_code
from runner.launchers.rendezvous import elastic_nodes
from runner.run_dir import FINISHED

log = logging.getLogger(__name__)

PORT = 29400  # the meeting point's port where `endpoint` names none (torchrun's)


class ElasticLauncher(LocalLauncher):
    """The first node of an elastic job: it serves the meeting point, starts its `hardware.num_processes`
    ranks, and returns rank 0's metrics once the job ends. The job starts when `min_nodes` nodes met (after
    `wait_s` for more, up to `max_nodes`). When a node is lost its peers' ranks fail, and the agents restart
    the rank group (`restarts`) on the nodes left, from the latest checkpoint, if at least `min_nodes` are;
    a node that joins stops the ranks (they checkpoint) and the job resumes with it. The global batch and the
    global sample order stay the same at every size (`trainer.split_batches`: each rank takes its share of
    each global batch); the checkpoint reshards onto the new number of ranks.

    The first node serves the meeting point: losing it ends the job (as losing torchrun's rendezvous host).
    The nodes share the run dir's filesystem.

    Args:
        min_nodes: the fewest nodes the job trains on.
        max_nodes: the most nodes it takes in.
        endpoint: `host:port` where the nodes meet, this node's address as the others reach it (null: this
            machine's name, port 29400).
        wait_s: once `min_nodes` met, how long the nodes wait for more before the ranks start.
        **kwargs: `LocalLauncher`'s (`restarts`: how many failures, a lost node among them, the job survives).
    """

    @checked("launcher")
    def __init__(
        self,
        min_nodes: PositiveInt = 1,
        max_nodes: PositiveInt = 1,
        endpoint: str | None = None,
        wait_s: PositiveFloat = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if min_nodes > max_nodes:
            raise ConfigError(
                f"launcher.min_nodes={min_nodes} > launcher.max_nodes={max_nodes}: the fewest nodes the job "
                "trains on cannot exceed the most it takes in. Set min_nodes <= max_nodes."
            )
        self.min_nodes, self.max_nodes, self.wait_s = min_nodes, max_nodes, wait_s
        self.host, self.port = _meeting_point(endpoint)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def launch_sweep(cls, sweep: Sweep) -> Sequence[JobReturn]:
        """A sweep runs its jobs one after another here; every other node's `runner join` takes one job."""
        if sweep.config.launcher.get("max_nodes", 1) > 1:
            raise ConfigError(
                "a sweep (-m) with launcher=elastic and launcher.max_nodes > 1: every other node's `runner "
                "join` runs one job and ends, so the sweep's later jobs would have no nodes. Run each job as "
                "a command of its own (with its `runner join`s), or sweep on one node (max_nodes=1)."
            )
        return super().launch_sweep(sweep)

    def launch(self, job: Job) -> dict[str, float]:
        if launched_environment() is not None:  # already a rank (torchrun, srun): trains in this process
            return super().launch(job)
        strategy: Strategy = job.strategy or instantiate(job.cfg.hardware)
        first = FirstNode(self.host, self.port, self.min_nodes - 1)
        first.launch(job, self.restarts)
        log.info(
            "the job's meeting point is %s: start each other node with `runner join %s` (%d to %d nodes)",
            self.endpoint, self.endpoint, self.min_nodes, self.max_nodes,
        )  # fmt: skip
        try:
            results = self._node_ranks(job, strategy, self.endpoint, hosts=True)
        finally:
            del first  # the store the nodes meet at, until the ranks are done
        finished = job.output_dir / FINISHED  # rank 0 may be another node's: its metrics are on disk
        return results or (json.loads(finished.read_text()) if finished.is_file() else {})

    def join(self, job: Job, endpoint: str) -> None:
        """This node's ranks of the first node's `job`, meeting at `endpoint` (`runner join`: the first
        node's address as this node reaches it)."""
        self._node_ranks(job, instantiate(job.cfg.hardware), endpoint, hosts=False)

    def _node_ranks(self, job: Job, strategy: Strategy, endpoint: str, hosts: bool) -> dict[str, float]:
        nodes = elastic_nodes(self.min_nodes, self.max_nodes, endpoint, hosts, "runner", self.wait_s)
        start_method = self.start_method or strategy.start_method
        return self._launch_ranks(job.for_other_processes(), strategy.num_processes, start_method, nodes)

    def skip(self, reason: str) -> None:
        FirstNode(self.host, self.port, self.min_nodes - 1).skip(reason, self.wait_s)

    def check(self, cfg: DictConfig, strategy: Strategy) -> None:
        """What a change of size would break, refused before any node starts: a global batch that not
        every size divides, a batch per rank (the global batch would change), a checkpoint that does not
        reshard, no restart to go on after a lost node."""
        super().check(cfg, strategy)
        if self.min_nodes == self.max_nodes:
            return
        sizes = f"launcher.min_nodes={self.min_nodes} to max_nodes={self.max_nodes}"
        if not cfg.trainer.get("split_batches"):
            raise ConfigError(
                f"{sizes}: with a batch size per rank the global batch would change with the number of "
                "nodes, and the samples each step sees with it. Set trainer.split_batches=true "
                "(data.batch_size is then the global batch, split over the ranks at every size)."
            )
        batch = cfg.get("data", {}).get("batch_size")
        ranks = [nodes * strategy.num_processes for nodes in range(self.min_nodes, self.max_nodes + 1)]
        if isinstance(batch, int) and (uneven := [n for n in ranks if batch % n]):
            raise ConfigError(
                f"data.batch_size={batch} with {sizes}: the global batch must split evenly over the ranks "
                f"at every size ({', '.join(map(str, ranks))} ranks), and {', '.join(map(str, uneven))} do "
                f"not divide it. Use a multiple of {math.lcm(*ranks)}."
            )
        if not strategy.reshards_checkpoints:
            raise ConfigError(
                f"{sizes}: the job resumes on another number of ranks after a node is lost or joins, and "
                f"this hardware's checkpoints ({strategy.checkpoint_format!r}) load only on as many ranks as "
                "wrote them. Use hardware=ddp or hardware=fsdp, or min_nodes = max_nodes."
            )
        if not self.restarts:
            raise ConfigError(
                f"{sizes}: a lost node fails its peers' ranks, and the job goes on without it only through a "
                "restart of the rank group. Set launcher.restarts to how many failures the job survives (1 "
                "or more)."
            )

    def world_size(self, cfg: DictConfig, strategy: Strategy) -> int:
        return self.max_nodes * strategy.num_processes

    def describe(self, cfg: DictConfig, strategy: Strategy) -> str:
        nodes = (
            f"{self.min_nodes}" if self.min_nodes == self.max_nodes else f"{self.min_nodes}-{self.max_nodes}"
        )
        restarts = f", restarted up to {self.restarts} time(s)" if self.restarts else ""
        return (
            f"ElasticLauncher: {nodes} node(s) x {strategy.num_processes} process(es), meeting at {self.endpoint} "
            f"(`runner join {self.endpoint}` on each other node){restarts}"
        )


def _meeting_point(endpoint: str | None) -> tuple[str, int]:
    if endpoint is None:
        return socket.getfqdn(), PORT
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"launcher.endpoint={endpoint!r}: expected host:port, the first node's address as the other nodes "
            "reach it and a free port (e.g. node1:29400), or null (this machine's name, port 29400)."
        )
    return host, int(port)


def join_node(endpoint: str) -> int:
    """`runner join <host:port>`: wait for the first node's job at `endpoint`, then start this node's ranks
    of it. The exit code: 0, 1 (a rank failed, or no job came), 75 (stopped by a signal, checkpointed)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    host, port = _meeting_point(endpoint)
    log.info("waiting for the first node's job at %s", endpoint)
    try:
        verdict = first_nodes_verdict(host, port)
    except RuntimeError as err:  # the first node never answered (it failed before launch, or never started)
        log.error(
            "no job from the first node at %s within %d s: %s. Its log says why.",
            endpoint, NODE_WAIT_S, str(err).splitlines()[0],
        )  # fmt: skip
        return 1
    if verdict.job is None:
        log.info("nothing to run: %s", verdict.reason)
        return 0
    launcher, job = instantiate(verdict.job.cfg.launcher), verdict.job
    return node_exit_code(lambda: launcher.join(job, f"{host}:{port}"))
