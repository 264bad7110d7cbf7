"""`launcher=slurm`: the job on a SLURM cluster through submitit, one task per rank; a sweep's jobs as SLURM
arrays with the same keys (`SlurmLauncher.launch_sweep`); and what a job running under SLURM does on the preemption or
time-limit signal (checkpoint, requeue, resume)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

from runner.cluster import launched_environment
from runner.cluster.slurm import slurm_job_id, slurm_step_nodes
from runner.config import NonNegativeInt, PositiveFloat, PositiveInt, checked
from runner.errors import ConfigError, RankFailedError, TrainingInterrupted, install_command
from runner.hardware.base import Strategy
from runner.launchers.base import Job, Launcher, Sweep, run_rank
from runner.launchers.reports import report_failure, reported_failure

log = logging.getLogger(__name__)

PREEMPTION_SIGNAL = signal.SIGUSR2  # what submitit asks SLURM to send before the time limit
REQUEUE_WAIT_S = 120.0  # how long a rank other than 0 waits for the requeue to stop it
NODE_CHECK_INTERVAL_S = 5.0  # how often a job not running is checked for a lost node
RANK_ERRORS = "rank_errors"  # in submitit's folder (a sweep job's: its dir's slurm/): what each task raised

_in_array_task = (
    False  # this process is a task of a sweep's SLURM array (`SweepTask`): one of its job's ranks
)


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
    ) -> None:
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
        if not _in_array_task:  # a task of a sweep's array was checked before it was queued
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
        if _in_array_task:
            return
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
        )

    def launch(self, job: Job) -> dict[str, float]:
        import submitit

        tasks_per_node = self.tasks_per_node(job.cfg, job.strategy or instantiate(job.cfg.hardware))
        if _in_array_task:  # a job of a sweep, queued by `launch_sweep`: this task is one of its ranks
            return SlurmTask(job, self.nodes, tasks_per_node, job.output_dir / "slurm" / RANK_ERRORS)()
        folder = Path(self.folder) if self.folder else job.output_dir / "slurm"
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=self.max_timeouts)
        executor.update_parameters(**self.sbatch_parameters(tasks_per_node))
        errors = folder / RANK_ERRORS  # what each task raised (`report_failure`), for this launch only
        shutil.rmtree(errors, ignore_errors=True)
        submitted = executor.submit(SlurmTask(job.for_other_processes(), self.nodes, tasks_per_node, errors))
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
                "launcher.wait=false: not waiting; its metrics will be in %s", job.output_dir / "metrics.json"
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
        """A sweep's jobs on SLURM (`python -m runner -m launcher=slurm ...`, through runner's Hydra launcher):
        each run of consecutive jobs that ask the same of the cluster is one array, one array task per job with
        `launcher.nodes` x tasks per node SLURM tasks (one per rank), queued together, then waited for. Every
        job was checked before (`runner.sweep.SweepCheck`, the cluster's limits included). The jobs' results,
        in order; a job whose tasks died without one is FAILED with what its ranks reported."""
        import submitit

        arrays: list[tuple[tuple[dict[str, Any], Path, int], list[tuple[list[str], int, Path]]]] = []
        config = sweep.config
        for number, overrides, cfg in sweep.jobs():
            launcher = instantiate(cfg.launcher)
            if not isinstance(launcher, cls):
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
            parameters = launcher.sbatch_parameters(launcher.tasks_per_node(cfg, instantiate(cfg.hardware)))
            folder = Path(launcher.folder) if launcher.folder else Path(config.hydra.sweep.dir) / "slurm"
            asks = (parameters, folder, launcher.max_timeouts)
            job = (list(overrides), number, Path(config.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir))
            if arrays and arrays[-1][0] == asks:
                arrays[-1][1].append(job)
            else:
                arrays.append((asks, [job]))
        task = SweepTask(sweep.hydra_context, sweep.task_function, config)
        queued = []
        for (parameters, folder, max_timeouts), jobs in arrays:
            executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=max_timeouts)
            executor.update_parameters(**parameters)
            overrides, numbers, dirs = zip(*jobs, strict=True)
            for job_dir in dirs:  # what a job's tasks raised, for this launch only
                shutil.rmtree(job_dir / "slurm" / RANK_ERRORS, ignore_errors=True)
            submitted = executor.map_array(task, overrides, numbers, [Singleton.get_state()] * len(jobs))
            log.info(
                "submitted SLURM array %s: job(s) %s of the sweep, each %d node(s) x %d task(s); logs in %s",
                submitted[0].job_id.partition("_")[0],
                ", ".join(map(str, numbers)),
                parameters["nodes"],
                parameters["ntasks_per_node"],
                folder,
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

    def __call__(self) -> dict[str, float]:
        try:
            check_world(self.nodes, self.tasks_per_node)
            return run_rank(self.job)
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


def lost_nodes(job_id: str) -> list[str]:
    """The nodes whose failure ended SLURM job `job_id` (its run that ended NODE_FAIL), each with its state
    and reason now: `rnode2 (down*: Not responding)`."""
    try:
        history = subprocess.run(
            ["sacct", "--duplicates", "--allocations", "--noheader", "--parsable2", "--jobs", job_id,
             "--format=State,NodeList"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    nodes = [nodelist for state, _, nodelist in (line.partition("|") for line in history.splitlines())
             if state == "NODE_FAIL"]  # fmt: skip
    if not nodes:
        return []
    try:
        states = subprocess.run(
            ["sinfo", "--noheader", "--Node", "--nodes", ",".join(nodes), "--format=%N|%T|%E"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return sorted(set(nodes))
    lost = {}
    for line in states.splitlines():
        name, state, reason = line.split("|", 2)
        if not state.startswith(("idle", "mixed", "allocated", "completing")) or state.endswith("*"):
            lost[name] = f"{name} ({state}: {reason})"
    return list(lost.values()) or sorted(set(nodes))


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


def require_slurm(what: str) -> None:
    """ConfigError unless submitit is installed and this machine can submit SLURM jobs."""
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{what} needs submitit, which is not installed. Install it with `{install_command('slurm')}`."
        ) from None
    if shutil.which("sbatch") is None:
        raise ConfigError(
            f"{what}: `sbatch` is not on PATH, so this machine cannot submit SLURM jobs. Run from a SLURM "
            "login node (or add SLURM's bin dir to PATH), or use launcher=local to run here."
        )


@dataclass(frozen=True)
class Partition:
    """A partition as `sinfo` reports it (largest node, for what one node can hold)."""

    name: str
    default: bool
    nodes: int
    cpus_per_node: int
    mem_mb_per_node: int
    gpus_per_node: int
    max_time_min: int | None  # None: no limit


def read_partitions() -> dict[str, Partition]:
    """The cluster's partitions, from `sinfo`."""
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--format=%P|%D|%c|%m|%G|%l"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or err
        raise ConfigError(
            f"launcher: could not ask SLURM about its partitions (`sinfo` failed: {str(detail).strip()}). Check "
            "that slurmctld is reachable from this machine (`sinfo`), or use launcher=local."
        ) from None
    partitions: dict[str, Partition] = {}
    for line in out.splitlines():
        name, nodes, cpus, mem, gres, limit = line.split("|")
        default = name.endswith("*")
        name = name.rstrip("*")
        seen = partitions.get(name)
        partitions[name] = Partition(
            name=name,
            default=default,
            nodes=int(nodes) + (seen.nodes if seen else 0),
            cpus_per_node=max(_number(cpus), seen.cpus_per_node if seen else 0),
            mem_mb_per_node=max(_number(mem), seen.mem_mb_per_node if seen else 0),
            gpus_per_node=max(_gpus(gres), seen.gpus_per_node if seen else 0),
            max_time_min=_minutes(limit),
        )
    return partitions


def check_request(
    partition: str | None,
    *,
    nodes: int,
    cpus_per_node: int,
    gpus_per_node: int,
    mem_gb: float | None,
    time_min: int,
    key: str,
) -> None:
    """ConfigError naming each thing asked of `partition` that it does not have (nodes, CPUs, GPUs,
    memory per node, time limit)."""
    partitions = read_partitions()
    if partition is None:
        defaults = [p for p in partitions.values() if p.default]
        if not defaults:
            raise ConfigError(
                f"{key}.partition is null and the cluster has no default partition. Set {key}.partition to one "
                f"of: {', '.join(partitions) or '(none)'}."
            )
        found = defaults[0]
    elif partition not in partitions:
        raise ConfigError(
            f"{key}.partition={partition!r}: the cluster has no such partition (it has "
            f"{', '.join(partitions) or 'none'}; `sinfo` lists them). Set {key}.partition to one of those."
        )
    else:
        found = partitions[partition]
    problems = []
    if nodes > found.nodes:
        problems.append(
            f"{key}.nodes={nodes}: partition {found.name} has {found.nodes} node(s). Ask for at most {found.nodes}."
        )
    if cpus_per_node > found.cpus_per_node:
        problems.append(
            f"{key}: each node would need {cpus_per_node} CPUs (tasks per node x cpus_per_task) but the nodes of "
            f"partition {found.name} have at most {found.cpus_per_node}. Lower {key}.cpus_per_task or the "
            "processes per node (hardware.num_processes), or use more nodes."
        )
    if gpus_per_node > found.gpus_per_node:
        problems.append(
            f"{key}.gpus_per_node={gpus_per_node}: the nodes of partition {found.name} have "
            f"{found.gpus_per_node or 'no'} GPUs (SLURM gres). Pick a GPU partition, or ask for fewer."
        )
    if mem_gb is not None and mem_gb * 1024 > found.mem_mb_per_node:
        problems.append(
            f"{key}.mem_gb={mem_gb}: the nodes of partition {found.name} have {found.mem_mb_per_node / 1024:.1f} GB. "
            "Ask for less, or null for SLURM's default."
        )
    if found.max_time_min is not None and time_min > found.max_time_min:
        problems.append(
            f"{key}: a time limit of {time_min} min is over partition {found.name}'s limit of "
            f"{found.max_time_min} min. Ask for less (the job checkpoints and requeues itself at its limit)."
        )
    if problems:
        raise ConfigError("\n\n".join(problems))


def node_failure(job_id: str, output_dir: Path, log_file: Path) -> RankFailedError | None:
    """If SLURM job `job_id` lost a node, the error that names it, once the job is cancelled: SLURM
    requeues a job that lost a node, and it would start again, unwatched, once it had nodes."""
    lost = lost_nodes(job_id)
    if not lost:
        return None
    subprocess.run(["scancel", job_id], capture_output=True, check=False)
    return RankFailedError(
        f"SLURM job {job_id} lost node(s) {'; '.join(lost)}, and was cancelled (SLURM had requeued it). Run the "
        f"same command to resume from its latest checkpoint in {output_dir} on healthy nodes. Rank 0's log: "
        f"{log_file}."
    )


def pending_reason(job_id: str) -> str:
    """Why SLURM has not started job `job_id` (`Resources`, `Nodes required for job are DOWN, ...`), as
    squeue says; empty once it runs or is gone."""
    try:
        out = subprocess.run(
            ["squeue", "--noheader", "--states=PENDING", "--format=%r", "--jobs", job_id],
            capture_output=True, text=True, timeout=30, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().replace("_", " ")


def follow(submitted: Any, log_file: Path, poll_interval_s: float, output_dir: Path) -> None:
    """Copy what rank 0 writes to its log onto this process's stderr until the job ends (a requeued job
    starts its log again: read it from the start). A job that lost a node is cancelled and raised as
    `node_failure`'s error (it would wait to be started again)."""
    offset = 0
    checked = time.monotonic()
    reason = ""
    while True:
        done = submitted.done()
        if not done and time.monotonic() - checked > NODE_CHECK_INTERVAL_S and submitted.state != "RUNNING":
            checked = time.monotonic()
            if failure := node_failure(submitted.job_id, output_dir, log_file):
                raise failure
            if (now := pending_reason(submitted.job_id)) and now != reason:
                log.info("SLURM job %s is pending: %s", submitted.job_id, now)
            reason = now
        try:
            size = log_file.stat().st_size
        except FileNotFoundError:
            size = 0
        if size < offset:
            offset = 0
        if size > offset:
            with open(log_file, "rb") as f:
                f.seek(offset)
                chunk = f.read(size - offset)
            offset = size
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
        if done:
            return
        time.sleep(poll_interval_s)


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


@dataclass
class SweepTask:
    """What each task of a sweep's array runs (pickled by submitit): its job composed as Hydra's launchers
    compose it, then run by the task function, in which `SlurmLauncher.launch` runs this task's rank. Its
    `checkpoint` is what submitit calls on the preemption signal: the same job again, which resumes."""

    hydra_context: HydraContext
    task_function: TaskFunction
    config: DictConfig

    def __call__(self, overrides: list[str], number: int, singleton_state: dict[Any, Any]) -> JobReturn:
        global _in_array_task
        Singleton.set_state(singleton_state)
        setup_globals()
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.num = cfg.hydra.job.id = number
        _in_array_task = True
        return run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=cfg,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )

    def checkpoint(self, *args: Any) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args)


def _number(value: str) -> int:
    """`sinfo` numbers: `8`, or `8+` where nodes differ (the smallest)."""
    return int(value.rstrip("+")) if value.rstrip("+").isdigit() else 0


def _gpus(gres: str) -> int:
    """GPUs per node from a gres string: `gpu:8`, `gpu:a100:4(S:0-1)`, `(null)`."""
    counts = [int(m) for m in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)]
    return max(counts, default=0)


def _minutes(limit: str) -> int | None:
    """A SLURM time limit (`infinite`, `30`, `30:00`, `2:00:00`, `1-00:00:00`, `1-12`) in minutes."""
    if limit in ("infinite", "UNLIMITED", "n/a"):
        return None
    days, _, clock = limit.rpartition("-")
    fields = [int(part) for part in clock.split(":")]
    if days:  # d-h, d-h:m, d-h:m:s
        hours, minutes, seconds = ([*fields, 0, 0])[:3]
    elif len(fields) == 3:  # h:m:s
        hours, minutes, seconds = fields
    else:  # m, m:s
        hours, minutes, seconds = 0, fields[0], ([*fields, 0])[1]
    return int(days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)
