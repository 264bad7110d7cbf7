"""What a launcher is given (a `Job`) and what each rank it starts runs (`run_rank`)."""

from __future__ import annotations

import json
import re
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig

from runner.checkpoint.files import LATEST, CheckpointDiscarded, atomic_write_text, latest_checkpoint
from runner.checkpoint.resume import FINISHED, finite_metrics, resume_override
from runner.cluster import launched_environment
from runner.errors import (
    ConfigError,
    RendezvousError,
    TrainingInterrupted,
    TrainingStopped,
    describe_exception,
    write_failure,
)
from runner.hardware.base import Strategy
from runner.run_log import configure_rank_logging

# What a rank runs: (resolved config, job dir, the strategy when one was built in this process) -> metrics.
Entry = Callable[[DictConfig, Path, Strategy | None], dict[str, float]]


@dataclass
class Job:
    """One job of a run or sweep, as every rank needs it (picklable: ranks may be spawned).

    Args:
        cfg: the composed config, interpolations resolved (ranks never run Hydra again).
        output_dir: the job's directory, owned by the process that ran Hydra; every rank writes there.
        entry: the rank's work (the training loop or the inference path), a module-level function.
        logging_config: the `logging.config.dictConfig` the job logs with (Hydra's `job_logging`).
        strategy: the hardware the launching process built and validated; a rank running in that process
            uses it, ranks started elsewhere build their own (`for_other_processes`).
    """

    cfg: DictConfig
    output_dir: Path
    entry: Entry
    logging_config: dict[str, Any] | None = None
    strategy: Strategy | None = None

    def for_other_processes(self) -> Job:
        """This job without the launching process's strategy object (each process builds its own)."""
        return replace(self, strategy=None)


class RankFailedError(RuntimeError):
    """A rank of the job raised or was killed; the other ranks were stopped. `details` (the whole
    traceback) go to the run's log file, not to the console."""

    def __init__(self, message: str, details: str | None = None) -> None:
        super().__init__(message)
        self.details = details


class Launcher(ABC):
    """Starts the ranks of a job and returns rank 0's metrics. `strategy` is the job's hardware, built once
    by the launching process."""

    @abstractmethod
    def launch(self, job: Job) -> dict[str, float]: ...

    @abstractmethod
    def world_size(self, cfg: DictConfig, strategy: Strategy) -> int:
        """How many ranks `launch` will run for `cfg` (checked against a checkpoint before launching)."""

    def check(self, cfg: DictConfig, strategy: Strategy) -> None:
        """Raise ConfigError for what would fail only once launched (e.g. more than a cluster has)."""

    @abstractmethod
    def describe(self, cfg: DictConfig, strategy: Strategy) -> str:
        """One line for the plan: where and how the ranks would start."""


def interrupted(cause: str, output_dir: Path, since: float) -> str:
    """What to tell a user whose run `cause` (a signal's name) stopped, saying "resume" only where this run
    wrote a checkpoint to resume from (`since`: when it started)."""
    checkpoints = output_dir / "checkpoints"
    latest = latest_checkpoint(checkpoints)
    if latest is not None and (checkpoints / LATEST).stat().st_mtime >= since:
        return f"stopped by {cause}; checkpoint {latest}. Run the same command with {resume_override(output_dir)} to resume."
    if latest is not None:
        return (
            f"stopped by {cause} before this run wrote a checkpoint: the same command with {resume_override(output_dir)} "
            f"resumes from {latest}, written earlier."
        )
    return f"stopped by {cause} before any checkpoint was written: there is nothing to resume from."


def run_rank(job: Job) -> dict[str, float]:
    """The body of every rank: its logging (only rank 0 logs below warnings), then the job's entry; rank 0
    writes the final metrics to `metrics.json` in the job's dir."""
    env = launched_environment()
    rank = env.rank if env else 0
    configure_rank_logging(job.logging_config, rank)
    try:
        metrics = job.entry(job.cfg, job.output_dir, job.strategy)
    except Exception as err:
        if (reason := write_failure(err)) is None:
            raise
        raise TrainingStopped(
            f"the run could not write to {job.output_dir}: {reason}. Free space or fix the permissions there, or give "
            "the run another dir (hydra.run.dir=...); checkpoints completed before are intact, and the metrics logged "
            "so far are in the log above."
        ) from err
    if rank == 0:
        atomic_write_text(
            job.output_dir / FINISHED, json.dumps(finite_metrics(metrics), indent=2, allow_nan=False)
        )
    return metrics


# What a rank raised, written for the launcher (the local launcher's ranks, a SLURM job's tasks): the
# exceptions raised again as they are, by class name; any other is reported with its traceback.
REPORTED_AS_IS = {  # the most specific first: a rank's error is reported as the first it is an instance of
    error.__name__: error for error in (ConfigError, TrainingInterrupted, RendezvousError, TrainingStopped)
}
LOST_PEER_GRACE_S = 2.0


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err` is a consequence of another rank's failure, not a cause: a collective failing because
    that rank went away, or the checkpoint being written discarded by it."""
    return isinstance(err, (dist.DistError, CheckpointDiscarded)) or bool(
        re.search(r"(closed|reset) by peer|remote worker|communicator was aborted", str(err))
    )


def report_failure(error_dir: Path, rank: int, err: BaseException) -> None:
    """Write what rank `rank` raised into `<error_dir>/rank<rank>.json` (after a moment when its collective
    merely lost a peer, so that the peer's own failure is seen first)."""
    lost_peer = lost_a_peer(err)
    if lost_peer:
        time.sleep(LOST_PEER_GRACE_S)
    kind = next((name for name, error in REPORTED_AS_IS.items() if isinstance(err, error)), None)
    report = {
        "time": time.time(),
        "lost_peer": lost_peer,
        "kind": kind,
        "message": str(err),
        "signum": getattr(err, "signum", None),  # TrainingInterrupted's: the signal that stopped the rank
        "traceback": traceback.format_exc(),
        "summary": describe_exception(err),
    }
    error_dir.mkdir(parents=True, exist_ok=True)
    (error_dir / f"rank{rank}.json").write_text(json.dumps(report))


def reported_failure(error_dir: Path, causes_only: bool = False) -> Exception | None:
    """What to raise for the ranks' reports in `error_dir` (None: none reported): the first rank that raised
    (ranks that merely lost a peer last), its exception again when it is one of REPORTED_AS_IS, else a
    RankFailedError with its traceback. `causes_only`: None too when every report is of a lost peer (the
    rank that failed first wrote none: it was killed)."""
    reports = {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in error_dir.glob("rank*.json")
    }
    if not reports or (causes_only and all(report["lost_peer"] for report in reports.values())):
        return None
    rank = min(reports, key=lambda r: (reports[r]["lost_peer"], reports[r]["time"]))
    if (kind := reports[rank]["kind"]) is not None:
        error = REPORTED_AS_IS[kind](reports[rank]["message"])
        if kind == TrainingInterrupted.__name__:
            error.signum = reports[rank].get("signum")
        return error
    others = sorted(set(reports) - {rank})
    also = f" (rank {', '.join(map(str, others))} failed too)" if others else ""
    report = reports[rank]
    return RankFailedError(
        f"rank {rank} raised; the other ranks were stopped{also}.\n{report.get('summary') or report['traceback']}",
        details=report["traceback"],
    )
