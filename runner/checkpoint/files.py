"""Checkpoint directories on disk: one atomic writer, the `latest` pointer, numbered names, the metadata
with every file's size and CRC-32, and the background writer.

A checkpoint is a directory. It is written under a temporary name next to its final one, every file
fsynced, then renamed into place; only then does `latest` (a small file, itself replaced atomically)
name it. A crash or kill -9 at any moment leaves the previous checkpoint complete and `latest`. Its
`meta.json` records every file's size and CRC-32, checked before it is resumed: a file damaged later
(a truncated copy, a bad disk) is refused by name, and `trainer.resume=auto` falls back to the newest
checkpoint that is whole.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from runner.errors import ConfigError
from runner.files import fsync, write_text

LATEST = "latest"
META = "meta.json"
FORMAT_VERSION = 1
DAMAGED = ".damaged"  # the suffix a damaged checkpoint is moved aside with
_NUMBERED = re.compile(r"checkpoint_(\d+)$")
_CHUNK = 16 << 20
FULL_BELOW_BYTES = 1 << 20  # a file system with less free space than this after a failed write is full


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
            fsync(path)
    fsync(staging)
    old = final.parent / f".{final.name}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    fsync(final.parent)
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


class PendingWrite:
    """A checkpoint written by a background thread: `write` (into its staging dir), then `commit` (which
    makes it the checkpoint); if either fails, `discard`, and `wait` raises the failure. A thread that is
    not a daemon: a process that ends meanwhile finishes the write first."""

    def __init__(
        self,
        final: Path,
        write: Callable[[], None],
        commit: Callable[[], None],
        discard: Callable[[], None],
    ) -> None:
        self.final = final
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(write, commit, discard), name=f"writing {final.name}"
        )
        self._thread.start()

    def _run(
        self, write: Callable[[], None], commit: Callable[[], None], discard: Callable[[], None]
    ) -> None:
        try:
            write()
            commit()
        except BaseException as err:
            self._error = err
            discard()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(
                f"writing the checkpoint {self.final} in the background failed: {self._error}"
            ) from self._error


def mark_latest(checkpoint: Path) -> None:
    """Make `checkpoint` the one that `latest_checkpoint` returns for its parent directory."""
    write_text(checkpoint.parent / LATEST, checkpoint.name + "\n")


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
    try:
        meta = json.loads(meta_file.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("num_processes"), int):
            raise ValueError("it is not the metadata save_state writes")
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"{key}={str(checkpoint)!r}: its {META} is damaged ({str(err).splitlines()[0][:200]}), so nothing in "
            "the checkpoint can be trusted. Resume from another checkpoint of the run, or start fresh with "
            "trainer.resume=null."
        ) from err
    return meta


def checkpoint_files(directory: Path) -> list[str]:
    """The files of a checkpoint directory other than its metadata, as sorted relative paths."""
    return sorted(
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if path.is_file() and path.name != META
    )


def file_digest(path: Path) -> dict[str, int]:
    """The size and CRC-32 of a file: what `meta.json` records for each file of a checkpoint."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": crc}


def damage(checkpoint: Path, meta: dict[str, Any], contents: bool = True) -> list[str]:
    """What is wrong with the files `meta` records: missing, of another size, or (with `contents`,
    which reads them all) of other content; [] for a checkpoint written before files were recorded."""
    problems = []
    for name, recorded in sorted(meta.get("files", {}).items()):
        path = checkpoint / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (size := path.stat().st_size) != recorded["size"]:
            problems.append(f"{name} has {size} bytes, {recorded['size']} were written")
        elif contents and file_digest(path)["crc32"] != recorded["crc32"]:
            problems.append(f"{name} does not have the content that was written (its CRC-32 differs)")
    return problems


class CheckpointDiscarded(Exception):
    """The checkpoint this rank was writing its part into was discarded meanwhile: the main process's own
    write failed (a full disk, a signal). A consequence, reported after that cause."""


def save_torch(obj: Any, path: Path) -> None:
    """`torch.save(obj, path)`; a write that failed for want of space is an OSError(ENOSPC) naming `path`
    (torch's writer reports it as "unexpected pos", without the OS error), one whose directory another
    process removed meanwhile is CheckpointDiscarded."""
    try:
        torch.save(obj, path)
    except RuntimeError as err:
        if not path.parent.is_dir():
            raise CheckpointDiscarded(
                f"{path.parent} was discarded while this rank wrote {path.name}"
            ) from err
        if shutil.disk_usage(path.parent).free >= FULL_BELOW_BYTES:
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from err


def load_torch(path: Path, mmap: bool = False) -> Any:
    """Read a file `save_torch` wrote, without unpickling arbitrary objects; with `mmap`, its tensors are
    mapped from the file and read only when used."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
