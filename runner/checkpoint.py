"""Checkpoints on disk: one atomic writer, the `latest` pointer, numbered names, RNG states.

A checkpoint is a directory. It is written under a temporary name next to its final one, every file
fsynced, then renamed into place; only then does `latest` (a small file, itself replaced atomically)
name it. A crash or kill -9 at any moment leaves the previous checkpoint complete and `latest`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner.errors import ConfigError

LATEST = "latest"
META = "meta.json"
FORMAT_VERSION = 1
_NUMBERED = re.compile(r"checkpoint_(\d+)$")


@dataclass
class ProjectConfiguration:
    """Where `Accelerator.save_state` puts checkpoints when it is given no directory (Accelerate's).

    Args:
        project_dir: the project's directory; checkpoints go to `<project_dir>/checkpoints/`.
        automatic_checkpoint_naming: name checkpoints `checkpoint_<iteration>` and count `iteration` up.
        total_limit: keep at most this many numbered checkpoints, deleting the oldest.
        iteration: the number the next automatic checkpoint gets.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0

    @property
    def checkpoints_dir(self) -> Path:
        if self.project_dir is None:
            raise ValueError("ProjectConfiguration.project_dir is not set: save_state() needs a directory.")
        return Path(self.project_dir) / "checkpoints"


def staging_path(final: Path) -> Path:
    """Where `final` is written before it is renamed into place."""
    return final.parent / f".{final.name}.partial"


def start_staging(final: Path) -> Path:
    """An empty staging directory for `final` (a leftover from a crashed save is removed)."""
    staging = staging_path(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit_staging(final: Path) -> None:
    """fsync every staged file, then rename the staging directory to `final` (replacing it)."""
    staging = staging_path(final)
    for path in staging.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(staging)
    old = final.parent / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a staging directory to fill; on success it becomes `final` at once (for one writer)."""
    staging = start_staging(final)
    try:
        yield staging
        commit_staging(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old content or the new, never a part."""
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text(text)
    _fsync(staging)
    staging.replace(path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_latest(checkpoint: Path) -> None:
    """Make `checkpoint` the one that `latest_checkpoint` returns for its parent directory."""
    atomic_write_text(checkpoint.parent / LATEST, checkpoint.name + "\n")


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The checkpoint `latest` names in `checkpoints_dir`, or None when there is none yet."""
    pointer = checkpoints_dir / LATEST
    if not pointer.is_file():
        return None
    latest = checkpoints_dir / pointer.read_text().strip()
    previous = checkpoints_dir / f".{latest.name}.old"  # a crash while it was being overwritten
    return previous if not latest.exists() and previous.exists() else latest


def numbered_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """`checkpoint_<n>` directories, oldest first."""
    found = [
        (int(m.group(1)), p) for p in checkpoints_dir.glob("checkpoint_*") if (m := _NUMBERED.match(p.name))
    ]
    return [path for _, path in sorted(found)]


def checkpoint_number(checkpoint: Path) -> int | None:
    """n for a `checkpoint_<n>` directory, else None."""
    match = _NUMBERED.match(checkpoint.name)
    return int(match.group(1)) if match else None


def prune(checkpoints_dir: Path, total_limit: int) -> None:
    """Delete the oldest numbered checkpoints beyond `total_limit`, never the one `latest` names."""
    latest = latest_checkpoint(checkpoints_dir)
    numbered = numbered_checkpoints(checkpoints_dir)
    for path in numbered[: max(0, len(numbered) - total_limit)]:
        if path != latest:
            shutil.rmtree(path, ignore_errors=True)


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    (directory / META).write_text(json.dumps({"format": FORMAT_VERSION, **meta}, indent=1))


def read_meta(checkpoint: Path, key: str = "trainer.resume") -> dict[str, Any]:
    """The checkpoint's metadata, or a ConfigError saying why `checkpoint` is not a checkpoint."""
    if not checkpoint.is_dir():
        raise ConfigError(
            f"{key}={str(checkpoint)!r}: no such directory. Pass a checkpoint directory (e.g. "
            "<run dir>/checkpoints/checkpoint_3), `auto` to resume from the run dir's latest, or null."
        )
    meta_file = checkpoint / META
    if not meta_file.is_file():
        raise ConfigError(
            f"{key}={str(checkpoint)!r}: not a checkpoint (it has no {META}; runner's save_state writes one). "
            "Pass a directory that Accelerator.save_state wrote, or null to start fresh."
        )
    return json.loads(meta_file.read_text())


def save_torch(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def load_torch(path: Path, mmap: bool = False) -> Any:
    """Read a file `save_torch` wrote, without unpickling arbitrary objects; with `mmap`, its tensors are
    mapped from the file and read only when used."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def resume_checkpoint(resume: str | None, output_dir: Path) -> Path | None:
    """The checkpoint `trainer.resume` asks for: None (start fresh), "auto" (the output dir's latest, if
    any: a re-run or requeued job continues), or a checkpoint directory, which must exist."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir / "checkpoints")
    read_meta(Path(resume))
    return Path(resume)


def check_checkpoint_fits(
    checkpoint: Path, world_size: int, checkpoint_format: str, key: str = "trainer.resume"
) -> dict[str, Any]:
    """The checkpoint's metadata, or a ConfigError naming `key` when this hardware cannot read its model
    state (another `Strategy.checkpoint_format`) or this many ranks cannot use its per-rank state. Checked
    before any rank starts and again by `Accelerator.load_state`."""
    meta = read_meta(checkpoint, key=key)
    check_format(checkpoint, meta, checkpoint_format)
    written_by = meta["num_processes"]
    if written_by != world_size:
        raise ConfigError(
            f"{key}: {checkpoint} was written by {written_by} process(es) and this run has {world_size}; "
            "each rank's data position and RNG state do not carry over to another number of ranks. Resume with "
            f"{written_by} process(es) (hardware.num_processes={written_by} from the command line), or start "
            "fresh (trainer.resume=null)."
        )
    return meta


def check_format(checkpoint: Path, meta: dict[str, Any], checkpoint_format: str) -> None:
    """Refuse a checkpoint whose models and optimizers were written in another format than this
    hardware's (whole-model safetensors, sharded DCP, DeepSpeed partitions)."""
    written_as = meta.get("checkpoint_format", "full")
    if written_as != checkpoint_format:
        raise ConfigError(
            f"{checkpoint} holds {written_as!r} model state and this run's hardware reads "
            f"{checkpoint_format!r} checkpoints. Resume it with the hardware group that wrote it (see its run's "
            "resolved_config.yaml), or start fresh with trainer.resume=null."
        )
