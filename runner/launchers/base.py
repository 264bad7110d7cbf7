"""The launcher contract: what a launcher is given (a `Job`, or a `Sweep` of them), and what each rank it
starts runs (`run_rank`)."""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from runner.build import Blueprint
from runner.checkpoint.files import LATEST, latest_checkpoint
from runner.cluster import launched_environment
from runner.config import NonNegativeInt, checked
from runner.errors import (
    ConfigError,
    TrainingStopped,
    write_failure,
)
from runner.files import write_text
from runner.hardware.base import Strategy
from runner.run_dir import CHECKPOINTS, FINISHED, finite_metrics, resume_override
from runner.run_dir.log import configure_rank_logging

log = logging.getLogger(__name__)

# What a rank runs: (resolved config, job dir, the strategy and the blueprint when this process built them)
# -> metrics.
Entry = Callable[[DictConfig, Path, Strategy | None, Blueprint | None], dict[str, float]]


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
        blueprint: the data and meta model the launching process's checks read (`runner.build.Blueprint`),
            for a rank running in that process, as `strategy`.
    """

    cfg: DictConfig
    output_dir: Path
    entry: Entry
    logging_config: dict[str, Any] | None = None
    strategy: Strategy | None = None
    blueprint: Blueprint | None = None

    def for_other_processes(self) -> Job:
        """This job without the launching process's strategy and blueprint (each process builds its own)."""
        return replace(self, strategy=None, blueprint=None)


@dataclass(frozen=True)
class Sweep:
    """A sweep's jobs, as Hydra hands them to runner's launcher plugin (`hydra/launcher=runner`), which
    passes them to the `launch_sweep` of the sweep's `launcher`."""

    hydra_context: HydraContext
    task_function: TaskFunction
    config: DictConfig
    job_overrides: Sequence[Sequence[str]]
    initial_job_idx: int

    def jobs(self) -> Iterator[tuple[int, list[str], DictConfig]]:
        """Each job's number, overrides and config, composed as Hydra's launchers compose it."""
        for number, overrides in enumerate(self.job_overrides, start=self.initial_job_idx):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.num = cfg.hydra.job.id = number
            yield number, list(overrides), cfg


@dataclass
class SweepJob:
    """One job of a sweep, run in whatever process a launcher sends it to (a SLURM array task, a Ray task):
    composed as Hydra's launchers compose it, then run by the task function, in which the job's `launch`
    starts its ranks. Picklable: it travels with Hydra's state (`Singleton.get_state()`)."""

    hydra_context: HydraContext
    task_function: TaskFunction
    config: DictConfig

    def __call__(self, overrides: list[str], number: int, singleton_state: dict[Any, Any]) -> JobReturn:
        Singleton.set_state(singleton_state)
        setup_globals()
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.num = cfg.hydra.job.id = number
        return run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=cfg,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )


