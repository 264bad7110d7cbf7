"""`launcher=local`: the job's ranks on this machine, through torch's elastic launcher."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from runner.callbacks.watchdog import EXIT_HUNG, read_reports
from runner.cluster import TrainJobNode, available_cores, launched_environment
from runner.config import NonNegativeFloat, PositiveFloat, checked
from runner.errors import EXIT_INTERRUPTED, ConfigError, RankFailedError, TrainingInterrupted, signal_name
from runner.hardware.base import Strategy
from runner.launchers.base import Job, Launcher, interrupted, run_rank
from runner.launchers.nodes import NODE_WAIT_S
from runner.launchers.reports import (
    hang_failure,
    likeliest_hang,
    repeated_failure,
    report_failure,
    reported_failure,
)
from runner.run_dir import HANG_DIR
from runner.torch_internals import ElasticAgent, forwarding, launching_with

log = logging.getLogger(__name__)
# What the launcher passes on to the ranks (SIGINT, a terminal's Ctrl-C, reaches them itself: _ctrl_c_once).
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

START_METHODS = ("fork", "spawn", "forkserver")


class LocalLauncher(Launcher):
    """Train in this process when the hardware wants one process, or when this process already is a rank
    (torchrun, srun: it never spawns again); otherwise start `hardware.num_processes` ranks with torch's
    elastic launcher on a free port and return rank 0's metrics.

    If any rank fails, the others are stopped at once and `RankFailedError` names the failed rank with
    its traceback (or the signal that killed it).

    Args:
        start_method: how ranks start: "fork", "spawn", "forkserver"; None: the hardware's choice (fork on
            CPU, where it starts a rank in milliseconds; spawn where CUDA must be initialised in the rank).
        monitor_interval_s: how often the launcher checks that every rank is alive.
        shutdown_timeout_s: after a stop signal, how long the ranks get to exit (and checkpoint) before
            SIGKILL; after a rank failed, how long the others get (half to exit on their own, having lost
            a peer, half after SIGTERM).
        **kwargs: `restarts` (`Launcher`): after a rank failed, the agent starts the rank group again.
    """

    @checked("launcher")
    def __init__(
        self,
        start_method: str | None = None,
        monitor_interval_s: PositiveFloat = 0.1,
        shutdown_timeout_s: NonNegativeFloat = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if start_method is not None and start_method not in START_METHODS:
            raise ConfigError(
                f"launcher.start_method={start_method!r}: expected one of {START_METHODS} or null."
            )
        self.start_method = start_method
        self.monitor_interval_s = monitor_interval_s
        self.shutdown_timeout_s = shutdown_timeout_s

    def launch(self, job: Job) -> dict[str, float]:
        strategy: Strategy = job.strategy or instantiate(job.cfg.hardware)
        env = launched_environment()
        if env is not None:
            log.info(
                "already rank %d of %d (started by torchrun, srun or similar): training without starting ranks",
                env.rank,
                env.world_size,
            )
        if env is not None or (strategy.num_processes == 1 and not self.restarts):
            return run_rank(job)
        return self._launch_ranks(
            job.for_other_processes(), strategy.num_processes, self.start_method or strategy.start_method
        )

    def check(self, cfg: DictConfig, strategy: Strategy) -> None:
        """CPU ranks beyond this machine's cores share cores and wait on each other at every collective
        (64 ranks on 2 cores make no step in minutes): refused unless `hardware.oversubscribe`."""
        env = launched_environment()
        if env is not None and self.restarts:
            raise ConfigError(
                f"launcher.restarts={self.restarts}: this process is already a rank (started by torchrun, "
                "srun or similar), so restarting the ranks is that launcher's (torchrun --max-restarts); leave "
                "launcher.restarts out."
            )
        # ranks that something else started on this node (a SLURM step started by hand): as many as asked?
        if env is not None and "num_processes" in cfg.hardware:
            problem = env.ranks_per_node_problem(strategy.num_processes)
            if problem is not None:
                raise ConfigError(problem)
        cores = available_cores()
        ranks = strategy.cpu_ranks() if env is None else 0  # none started: already a rank
        if ranks > cores and not strategy.oversubscribe:
            raise ConfigError(
                f"hardware.num_processes={ranks}: this machine has {cores} CPU core(s) for {ranks} CPU ranks; "
                "ranks that share a core wait on each other at every collective and crawl. Use "
                f"hardware.num_processes<={cores}, or hardware.oversubscribe=true to start them anyway."
            )

    def world_size(self, cfg: DictConfig, strategy: Strategy) -> int:
        env = launched_environment()
        return env.world_size if env is not None else strategy.num_processes

    def describe(self, cfg: DictConfig, strategy: Strategy) -> str:
        ranks = self.world_size(cfg, strategy)
        if ranks == 1 and not self.restarts:
            return "LocalLauncher: 1 node x 1 process, in this process"
        start_method = self.start_method or strategy.start_method
        restarts = f", restarted up to {self.restarts} time(s)" if self.restarts else ""
        return f"LocalLauncher: 1 node x {ranks} process(es), started with {start_method}{restarts}"

    def launch_node(self, job: Job, node: TrainJobNode, ranks_per_node: int) -> dict[str, float]:
        """This node's `ranks_per_node` ranks of a job that spans `node.nodes` nodes, each node's agent
        started by the cluster (a TrainJob's pods): the agents meet at the first node's
        (`node.master_addr:master_port`, torch's static rendezvous: each node's rank is given) and the
        ranks are numbered node by node. Rank 0's metrics on the first node, {} on the others."""
        strategy: Strategy = job.strategy or instantiate(job.cfg.hardware)
        results = self._launch_ranks(
            job.for_other_processes(), ranks_per_node, self.start_method or strategy.start_method, static_nodes(node)
        )
        return results if node.node_rank == 0 else {}

    def _launch_ranks(
        self, job: Job, num_processes: int, start_method: str, nodes: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """This node's `num_processes` ranks of `job`, alone or meeting other nodes' as `nodes` (the
        `LaunchConfig` options: `static_nodes`, `rendezvous.elastic_nodes`) say; rank 0's metrics."""
        log.info("starting %d ranks (%s)", num_processes, start_method)
        started = time.time()
        with tempfile.TemporaryDirectory(prefix="runner-elastic-") as error_dir:
            config = rank_group_config(
                num_processes,
                start_method,
                error_dir,
                nodes,
                monitor_interval=self.monitor_interval_s,
                max_restarts=self.restarts,
                **forwarding(FORWARDED_SIGNALS),
            )
            with (
                _threads_per_rank(num_processes),
                _quiet_elastic_logs(),
                launching_with(self._agent(Path(error_dir), job.output_dir, started)),
                _ctrl_c_once() as ctrl_c,
            ):
                try:
                    results = elastic_launch(config, _rank_entry)(job, error_dir)
                except SignalException as err:  # this process was signalled; the ranks got it too
                    cause = signal_name(signal.SIGINT if ctrl_c else err.sigval)
                    raise TrainingInterrupted(
                        interrupted(cause, job.output_dir, since=started),
                        signum=signal.SIGINT if ctrl_c else err.sigval,
                    ) from None
                except ChildFailedError as err:
                    raise_failure(err.failures, Path(error_dir), job.output_dir, started)
        return results.get(0, {})

    def _agent(self, error_dir: Path, run_dir: Path, launched: float) -> type[_Agent]:
        """The agent of one launch, reporting into `error_dir`, its ranks stopped within `shutdown_timeout_s`."""
        facts = {"error_dir": error_dir, "run_dir": run_dir, "launched": launched}
        stopping = {"shutdown_timeout_s": self.shutdown_timeout_s, "forwarded_signals": FORWARDED_SIGNALS}
        return type("_Agent", (_Agent,), {**facts, **stopping})


class _Agent(ElasticAgent):
    """The agent of a launch: before a restart (`launcher.restarts`) it says why and clears the failed
    attempt's reports; a failure that a restart would repeat is not restarted."""

    error_dir: Path  # the ranks' failure reports (`report_failure`)
    run_dir: Path  # the job's dir: its watchdogs' reports
    launched: float  # when the launch began: the reports written since are this job's

    def starting(self) -> None:
        for report in self.error_dir.glob("rank*.json"):  # the ended attempt's (a restart's, a resize's)
            report.unlink()

    def stopped_for_nodes(self, failures: dict[int, ProcessFailure]) -> bool:
        return all(failure.exitcode == EXIT_INTERRUPTED for failure in failures.values())  # checkpointed

    def restart_allowed(self) -> bool:
        if kind := repeated_failure(self.error_dir):
            log.warning("not restarted: a rank stopped with %s, which a restart would repeat", kind)
            return False
        return True

    def restarting(self, failures: dict[int, ProcessFailure], restart: int, restarts: int) -> None:
        if not failures:  # no rank of this node failed: another node is waiting to meet (elastic)
            log.warning(
                "the job's nodes change (a node joins, or another node's ranks failed and restart): this node's "
                "ranks stop, checkpointed where they can, and resume on the nodes that meet now"
            )
            return
        causes = "; ".join(_failure_text(rank, f) for rank, f in sorted(failures.items()))
        hung_now = any(failure.exitcode == EXIT_HUNG for failure in failures.values())
        if hung_now and (reports := read_reports(self.run_dir, self.launched)):  # the rank in its own code
            hung = likeliest_hang(reports)
            causes = (
                f"rank {hung} made no progress ({reports[hung]['doing']}, at {reports[hung].get('where')})"
            )
        log.warning(
            "%s: restart %d of %d, the ranks resume from the run's latest checkpoint", causes, restart, restarts
        )
        for stacks in (self.run_dir / HANG_DIR).glob("rank*.txt"):  # kept, under the attempt's number
            stacks.rename(stacks.with_name(f"attempt{restart - 1}-{stacks.name}"))


def _failure_text(rank: int, failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"rank {rank} was killed by {failure.signal_name()}"
    if failure.exitcode == EXIT_HUNG:
        return f"rank {rank} made no progress (see its hang/ report)"
    return f"rank {rank} exited with code {failure.exitcode}"


@contextmanager
def _ctrl_c_once() -> Iterator[list[int]]:
    """While the ranks run, the launcher's SIGINT stops them with one SIGTERM: a Ctrl-C in a terminal
    reaches the launcher and every rank (one process group), so passing SIGINT on would count as a second
    Ctrl-C in each rank, which then stops without its checkpoint. A further SIGINT is left to the ranks
    (they take a second Ctrl-C as "stop at once"). Yields the SIGINTs received.

    Once the ranks have stopped on a signal, a SIGINT that reaches this process later is ignored: it is
    the terminal's same Ctrl-C arriving after the ranks' (or one more while the run is already stopping),
    and must not turn the checkpointed stop (exit 75) into a KeyboardInterrupt."""
    received: list[int] = []

    def stop_ranks(signum: int, frame: Any) -> None:
        if not received:
            received.append(signum)
            raise SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGTERM)

    previous = signal.signal(signal.SIGINT, stop_ranks)
    try:
        yield received
    except TrainingInterrupted:
        previous = signal.SIG_IGN
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


@record
def _rank_entry(job: Job, error_dir: str) -> dict[str, float]:
    """What each rank runs (module level, so that spawned ranks can unpickle it).

    The rank dies with the launching process (never an orphan that keeps training). A forked rank
    inherits the launcher's SIGTERM handler: restore the default, so that the launcher stopping it ends
    it quietly. A rank that stops on a signal exits with EXIT_INTERRUPTED; one that raises writes its
    traceback for the launcher's report, after a moment if its collective merely lost a peer, so that
    the peer's own failure is seen first.
    """
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rank = launched_environment().rank  # type: ignore[union-attr]
    try:
        return run_rank(job, launcher_reports=True)
    except TrainingInterrupted as err:  # where it stopped and its checkpoint, for the launcher to say
        report_failure(Path(error_dir), rank, err)
        sys.exit(EXIT_INTERRUPTED)
    except BaseException as err:
        report_failure(Path(error_dir), rank, err)
        raise


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent (the launcher) dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def raise_failure(
    failures: dict[int, ProcessFailure], error_dir: Path, run_dir: Path | None = None, launched: float = 0.0
) -> NoReturn:
    """Raise what the first failure was: ranks that stopped on a signal (TrainingInterrupted), a
    configuration problem found in a rank (ConfigError), or RankFailedError naming the rank and how it
    failed: it hung (its watchdog's report in `run_dir`, written since `launched`), the signal that killed it, or its traceback.

    Of ranks that hung, the one whose main thread was in its own code (not waiting inside torch); a rank
    killed by a signal is the cause (the launcher stops the others only after); otherwise the rank that
    raised first, ranks that merely lost a peer last.
    """
    hung = any(failure.exitcode == EXIT_HUNG for failure in failures.values())
    if hung and run_dir is not None and (reported_hang := hang_failure(run_dir, since=launched)):
        raise reported_hang
    if all(f.exitcode == EXIT_INTERRUPTED for f in failures.values()):
        if isinstance(reported := reported_failure(error_dir), TrainingInterrupted):
            raise reported  # the rank's own words: the signal, the step, the checkpoint
        raise TrainingInterrupted(
            "the ranks stopped on a signal after checkpointing; run the same command to resume."
        )
    killed = [(rank, failure) for rank, failure in sorted(failures.items()) if failure.exitcode < 0]
    if killed:
        rank, failure = killed[0]
        raise RankFailedError(
            f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}; the other ranks were stopped."
        )
    reported = reported_failure(error_dir)
    if reported is None:
        rank, failure = min(failures.items())
        raise RankFailedError(
            f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}; the other ranks were stopped."
        )
    raise reported


