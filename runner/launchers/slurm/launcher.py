"""`launcher=slurm`: the job on a SLURM cluster through submitit, one task per rank, and what a job running
under SLURM does on the preemption or time-limit signal (checkpoint, requeue, resume)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.utils import instantiate
from omegaconf import DictConfig

from runner.cluster import launched_environment
from runner.cluster.slurm import slurm_job_id, slurm_step_nodes
from runner.config import NonNegativeInt, PositiveFloat, PositiveInt, checked
from runner.errors import ConfigError, RankFailedError, TrainingInterrupted
from runner.hardware.base import Strategy
from runner.launchers.base import Job, Launcher, Sweep, run_rank
from runner.launchers.reports import hang_failure, report_failure, reported_failure
from runner.launchers.slurm.jobs import RANK_ERRORS, follow, node_failure
from runner.launchers.slurm.partitions import check_request, require_slurm
from runner.launchers.slurm.sweep import in_array_task, queue_sweep
from runner.run_dir import FINISHED

log = logging.getLogger(__name__)


PREEMPTION_SIGNAL = signal.SIGUSR2  # what submitit asks SLURM to send before the time limit
REQUEUE_WAIT_S = 120.0  # how long a rank other than 0 waits for the requeue to stop it


class SlurmLauncher(Launcher):
    """Submit the job with submitit: `nodes` x (the hardware's processes per node) tasks, each one rank
    that reads its place from SLURM's environment (the first node of the job is the rendezvous). Prints
    the job id and log, streams rank 0's log and returns its metrics; with `wait=False` returns at once.

    On SLURM's preemption or time-limit signal (USR2, `signal_delay_s` before the limit) the ranks
    checkpoint, rank 0 requeues the job, and the requeued job resumes from the job dir's latest
    checkpoint. Everything is checked against the cluster (`sinfo`) before anything is queued.

    Args:
        partition: None: the cluster's default partition.
        nodes: nodes of the job; ranks = nodes x the hardware's `num_processes` (one task per device).
        gpus_per_node: GPUs to request on each node (0: none).
        cpus_per_task: CPUs per rank; None: SLURM's default (1).
        mem_gb: memory per node; None: SLURM's default.
        time_min: the job's time limit in minutes.
        account, qos, constraint: as sbatch's options of the same names; None: not passed.
        setup: shell lines run in the batch script before the ranks start (modules, venvs).
        sbatch_args: further sbatch options, `{"mail-type": "END"}` for `--mail-type=END`.
        srun_args: further srun options.
        wait: wait for the job and return its metrics; False: return once it is queued.
        signal_delay_s: how long before the time limit SLURM sends the preemption signal.
        max_timeouts: how many times a job that reaches its time limit is requeued.
        folder: submitit's files (batch script, logs); None: `<job output dir>/slurm`.
        poll_interval_s: how often the log is read and the job's state checked while waiting.
        name: the SLURM job name.
        **kwargs: `restarts` (`Launcher`): after the job failed, this command submits it again (it follows
            the job: not with `wait=False`).
    """

    @checked("launcher")
    def __init__(
        self,
        partition: str | None = None,
        nodes: PositiveInt = 1,
        gpus_per_node: NonNegativeInt = 0,
        cpus_per_task: PositiveInt | None = None,
        mem_gb: PositiveFloat | None = None,
        time_min: PositiveInt = 60,
        account: str | None = None,
        qos: str | None = None,
        constraint: str | None = None,
        setup: list[str] | None = None,
        sbatch_args: dict[str, Any] | None = None,
        srun_args: list[str] | None = None,
        wait: bool = True,
        signal_delay_s: NonNegativeInt = 120,
        max_timeouts: NonNegativeInt = 3,
        folder: str | None = None,
        poll_interval_s: PositiveFloat = 1.0,
        name: str = "runner",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.partition = partition
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.cpus_per_task = cpus_per_task
        self.mem_gb = mem_gb
        self.time_min = time_min
        self.account = account
        self.qos = qos
        self.constraint = constraint
        self.setup = list(setup or [])
        self.sbatch_args = dict(sbatch_args or {})
        self.srun_args = list(srun_args or [])
        self.wait = wait
        self.signal_delay_s = signal_delay_s
        self.max_timeouts = max_timeouts
        self.folder = folder
        self.poll_interval_s = poll_interval_s
        self.name = name
        if not in_array_task():  # a task of a sweep's array was checked before it was queued
            require_slurm("launcher=slurm")

    def world_size(self, cfg: DictConfig, strategy: Strategy) -> int:
        return self.nodes * self.tasks_per_node(cfg, strategy)

    def tasks_per_node(self, cfg: DictConfig, strategy: Strategy) -> int:
        """One task per rank: the hardware's `num_processes` (per node), else one per requested GPU."""
        if "num_processes" not in cfg.hardware:
            return 1
        if cfg.hardware.num_processes is None and self.gpus_per_node:
            return self.gpus_per_node
        tasks = strategy.num_processes
        if self.gpus_per_node and tasks != self.gpus_per_node:
            raise ConfigError(
                f"hardware.num_processes={tasks} but launcher.gpus_per_node={self.gpus_per_node}: on SLURM each "
                "rank is one task with one GPU. Make them equal, or set hardware.num_processes=null."
            )
        return tasks

    def check(self, cfg: DictConfig, strategy: Strategy) -> None:
        """What the cluster would refuse, or queue forever, refused here before anything is queued."""
        if in_array_task():
            return
        if self.restarts and not self.wait:
            raise ConfigError(
                f"launcher.restarts={self.restarts} with launcher.wait=false: the restarts are made by this "
                "command as it follows the job, and it would not wait. Set launcher.wait=true, or leave "
                "launcher.restarts at 0 (run the command again after a failure: it resumes)."
            )
        check_request(
            self.partition,
            nodes=self.nodes,
            cpus_per_node=self.tasks_per_node(cfg, strategy) * (self.cpus_per_task or 1),
            gpus_per_node=self.gpus_per_node,
            mem_gb=self.mem_gb,
            time_min=self.time_min,
            key="launcher",
        )

    def describe(self, cfg: DictConfig, strategy: Strategy) -> str:
        gpus = f", {self.gpus_per_node} GPU(s)" if self.gpus_per_node else ""
        return (
            f"SlurmLauncher: {self.nodes} node(s) x {self.tasks_per_node(cfg, strategy)} task(s){gpus} on partition "
            f"{self.partition or '(default)'}, time limit {self.time_min} min, requeued on preemption"
            + (
                f", submitted again up to {self.restarts} time(s) after a failure"
                if self.restarts
                else ""
            )
        )

    def launch(self, job: Job) -> dict[str, float]:
        tasks_per_node = self.tasks_per_node(job.cfg, job.strategy or instantiate(job.cfg.hardware))
        if in_array_task():  # a job of a sweep, queued by `launch_sweep`: this task is one of its ranks
            return SlurmTask(job, self.nodes, tasks_per_node, job.output_dir / "slurm" / RANK_ERRORS)()
        folder = Path(self.folder) if self.folder else job.output_dir / "slurm"
        executor = self.executor(folder, tasks_per_node)
        restarts = 0
        while True:
            try:
                return self._submit_and_follow(job, executor, folder, tasks_per_node)
            except (
                RankFailedError
            ) as failure:  # not what a restart would repeat: a refusal, a stop, a divergence
                if restarts == self.restarts:
                    raise
                restarts += 1
                log.warning(
                    "%s: restart %d of %d, a new SLURM job resumes from the run's latest checkpoint",
                    str(failure).split(". ")[0],
                    restarts,
                    self.restarts,
                )

    def _submit_and_follow(
        self, job: Job, executor: Any, folder: Path, tasks_per_node: int
    ) -> dict[str, float]:
        """Submit the job once; its metrics (or {} with `wait=False`); the error of a job that failed."""
        import submitit

        errors = folder / RANK_ERRORS  # what each task raised (`report_failure`), for this launch only
        shutil.rmtree(errors, ignore_errors=True)
        submitted_at = time.time()  # the watchdogs' reports of this job are newer
        submitted = executor.submit(
            SlurmTask(job.for_other_processes(), self.nodes, tasks_per_node, errors, launcher_reports=self.wait)
        )
        rank0 = submitted.task(0)
        log.info(
            "submitted SLURM job %s: %d node(s) x %d task(s), partition %s; rank 0's log: %s",
            submitted.job_id,
            self.nodes,
            tasks_per_node,
            self.partition or "(default)",
            rank0.paths.stderr,
        )
        if not self.wait:
            log.info(
                "launcher.wait=false: not waiting; its metrics will be in %s", job.output_dir / FINISHED
            )
            return {}
        try:
            follow(submitted, rank0.paths.stderr, self.poll_interval_s, job.output_dir)
            return submitted.results()[0]
        except KeyboardInterrupt:
            raise TrainingInterrupted(
                f"stopped waiting; SLURM job {submitted.job_id} goes on (`scancel {submitted.job_id}` stops it)."
            ) from None
        except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
            if failure := node_failure(submitted.job_id, job.output_dir, rank0.paths.stderr):
                raise failure from None
            if hung := hang_failure(
                job.output_dir, since=submitted_at
            ):  # a rank's watchdog ended it (exit 124)
                raise hung from None
            if reported := reported_failure(
                errors, causes_only=True
            ):  # what a task raised, as it would be raised here
                raise reported from None
            raise RankFailedError(
                f"SLURM job {submitted.job_id} ended {submitted.state} without a result. Rank 0's log: "
                f"{rank0.paths.stderr}; the others' are next to it.\n{err}"
            ) from None

    @classmethod
    def launch_sweep(cls, sweep: Sweep) -> list[JobReturn]:
        """A sweep's jobs as SLURM arrays (`runner.launchers.slurm.sweep.queue_sweep`)."""
        return queue_sweep(cls, sweep)

    def executor(self, folder: Path, tasks_per_node: int) -> Any:
        """submitit's SlurmExecutor for a job (or an array of jobs) of `tasks_per_node` tasks on each node,
        its batch script and logs in `folder`."""
        import submitit

        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=self.max_timeouts)
        executor.update_parameters(**self.sbatch_parameters(tasks_per_node))
        return executor

    def sbatch_parameters(self, tasks_per_node: int) -> dict[str, Any]:
        """What submitit's SlurmExecutor is given for a job of `tasks_per_node` tasks on each node."""
        optional = {
            "partition": self.partition,
            "cpus_per_task": self.cpus_per_task,
            "mem": f"{int(self.mem_gb * 1024)}MB" if self.mem_gb is not None else None,
            "account": self.account,
            "qos": self.qos,
            "constraint": self.constraint,
            "gpus_per_node": self.gpus_per_node or None,
        }
        return {
            "job_name": self.name,
            "nodes": self.nodes,
            "ntasks_per_node": tasks_per_node,
            "time": self.time_min,
            "signal_delay_s": self.signal_delay_s,
            "setup": self.setup,
            "additional_parameters": self.sbatch_args,
            # A rank that dies (a signal, an OOM kill) ends the job instead of leaving its peers waiting.
            "srun_args": ["--kill-on-bad-exit=1", *self.srun_args],
            **{key: value for key, value in optional.items() if value is not None},
        }