class Launcher(ABC):
    """Starts the ranks of a job and returns rank 0's metrics; runs a sweep's jobs. `strategy` is the job's
    hardware, built once by the launching process.

    Every launcher takes `restarts` (its constructor's `**kwargs` reach this one) and honours it its own way
    (the local agent restarts the rank group, SLURM submits the job again, Ray restarts the worker group, a
    TrainJob's pods restart their node's ranks); whatever restarts, the ranks resume from the run's latest
    checkpoint (`trainer.resume=auto`).

    Args:
        restarts: after the job's ranks failed (a rank raised, was killed or hung; a node was lost), start
            them again this many times. Not after a failure a restart would repeat: a configuration error,
            a stop signal, a divergence (`reports.REPEATED_BY_A_RESTART`).
        max_restarts: the former name of `restarts` (`launcher=local` and `launcher=slurm`), still taken.
        max_failures: the former name of `restarts` (`launcher=ray`), still taken.
    """

    @checked("launcher")
    def __init__(
        self,
        restarts: NonNegativeInt = 0,
        max_restarts: NonNegativeInt | None = None,
        max_failures: NonNegativeInt | None = None,
    ) -> None:
        self.restarts = _restarts(restarts, {"max_restarts": max_restarts, "max_failures": max_failures})

    @abstractmethod
    def launch(self, job: Job) -> dict[str, float]: ...

    @classmethod
    def launch_sweep(cls, sweep: Sweep) -> Sequence[JobReturn]:
        """Run the jobs of a sweep launched with this class: here, one after another in this process, as
        Hydra's basic launcher runs them (each job's `launch` starts its ranks). A launcher that queues
        jobs elsewhere overrides it (SLURM: arrays)."""
        # Hydra's plugin scan executes its plugins' modules again: take the class as it is now.
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher

        basic = BasicLauncher()
        basic.setup(hydra_context=sweep.hydra_context, task_function=sweep.task_function, config=sweep.config)
        return basic.launch(sweep.job_overrides, sweep.initial_job_idx)

    @abstractmethod
    def world_size(self, cfg: DictConfig, strategy: Strategy) -> int:
        """How many ranks `launch` will run for `cfg` (checked against a checkpoint before launching)."""

    def check(self, cfg: DictConfig, strategy: Strategy) -> None:
        """Raise ConfigError for what would fail only once launched (e.g. more than a cluster has)."""

    def skip(self, reason: str) -> None:
        """The job is not launched (`reason`: its run finished before). A launcher whose other nodes wait
        for the job it would launch (a TrainJob's pods) tells them here."""

    @abstractmethod
    def describe(self, cfg: DictConfig, strategy: Strategy) -> str:
        """One line for the plan: where and how the ranks would start."""


def _restarts(restarts: int, former: dict[str, int | None]) -> int:
    """`restarts`, or the value given under one of its `former` names (ConfigError where two disagree)."""
    given = {f"launcher.{name}": value for name, value in former.items() if value is not None}
    if restarts:
        given = {"launcher.restarts": restarts, **given}
    if len(set(given.values())) > 1:
        settings = " and ".join(f"{key}={value}" for key, value in given.items())
        raise ConfigError(
            f"{settings}: these are one setting (max_restarts and max_failures are former names of restarts), "
            "given different values. Set only launcher.restarts."
        )
    for key in given:
        if key != "launcher.restarts":
            log.warning("%s is called launcher.restarts now (the former name is still taken)", key)
    return next(iter(given.values()), 0)


def interrupted(cause: str, output_dir: Path, since: float) -> str:
    """What to tell a user whose run `cause` (a signal's name) stopped, saying "resume" only where this run
    wrote a checkpoint to resume from (`since`: when it started)."""
    checkpoints = output_dir / CHECKPOINTS
    latest = latest_checkpoint(checkpoints)
    if latest is not None and (checkpoints / LATEST).stat().st_mtime >= since:
        return f"stopped by {cause}; checkpoint {latest}. Run the same command with {resume_override(output_dir)} to resume."
    if latest is not None:
        return (
            f"stopped by {cause} before this run wrote a checkpoint: the same command with {resume_override(output_dir)} "
            f"resumes from {latest}, written earlier."
        )
    return f"stopped by {cause} before any checkpoint was written: there is nothing to resume from."


def run_rank(job: Job, launcher_reports: bool = False) -> dict[str, float]:
    """The body of every rank: its logging (only rank 0 logs below warnings; `launcher_reports`: the
    launcher that started it waits for it and reports its failures: see `configure_rank_logging`), then the
    job's entry; rank 0 writes the final metrics to `metrics.json` in the job's dir (not for
    `trainer.fast_dev_run`)."""
    env = launched_environment()
    rank = env.rank if env else 0
    configure_rank_logging(job.logging_config, rank, launcher_reports=launcher_reports)
    try:
        metrics = job.entry(job.cfg, job.output_dir, job.strategy, job.blueprint)
    except Exception as err:
        if (reason := write_failure(err)) is None:
            raise
        raise TrainingStopped(
            f"the run could not write to {job.output_dir}: {reason}. Free space or fix the permissions there, or give "
            "the run another dir (hydra.run.dir=...); checkpoints completed before are intact, and the metrics logged "
            "so far are in the log above."
        ) from err
    if rank == 0 and not job.cfg.trainer.get("fast_dev_run"):  # a check run leaves no results
        write_text(
            job.output_dir / FINISHED, json.dumps(finite_metrics(metrics), indent=2, allow_nan=False)
        )
    return metrics
