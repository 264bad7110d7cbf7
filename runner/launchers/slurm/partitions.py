"""What a SLURM cluster has (`sinfo`'s partitions), and a job's request checked against it before it is
queued."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from runner.errors import ConfigError, install_command


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
