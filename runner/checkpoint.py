"""Checkpoints on disk: one atomic writer, the `latest` pointer, numbered names, RNG states.

A checkpoint is a directory. It is written under a temporary name next to its final one, every file
fsynced, then renamed into place; only then does `latest` (a small file, itself replaced atomically)
name it. A crash or kill -9 at any moment leaves the previous checkpoint complete and `latest`. Its
`meta.json` records every file's size and CRC-32, checked before it is resumed: a file damaged later
(a truncated copy, a bad disk) is refused by name, and `trainer.resume=auto` falls back to the newest
checkpoint that is whole.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner.errors import ConfigError

log = logging.getLogger(__name__)

LATEST = "latest"
META = "meta.json"
FORMAT_VERSION = 1
DAMAGED = ".damaged"  # the suffix a damaged checkpoint is moved aside with
_NUMBERED = re.compile(r"checkpoint_(\d+)$")
_CHUNK = 16 << 20


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


def damaged_error(checkpoint: Path, problems: list[str], key: str = "trainer.resume") -> ConfigError:
    return ConfigError(
        f"{key}: {checkpoint} is damaged: {'; '.join(problems)}. It cannot be resumed. Resume from another "
        f"checkpoint of the run (trainer.resume=<dir>), or start fresh with trainer.resume=null."
    )


def save_torch(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def load_torch(path: Path, mmap: bool = False) -> Any:
    """Read a file `save_torch` wrote, without unpickling arbitrary objects; with `mmap`, its tensors are
    mapped from the file and read only when used."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def resume_checkpoint(resume: str | None, output_dir: Path, verify: bool = False) -> Path | None:
    """The checkpoint `trainer.resume` asks for: None (start fresh), "auto" (the output dir's latest, if
    any: a re-run or requeued job continues), or a checkpoint directory, which must exist.

    With `verify` (the launching process, before any rank starts), its files are checked against its
    metadata: an explicit checkpoint that is damaged is refused; for "auto", a damaged latest is moved
    aside (`checkpoint_<n>.damaged`, nothing is deleted) with a warning, and the newest whole checkpoint
    becomes the latest."""
    if resume is None:
        return None
    if resume != "auto":
        checkpoint = Path(resume)
        meta = read_meta(checkpoint)
        if verify and (problems := damage(checkpoint, meta)):
            raise damaged_error(checkpoint, problems)
        return checkpoint
    checkpoints_dir = output_dir / "checkpoints"
    latest = latest_checkpoint(checkpoints_dir)
    if not verify or latest is None:
        return latest
    older = [path for path in reversed(numbered_checkpoints(checkpoints_dir)) if path != latest]
    for candidate in [latest, *older]:
        try:
            problems = damage(candidate, read_meta(candidate))
        except ConfigError as err:
            problems = [str(err).split(": ", 1)[-1]]
        if not problems:
            if candidate != latest:
                mark_latest(candidate)
            return candidate
        aside = candidate.with_name(candidate.name + DAMAGED)
        if candidate.is_dir():
            candidate.rename(aside)
        log.warning(
            "trainer.resume=auto: %s cannot be resumed (%s); moved it to %s and trying the checkpoint before it.",
            candidate,
            "; ".join(problems),
            aside,
        )
    raise ConfigError(
        f"trainer.resume=auto: no checkpoint in {checkpoints_dir} is whole (the damaged ones were moved aside "
        f"as checkpoint_<n>{DAMAGED}). Start fresh with trainer.resume=null, or resume from a copy you trust "
        "(trainer.resume=<dir>)."
    )


def check_checkpoint_fits(
    checkpoint: Path,
    world_size: int,
    checkpoint_format: str,
    key: str = "trainer.resume",
    reshards: bool = False,
    readers: int | None = None,
    split_batches: bool = False,
) -> dict[str, Any]:
    """The checkpoint's metadata, or a ConfigError naming `key` when this hardware cannot read its model
    state (another `Strategy.checkpoint_format`), or cannot on this many ranks (a format that does not
    `reshards` onto another layout), or when its data positions mean something else here: `readers`
    (this run's data-parallel ranks; None: no data position to restore) differ from the writer's, and
    the batch size is not the global one in both runs (`split_batches`). Checked before any rank starts
    and again by `Accelerator.load_state`."""
    meta = read_meta(checkpoint, key=key)
    check_format(checkpoint, meta, checkpoint_format)
    written_by = meta["num_processes"]
    if written_by != world_size and not reshards:
        raise ConfigError(
            f"{key}: {checkpoint} was written by {written_by} process(es) and this run has {world_size}; "
            f"its {checkpoint_format!r} model state does not reshard onto another number of ranks (the sharded "
            f"checkpoints of hardware=fsdp and megatron do). Resume with {written_by} process(es) "
            f"(hardware.num_processes={written_by} from the command line), or start fresh (trainer.resume=null)."
        )
    written_readers = meta.get("data_parallel_size", written_by)
    if (
        readers is not None
        and written_readers != readers
        and not (split_batches and meta.get("split_batches"))
    ):
        raise ConfigError(
            f"{key}: {checkpoint} was written by {written_readers} data-parallel rank(s) and this run has "
            f"{readers}: with a batch size per rank, the global batch and so each rank's data position would "
            "change. Resharding a run onto another layout needs trainer.split_batches=true (data.batch_size is "
            f"the global batch) in the run that wrote it and in this one; else resume with {written_readers} "
            "data-parallel rank(s)."
        )
    return meta


def check_optimizer_classes(checkpoint: Path, meta: dict[str, Any], classes: list[str]) -> None:
    """Refuse a checkpoint whose optimizer state another kind of optimizer wrote (`classes`: this run's,
    as "module.QualName"); checkpoints of earlier versions do not record theirs."""
    written_with = meta.get("optimizer_classes")
    if written_with is not None and written_with != classes:
        raise ConfigError(
            f"{checkpoint} holds the state of optimizer(s) {', '.join(written_with)} and this run has "
            f"{', '.join(classes)}: an optimizer's state does not carry over to another kind. Resume with the optimizer "
            "it was written with, or start fresh (trainer.resume=null)."
        )


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
