"""The run dir's lock: one run writes into a dir at a time.

The lock is a `flock` on the directory itself (no file is left behind; the kernel drops it when the last
process holding it is gone, so it is never stale). Processes the run forks inherit it: its ranks, which
must keep a second run out while they write, and its DataLoader workers. After a `kill -9` those can
outlive the run (an idle worker looks for its parent every 5 s; one busy on a sample finishes it first;
ranks until their collectives fail): a run finding the lock taken by a process that is gone waits for
them, up to `LEFTOVER_WAIT_S`, instead of refusing a dir that is about to be free.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runner.errors import ConfigError

log = logging.getLogger(__name__)

LEFTOVER_WAIT_S = 30.0  # how long a run waits for the processes a dead run left holding its dir's lock
POLL_S = 0.1


@contextmanager
def run_dir_lock(output_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on `output_dir` inside: a second run into the same dir is refused (a
    ConfigError naming who holds it) before it writes anything but its log line."""
    fd = os.open(output_dir, os.O_RDONLY)
    try:
        _acquire(fd, output_dir)
        yield
    finally:
        os.close(fd)


def _acquire(fd: int, output_dir: Path) -> None:
    """Take the lock, waiting while it is held only by what a dead run left; else a ConfigError."""
    deadline = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        owner = _lock_owner(output_dir)
        if owner is None or (owner and _alive(owner)):
            raise ConfigError(
                f"hydra.run.dir={output_dir} is in use by another run{f' (pid {owner})' if owner else ''}: two "
                "runs in one dir would overwrite each other's checkpoints, metrics and model. Wait for it to end, "
                "or give this run a dir of its own (hydra.run.dir=<another dir>)."
            )
        if deadline is None:
            deadline = time.monotonic() + LEFTOVER_WAIT_S
            log.info(
                "hydra.run.dir=%s: the run that held it%s is gone; waiting up to %.0f s for the "
                "processes it started that still hold it to exit (pid %s)",
                output_dir,
                f" (pid {owner})" if owner else "",
                LEFTOVER_WAIT_S,
                ", ".join(map(str, _holders(output_dir))) or "unknown",
            )
        elif time.monotonic() > deadline:
            pids = " ".join(map(str, _holders(output_dir)))
            raise ConfigError(
                f"hydra.run.dir={output_dir} is still held, {LEFTOVER_WAIT_S:.0f} s on, by processes that the "
                f"run{f' pid {owner}' if owner else ''} started and that outlived it (its DataLoader workers or ranks"
                f"{': pid ' + pids if pids else ''}). Stop them{f' (kill {pids})' if pids else ''} and run the "
                "same command again, or give this run a dir of its own (hydra.run.dir=<another dir>)."
            )
        time.sleep(POLL_S)


def _lock_owner(path: Path) -> int | None:
    """The pid that took the flock on `path`, from /proc/locks (Linux; it stays there after that process
    died while processes it forked hold the lock); 0 where the lock is not listed: inside a pid namespace
    (a container) the kernel leaves out a lock whose owner is dead and reaped; None without /proc/locks."""
    stat = os.stat(path)
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if "FLOCK" in fields and device in fields:
            try:
                return int(fields[fields.index(device) - 1])
            except ValueError:
                return None
    return 0


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _holders(path: Path) -> list[int]:
    """The other processes with `path` open (Linux; those of other users cannot be seen): its lock's
    holders among them."""
    target, this = os.path.realpath(path), str(os.getpid())
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        if entry.name == this:
            continue
        try:
            if any(os.readlink(fd) == target for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:
            continue
    return sorted(found)


def in_use(output_dir: Path) -> bool:
    """Whether a live run holds `output_dir`'s lock, read from /proc/locks (taking none: a run starting
    meanwhile is not refused); False without /proc/locks."""
    owner = _lock_owner(output_dir)
    return bool(owner) and _alive(owner)  # type: ignore[arg-type]
