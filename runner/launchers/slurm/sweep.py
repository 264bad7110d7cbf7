"""A sweep's jobs on SLURM: each run of consecutive jobs that ask the same of the cluster queued as one
array, one array task per job, then waited for."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate

from runner.errors import ConfigError, RankFailedError, TrainingInterrupted
from runner.launchers.base import Launcher, Sweep, SweepJob
from runner.launchers.reports import reported_failure
from runner.launchers.slurm.jobs import RANK_ERRORS

log = logging.getLogger(__name__)

# Whether this process is a task of a sweep's SLURM array (`SweepTask` sets it): one of its job's ranks.
_in_array_task = False


def in_array_task() -> bool:
    """Whether this process is a task of a sweep's array: one of its job's ranks."""
    return _in_array_task


def queue_sweep(launcher_class: type[Launcher], sweep: Sweep) -> list[JobReturn]:
    """A sweep's jobs on SLURM (`python -m runner -m launcher=slurm ...`, through runner's Hydra launcher):
    each run of consecutive jobs that ask the same of the cluster is one array, one array task per job with
    `launcher.nodes` x tasks per node SLURM tasks (one per rank), queued together, then waited for. Every
    job was checked before (`runner.sweep.SweepCheck`, the cluster's limits included). The jobs' results,
    in order; a job whose tasks died without one is FAILED with what its ranks reported."""
    arrays: list[tuple[Any, list[tuple[list[str], int, Path]]]] = []  # (SlurmExecutor, its jobs)
    config = sweep.config
    for number, overrides, cfg in sweep.jobs():
        launcher = instantiate(cfg.launcher)
        if not isinstance(launcher, launcher_class):
            raise ConfigError(
                f"job {number} ({' '.join(overrides)}) runs with launcher={cfg.launcher._target_}, the sweep with "
                "launcher=slurm: a sweep runs all its jobs on SLURM or all here. Do not sweep over launcher."
            )
        if not launcher.wait:
            raise ConfigError(
                "launcher.wait=false in a sweep: the sweep waits for its jobs to record which finished (a sweep "
                "run again resumes from that). Leave launcher.wait=true, and run the sweep where it may wait "
                "(tmux, nohup, or a small SLURM job of its own)."
            )
        folder = Path(launcher.folder) if launcher.folder else Path(config.hydra.sweep.dir) / "slurm"
        executor = launcher.executor(folder, launcher.tasks_per_node(cfg, instantiate(cfg.hardware)))
        job = (list(overrides), number, Path(config.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir))
        if arrays and _asks(arrays[-1][0]) == _asks(executor):
            arrays[-1][1].append(job)
        else:
            arrays.append((executor, [job]))
    task = SweepTask(sweep.hydra_context, sweep.task_function, config)
    queued = []
    for executor, jobs in arrays:
        overrides, numbers, dirs = zip(*jobs, strict=True)
        for job_dir in dirs:  # what a job's tasks raised, for this launch only
            shutil.rmtree(job_dir / "slurm" / RANK_ERRORS, ignore_errors=True)
        submitted = executor.map_array(task, overrides, numbers, [Singleton.get_state()] * len(jobs))
        log.info(
            "submitted SLURM array %s: job(s) %s of the sweep, each %d node(s) x %d task(s); logs in %s",
            submitted[0].job_id.partition("_")[0],
            ", ".join(map(str, numbers)),
            executor.parameters["nodes"],
            executor.parameters["ntasks_per_node"],
            executor.folder,
        )
        queued += zip(jobs, submitted, strict=True)
    try:
        return [_sweep_result(*job, submitted) for job, submitted in queued]
    except KeyboardInterrupt:
        ids = " ".join(sorted({submitted.job_id.partition("_")[0] for _, submitted in queued}))
        raise TrainingInterrupted(
            f"stopped waiting; the sweep's SLURM arrays go on (`scancel {ids}` stops them). The same command "
            "resumes the sweep: it skips the jobs that finished."
        ) from None


def _asks(executor: Any) -> tuple[dict[str, Any], Path, int]:
    """What jobs of one array ask alike: the sbatch options, the folder, the requeues at the time limit."""
    return executor.parameters, Path(executor.folder), executor.max_num_timeout


def _sweep_result(overrides: list[str], number: int, job_dir: Path, submitted: Any) -> JobReturn:
    """Job `number`'s result (its rank 0's), or, where its tasks died without one, a FAILED result with what
    its ranks reported (else the log to read)."""
    import submitit

    try:
        return submitted.results()[0]
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
        failure = reported_failure(job_dir / "slurm" / RANK_ERRORS, causes_only=True) or RankFailedError(
            f"job {number} of the sweep (SLURM job {submitted.job_id}) ended {submitted.state} without a result. "
            f"Rank 0's log: {submitted.paths.stderr}; the others' are next to it.\n{err}"
        )
        return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=failure)


class SweepTask(SweepJob):
    """What each task of a sweep's array runs (pickled by submitit): its job, in which
    `SlurmLauncher.launch` runs this task's rank. Its `checkpoint` is what submitit calls on the preemption
    signal: the same job again, which resumes."""

    def __call__(self, overrides: list[str], number: int, singleton_state: dict[Any, Any]) -> JobReturn:
        global _in_array_task
        _in_array_task = True
        return super().__call__(overrides, number, singleton_state)

    def checkpoint(self, *args: Any) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args)
