"""`launcher=ray`: the job's ranks as the worker group of a Ray Train run on a Ray cluster, and a sweep's
jobs as Ray tasks that each run their own worker group, as many at once as the cluster holds."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import instantiate
from omegaconf import DictConfig

from runner.config import NonNegativeFloat, PositiveFloat, checked
from runner.errors import ConfigError, RankFailedError, TrainingInterrupted, signal_name
from runner.files import write_text
from runner.hardware.base import Strategy
from runner.launchers.base import Job, Launcher, Sweep, SweepJob, interrupted
from runner.launchers.ray.backend import backend_config
from runner.launchers.ray.cluster import (
    PLACEMENTS,
    alive_nodes,
    check_shared,
    connect,
    placement,
    require_ray,
)
from runner.launchers.ray.workers import ERRORS, RESULT, STOP, WORKERS, rank_entry
from runner.launchers.reports import hang_failure, reported_failure

log = logging.getLogger(__name__)

# In the run dir: what the ranks of the current launch report (`runner.launchers.ray.workers`).
REPORTS = "ray"
STOPPED_BY = (signal.SIGTERM, signal.SIGINT)
# Whether this process is a Ray task running a job of a sweep (`_run_sweep_job`), whose dir the sweep checked.
_in_sweep_task = False


class RayLauncher(Launcher):
    """Run the job's `hardware.num_processes` ranks as the workers of a Ray Train run on the cluster at
    `address`, each with `cpus_per_worker` CPUs and `gpus_per_worker` GPUs, placed by `placement`. The ranks
    run runner's own loop and form their process group themselves (`RayEnvironment`), so every hardware
    option runs as under `launcher=local`. The run dir must be storage every node writes and this process
    reads (checked before anything is submitted): checkpoints and the ranks' reports are written there.

    When a worker or its node dies, Ray starts the worker group again, up to `restarts` times, and the
    ranks resume from the run's latest checkpoint (runner decides what resumes: each launch is a new Ray
    Train run, never restored by Ray). Not after a failure that a restart would repeat (a refusal, a stop, a
    divergence). SIGTERM or Ctrl-C to this command: the ranks checkpoint and stop, and it exits 75.

    Args:
        address: "auto" (the cluster this machine belongs to, or RAY_ADDRESS), "local" (a cluster of this
            machine started for the command), or the head's "host:port".
        cpus_per_worker: CPUs Ray reserves for each rank (its torch threads).
        gpus_per_worker: GPUs for each rank; None: 1 where the hardware's ranks use GPUs here, else 0.
        placement: "pack" (as few nodes as possible), "spread" (across nodes), "strict_pack" (one node),
            "strict_spread" (one worker per node).
        storage: where Ray Train keeps its own files; None: `<run dir>/ray`.
        runtime_env: Ray's runtime environment for the ranks (`pip`, `env_vars`, `working_dir`, ...); the
            command's PYTHONPATH, its dir and its RUNNER_/MLFLOW_/WANDB_/HF_/TORCH_/NCCL_ variables are
            passed on.
        **kwargs: `restarts` (`Launcher`): Ray's `FailureConfig(max_failures=restarts)`.
    """

    @checked("launcher")
    def __init__(
        self,
        address: str = "auto",
        cpus_per_worker: PositiveFloat = 1.0,
        gpus_per_worker: NonNegativeFloat | None = None,
        placement: str = "pack",
        storage: str | None = None,
        runtime_env: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if placement not in PLACEMENTS:
            raise ConfigError(f"launcher.placement={placement!r}: expected one of {', '.join(PLACEMENTS)}.")
        require_ray("launcher=ray")
        self.address = address
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.placement = placement
        self.storage = storage
        self.runtime_env = dict(runtime_env or {})

    def world_size(self, cfg: DictConfig, strategy: Strategy) -> int:
        return strategy.num_processes

    def gpus(self, strategy: Strategy) -> float:
        """GPUs per worker: as set, else one where the hardware's ranks compute on GPUs."""
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        return 0.0 if strategy.cpu_ranks() or strategy.device_name() == "cpu" else 1.0

    def check(self, cfg: DictConfig, strategy: Strategy) -> None:
        """The cluster answers and holds the worker group (else Ray would wait for it forever)."""
        connect(self.address, self.runtime_env)
        placement(
            alive_nodes(), strategy.num_processes, self.cpus_per_worker, self.gpus(strategy), self.placement
        )

    def describe(self, cfg: DictConfig, strategy: Strategy) -> str:
        connect(self.address, self.runtime_env)
        nodes = alive_nodes()
        workers, gpus = strategy.num_processes, self.gpus(strategy)
        placed = placement(nodes, workers, self.cpus_per_worker, gpus, self.placement)
        cluster = f"{len(nodes)} node(s), {sum(n.cpus for n in nodes):g} CPU(s), {sum(n.gpus for n in nodes):g} GPU(s)"
        where = ", ".join(f"{name}: {count}" for name, count in placed.items())
        restarts = (
            f"; restarted up to {self.restarts} time(s) after a failure" if self.restarts else ""
        )
        return (
            f"RayLauncher: {workers} worker(s) x {self.cpus_per_worker:g} CPU(s), {gpus:g} GPU(s) on the Ray cluster "
            f"at {self.address} ({cluster}); placement {self.placement}, workers per node: {where}{restarts}"
        )

    def launch(self, job: Job) -> dict[str, float]:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
        from ray.train.v2.api.exceptions import TrainingFailedError

        strategy = job.strategy or instantiate(job.cfg.hardware)
        connect(self.address, self.runtime_env)
        if not _in_sweep_task:
            check_shared(job.output_dir, alive_nodes())
        reports = job.output_dir / REPORTS
        for folder in (ERRORS, WORKERS):  # what the ranks report is this launch's only
            shutil.rmtree(reports / folder, ignore_errors=True)
        for file in (RESULT, STOP):
            (reports / file).unlink(missing_ok=True)
        gpus = self.gpus(strategy)
        resources = {"CPU": self.cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        name = f"runner-{uuid.uuid4().hex[:12]}"  # a new Ray Train run: Ray never restores an earlier one
        trainer = DataParallelTrainer(
            rank_entry,
            train_loop_config={"job": job.for_other_processes(), "reports": str(reports), "cwd": os.getcwd()},
            backend_config=backend_config(),
            scaling_config=ScalingConfig(
                num_workers=strategy.num_processes,
                use_gpu=bool(gpus),
                resources_per_worker=resources,
                placement_strategy=PLACEMENTS[self.placement],
            ),
            run_config=RunConfig(
                name=name,
                storage_path=str(self.storage or job.output_dir / REPORTS / "train"),
                failure_config=FailureConfig(max_failures=self.restarts),
            ),
        )
        log.info(
            "Ray Train run %s: %d worker(s), placement %s, up to %d restart(s)",
            name,
            strategy.num_processes,
            self.placement,
            self.restarts,
        )
        launched = time.time()
        error: TrainingFailedError | None = None
        with forwarding_stops([reports]) as stopped:
            try:
                trainer.fit()
            except TrainingFailedError as err:
                error = err
        return outcome(job.output_dir, launched, stopped, error, self.restarts)

    @classmethod
    def launch_sweep(cls, sweep: Sweep) -> list[JobReturn]:
        """A sweep's jobs as Ray tasks (no resources of their own), each running its job's worker group:
        Ray runs as many at once as the cluster holds; the others wait for resources. SIGTERM or Ctrl-C:
        every running job checkpoints and stops; the same command resumes the sweep."""
        import ray

        jobs = list(sweep.jobs())
        launchers = [instantiate(cfg.launcher) for _, _, cfg in jobs]
        for (number, overrides, _), launcher in zip(jobs, launchers, strict=True):
            if not isinstance(launcher, cls) or (launcher.address, launcher.runtime_env) != (
                launchers[0].address,
                launchers[0].runtime_env,
            ):
                raise ConfigError(
                    f"job {number} ({' '.join(overrides)}) runs with another launcher, address or runtime_env than "
                    "the sweep's first job: a sweep's jobs run on one Ray cluster. Do not sweep over launcher, "
                    "launcher.address or launcher.runtime_env."
                )
        connect(launchers[0].address, launchers[0].runtime_env)
        check_shared(Path(sweep.config.hydra.sweep.dir), alive_nodes())
        run_job = ray.remote(num_cpus=0, max_retries=0)(_run_sweep_job)
        job = SweepJob(sweep.hydra_context, sweep.task_function, sweep.config)
        state = Singleton.get_state()
        queued = [run_job.remote(job, overrides, number, state) for number, overrides, _ in jobs]
        dirs = [
            Path(sweep.config.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir) / REPORTS for _, _, cfg in jobs
        ]
        log.info("submitted %d job(s) of the sweep as Ray tasks", len(queued))
        with forwarding_stops(dirs) as stopped:
            results = [
                _job_result(ref, overrides) for ref, (_, overrides, _) in zip(queued, jobs, strict=True)
            ]
        if stopped:
            raise TrainingInterrupted(
                f"the sweep's running jobs were stopped by {signal_name(stopped[0])} after checkpointing. The same "
                "command resumes the sweep: it skips the jobs that finished.",
                signum=stopped[0],
            )
        return results


def _run_sweep_job(job: SweepJob, overrides: list[str], number: int, state: dict[Any, Any]) -> JobReturn:
    """A Ray task: one job of a sweep, whose `launch` runs its worker group."""
    global _in_sweep_task
    _in_sweep_task = True
    return job(overrides, number, state)


def _job_result(ref: Any, overrides: list[str]) -> JobReturn:
    """A sweep job's result; FAILED with the error where its task itself failed (its process died)."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayError as err:
        return JobReturn(
            overrides=overrides, status=JobStatus.FAILED, _return_value=RankFailedError(str(err))
        )


@contextmanager
def forwarding_stops(reports: Sequence[Path]) -> Iterator[list[int]]:
    """SIGTERM and Ctrl-C to this process (in its main thread) passed on to the ranks as a stop request in
    each of `reports` (`runner.launchers.ray.workers.STOP`): they checkpoint and stop. Yields the signals
    received; a second Ctrl-C stops waiting at once."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def stop(signum: int, frame: Any) -> None:
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not received:
            log.warning("%s: the ranks checkpoint and stop", signal_name(signum))
            for path in reports:
                path.mkdir(parents=True, exist_ok=True)
                write_text(path / STOP, str(signum))
        received.append(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOPPED_BY}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def outcome(
    run_dir: Path, launched: float, stopped: list[int], error: Exception | None, restarts: int
) -> dict[str, float]:
    """Rank 0's metrics, or what to raise for the launch that began at `launched`: the stop this command
    passed on, a rank that hung, a worker that died (rank, node, cause: what another rank raised after it
    is its consequence, as under the local launcher), what a rank raised, else Ray's error."""
    reports = run_dir / REPORTS
    if error is None and (reports / RESULT).exists():
        return json.loads((reports / RESULT).read_text())
    reported = reported_failure(reports / ERRORS, causes_only=True)
    if stopped or isinstance(reported, TrainingInterrupted):
        signum = stopped[0] if stopped else getattr(reported, "signum", None)
        raise TrainingInterrupted(interrupted(signal_name(signum), run_dir, since=launched), signum=signum)
    if hung := hang_failure(run_dir, since=launched):
        raise hung
    failed = getattr(error, "worker_failures", None) or {}
    raised = {int(path.stem.removeprefix("rank")) for path in (reports / ERRORS).glob("rank*.json")}
    if reported is not None and set(failed) <= raised:
        raise reported
    raise RankFailedError(_died(reports, error, restarts))


def _died(reports: Path, error: Exception | None, restarts: int) -> str:
    """The workers that died without a report (killed, their node lost): rank, node, pid and Ray's cause."""
    where = {}
    for path in (reports / WORKERS).glob("rank*.json"):
        record = json.loads(path.read_text())
        where[record["rank"]] = record
    failures = getattr(error, "worker_failures", None) or {}
    after = f" after {restarts} restart(s) of the worker group (launcher.restarts)" if restarts else ""
    if not failures:
        return f"the Ray Train run ended without rank 0's metrics{after}: {error or 'no error reported'}"
    lines = []
    for rank, failure in sorted(failures.items()):
        record = where.get(rank, {})
        node = (
            f" on node {record['ip']} ({record['node_id'][:8]}, host {record['host']}), pid {record['pid']}"
            if record
            else ""
        )
        lines.append(f"rank {rank}{node}: {_cause(failure)}")
    return f"{'; '.join(lines)}{after}. The other ranks were stopped."


def _cause(failure: BaseException) -> str:
    """Ray's account of a worker's failure, shortly: its first line, and why the worker's process died
    where Ray says (not its list of common causes)."""
    lines = [line.strip() for line in str(failure).splitlines() if line.strip()]
    if not lines:
        return type(failure).__name__
    dead = [
        line.split(" Some common causes include")[0] for line in lines if line.startswith("The actor is dead")
    ]
    return " ".join(line.rstrip(".") + "." for line in lines[:1] + dead).rstrip(".")