@dataclass
class SlurmTask:
    """What each task of the job runs (pickled by submitit): one rank of `nodes` x `tasks_per_node`. Its
    `checkpoint` is what submitit calls on the preemption signal: the same task again, which resumes
    from the job dir's latest checkpoint."""

    job: Job
    nodes: int
    tasks_per_node: int
    errors: Path  # where a task that raises reports it (`report_failure`)
    launcher_reports: bool = False  # the submitting launcher waits for the job and reports its failures

    def __call__(self) -> dict[str, float]:
        try:
            check_world(self.nodes, self.tasks_per_node)
            return run_rank(self.job, self.launcher_reports)
        except BaseException as err:
            if isinstance(err, TrainingInterrupted):
                requeue_if_preempted(err)  # a preempted job is requeued here (and this task ends)
            env = launched_environment()
            report_failure(self.errors, env.rank if env else 0, err)
            raise

    def checkpoint(self) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self)


def check_world(nodes: int, tasks_per_node: int) -> None:
    """ConfigError unless SLURM started this task as one of `nodes` x `tasks_per_node` ranks (an `srun`
    option, a site's defaults or a setup line can change the step: the ranks would form another world)."""
    env = launched_environment()
    world = env.world_size if env else 1
    step_nodes, said = slurm_step_nodes()
    if world != nodes * tasks_per_node or step_nodes != nodes:
        raise ConfigError(
            f"launcher.nodes={nodes} x {tasks_per_node} task(s) per node asks for {nodes * tasks_per_node} rank(s) "
            f"on {nodes} node(s), but SLURM started this task as one of {world} rank(s) on {step_nodes} node(s) "
            f"({said}). Remove the option that changes the step's tasks "
            "(launcher.srun_args, launcher.sbatch_args, launcher.setup) or set launcher.nodes and the hardware's "
            "num_processes to what the job should have."
        )


def requeue_if_preempted(err: TrainingInterrupted) -> None:
    """In a submitit job stopped by SLURM's preemption signal (after checkpointing), hand over to
    submitit: rank 0 requeues the job and exits; the other ranks wait for the requeue to stop them (a
    rank exiting first would end the job before it is requeued). Elsewhere, return."""
    if "SUBMITIT_FOLDER" not in os.environ or err.signum != PREEMPTION_SIGNAL:
        return
    env = launched_environment()
    if env is not None and env.rank != 0:
        time.sleep(REQUEUE_WAIT_S)
        return
    requeue = signal.getsignal(PREEMPTION_SIGNAL)  # submitit's, restored when the loop stopped
    if callable(requeue):
        log.warning("preempted or at the time limit: requeueing SLURM job %s", slurm_job_id())
        requeue(PREEMPTION_SIGNAL, None)  # exits
