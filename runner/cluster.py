"""Is this process already one rank of a job started by a launcher (torchrun, srun, our own)?"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankEnvironment:
    """This process's place in a job, read from the variables its launcher set."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    # A task of a SLURM job step (srun): the step's hosts in order, and how many tasks each runs.
    slurm_hosts: tuple[str, ...] = ()
    slurm_tasks_per_host: tuple[int, ...] = ()

    def expected_host(self, rank: int) -> str | None:
        """The host SLURM runs `rank` on (block distribution: the first host's tasks, then the next's);
        None outside a SLURM step."""
        for host, tasks in zip(self.slurm_hosts, self.slurm_tasks_per_host, strict=False):
            if rank < tasks:
                return host
            rank -= tasks
        return None

    def export(self) -> None:
        """Set the torch variables (`RANK`, `MASTER_ADDR`, ...) that `init_process_group("env://")` reads."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def launched_environment() -> RankEnvironment | None:
    """The rank this process is, when a launcher started it; None when it is a plain process.

    torch's launchers (torchrun, `elastic_launch`, submitit's export) set `RANK` and `WORLD_SIZE`; `srun`
    with more than one task sets `SLURM_PROCID` and `SLURM_NTASKS`. The rendezvous is then the step's first
    host, on a port derived from the job id: `MASTER_ADDR` and `MASTER_PORT` are not read there, since
    sbatch passes on the submitting shell's environment, where they name the login node or localhost.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        return RankEnvironment(
            rank=int(env["RANK"]),
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_PROCID" in env:
        hosts = expand_hosts(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1")
        tasks = task_counts(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1")
        node = int(env.get("SLURM_NODEID", 0))
        return RankEnvironment(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=tasks[min(node, len(tasks) - 1)],
            master_addr=hosts[0],
            master_port=20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000,
            slurm_hosts=tuple(hosts),
            slurm_tasks_per_host=tuple((tasks * len(hosts))[: len(hosts)] if len(tasks) == 1 else tasks),
        )
    return None


def export_local_rank(local_rank: int) -> None:
    """Set `LOCAL_RANK` where no launcher did (a process group of one formed in this process): DeepSpeed reads
    it from the environment. `RANK` and `WORLD_SIZE` stay unset, so this process is still not a launched
    rank for `launched_environment`."""
    os.environ.setdefault("LOCAL_RANK", str(local_rank))


def slurm_job_id() -> str | None:
    """The SLURM job this process runs in, if any."""
    return os.environ.get("SLURM_JOB_ID")


def slurm_step_nodes() -> tuple[int, str]:
    """How many nodes this task's SLURM step spans (else its job; 1 outside SLURM), and the variables that
    say so, as a message quotes them."""
    env = os.environ
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    said = (
        f"SLURM_NTASKS={env.get('SLURM_NTASKS', 'unset')}, "
        f"SLURM_STEP_NUM_NODES={env.get('SLURM_STEP_NUM_NODES', 'unset')}"
    )
    return nodes, said


# What `python -m runner.env` shows of the variables read here.
RANK_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
)


def rank_variables() -> dict[str, str]:
    """Those of `RANK_VARIABLES` that are set."""
    return {name: os.environ[name] for name in RANK_VARIABLES if name in os.environ}


def expand_hosts(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list, in its order: `node[03-05,09],gpu1` -> node03 node04 node05 node09
    gpu1 (what `scontrol show hostnames` prints)."""
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*),?", nodelist):
        if not ranges:
            hosts += [prefix + suffix] if prefix + suffix else []
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for index in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{index:0{len(first)}d}{suffix}")
    if not hosts:
        raise ValueError(f"cannot read a host name from the SLURM node list {nodelist!r}")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `node[03-05,09],gpu1` -> `node03`."""
    return expand_hosts(nodelist)[0]


def task_counts(tasks_per_node: str) -> list[int]:
    """Read SLURM's compressed task counts: `2(x3),1` is 2 tasks on each of 3 nodes, then 1."""
    counts = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(repeat or 1)
    return counts or [1]


def available_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables inside (names upper-cased, values as strings), restored after."""
    before = {key.upper(): os.environ.get(key.upper()) for key in kwargs}
    os.environ.update({key.upper(): str(value) for key, value in kwargs.items()})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# `accelerate launch` (and an Accelerate config) pass settings to the script in these variables.
_ACCELERATE_REFUSED = {
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM: pass strategy=runner.hardware.TensorParallel(...), or run `python -m runner hardware=megatron`",
    "ACCELERATE_USE_SAGEMAKER": "SageMaker data parallel, which runner does not have",
    "ACCELERATE_DEBUG_MODE": "debug mode (shape checks before every collective), which runner does not have",
}


def env_flag(name: str) -> bool:
    """Whether the variable `name` is set to 1, true or yes."""
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class AccelerateLaunchSettings:
    """What `accelerate launch` set for the script, as the Accelerator applies it."""

    cpu: bool = False  # ACCELERATE_USE_CPU
    mixed_precision: str | None = None  # ACCELERATE_MIXED_PRECISION
    gradient_accumulation_steps: int | None = None  # ACCELERATE_GRADIENT_ACCUMULATION_STEPS
    # ACCELERATE_USE_FSDP: the FSDP_* variables of the launch config, named without the prefix, lowercase
    fsdp: dict[str, str] | None = None
    deepspeed: bool = (
        False  # ACCELERATE_USE_DEEPSPEED (a DeepSpeedPlugin reads the ACCELERATE_DEEPSPEED_* variables)
    )
    # ACCELERATE_USE_PARALLELISM_CONFIG (a ParallelismConfig reads the PARALLELISM_CONFIG_* variables)
    parallelism_config: bool = False


def accelerate_launch_settings() -> AccelerateLaunchSettings:
    """The `ACCELERATE_*` variables of this process's environment that runner applies; ValueError for
    one that selects what runner's Accelerator does not do that way (FSDP, DeepSpeed, ... from a launch
    config: never silently replaced by plain data parallel)."""
    refused = [f"{name}=true asks for {why}" for name, why in _ACCELERATE_REFUSED.items() if env_flag(name)]
    if refused:
        raise ValueError(
            "This process was started with Accelerate launch settings that runner's Accelerator does not read: "
            + "; ".join(refused)
            + ". Unset them (or launch with torchrun / `accelerate launch` without them)."
        )
    steps = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    return AccelerateLaunchSettings(
        cpu=env_flag("ACCELERATE_USE_CPU"),
        mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION") or None,
        gradient_accumulation_steps=int(steps) if steps else None,
        fsdp={
            name.removeprefix("FSDP_").lower(): value
            for name, value in os.environ.items()
            if name.startswith("FSDP_")
        }
        if env_flag("ACCELERATE_USE_FSDP")
        else None,
        deepspeed=env_flag("ACCELERATE_USE_DEEPSPEED"),
        parallelism_config=env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"),
    )