@contextmanager
def _threads_per_rank(num_processes: int) -> Iterator[None]:
    """Share the cores out between the ranks (as torchrun does), unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    cores = available_cores()
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // num_processes))
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


@contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """torch's launcher logs every step and its own report of a failure; ours replaces that report."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    names = [name for name in logging.root.manager.loggerDict if name.startswith(prefixes)]
    loggers = [logging.getLogger(name) for name in (*prefixes, *names)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def rank_group_config(
    num_processes: int,
    start_method: str,
    log_dir: str,
    nodes: dict[str, Any] | None = None,
    endpoint: str = "localhost:0",
    **options: Any,
) -> LaunchConfig:
    """torch's elastic launcher for `num_processes` ranks on this machine, each rank's error file under
    `log_dir`, no restarts unless `options` say: alone, meeting at `endpoint` (c10d; port 0: a free one,
    so that parallel jobs never collide); or as one node of a job whose nodes meet as `nodes` says."""
    if nodes is None:
        nodes = {"min_nodes": 1, "max_nodes": 1, "rdzv_backend": "c10d", "rdzv_endpoint": endpoint}
    return LaunchConfig(
        nproc_per_node=num_processes,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        **{"run_id": uuid.uuid4().hex, **nodes},
        **{"max_restarts": 0, **options},
    )


def static_nodes(node: TrainJobNode) -> dict[str, Any]:
    """The `LaunchConfig` options of one node of `node`'s job, meeting the other nodes' agents at its first
    node (static: the node ranks are given)."""
    return {
        "min_nodes": node.nodes,
        "max_nodes": node.nodes,
        "rdzv_backend": "static",
        "rdzv_endpoint": f"{node.master_addr}:{node.master_port}",
        "rdzv_configs": {"rank": node.node_rank, "timeout": NODE_WAIT_S},
        "run_id": "runner",  # the same on every node
    }
