"""The files a run writes, at the ground floor: a file replaced whole (a reader sees the old content or the
new, never a part, and a crash keeps one of them: synced before the rename) and a JSON-lines file appended
one record a line (a record is on disk once its line is, and a line is a record once its newline is
written: a last line without one is torn, left out by readers and cut by the next writer)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)


def fsync(path: Path) -> None:
    """Flush `path` (a file or a directory: a rename in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A path beside `path` for a writer to fill (`torch.save`, `savefig`, safetensors); once the block
    ends it is synced and renamed to `path`. A block that fails (a full disk) leaves `path` as it was and
    no partial file. The staging name holds the process id: writers in several processes may race, the
    last rename wins."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        yield staging
        fsync(staging)
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    fsync(path.parent)


def write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Replace `path` with `data`, whole or not at all."""
    with replacing(path) as staging:
        staging.write_bytes(data)


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text`, whole or not at all."""
    write_bytes(path, text.encode())


def write_json(path: Path, content: Any, indent: int | None = 1) -> None:
    """Replace `path` with `content` as JSON, whole or not at all."""
    write_text(path, json.dumps(content, indent=indent) + "\n")


def read_json_lines(path: Path, start: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records of the whole lines of `path` from byte `start`, and the byte after the last of them
    (where the next read starts: a torn last line is read once it is whole). A whole line that is not
    one JSON object in UTF-8 (bytes a disk or an editor damaged) is left out with a warning naming it."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    whole = data[: data.rfind(b"\n") + 1]
    records, damaged = [], []
    for number, line in enumerate(whole.splitlines(), 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is one
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            damaged.append(number)
    if damaged:
        log.warning(
            "%s: line(s) %s%s are not JSON records (damaged bytes): left out of what is read from it.",
            path, "" if start == 0 else f"after byte {start}: ",
            ", ".join(map(str, damaged[:10])) + (" ..." if len(damaged) > 10 else ""),
        )  # fmt: skip
    return records, start + len(whole)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (`read_json_lines` from its start)."""
    return read_json_lines(path)[0]


def cut_torn_line(path: Path) -> None:
    """Cut what follows the last newline of `path` (a line a killed writer left unfinished, a zero-filled
    tail), so that what is appended next starts a line of its own."""
    if not path.is_file():
        return
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            step = min(position, 1 << 16)
            f.seek(position - step)
            newline = f.read(step).rfind(b"\n")
            if newline >= 0:
                position -= step - newline - 1
                break
            position -= step
        if position < end:
            f.truncate(position)


class JsonLines:
    """Appends records to a JSON-lines file, one line each, on disk once written (a killed process keeps
    them); a torn last line is cut before the first. With `keep_open`, through one handle opened at the
    first record and kept until `close` (an open per line costs a frequent writer 10 us)."""

    def __init__(self, path: Path, keep_open: bool = False) -> None:
        self.path = Path(path)
        self.keep_open = keep_open
        self._started = False
        self._file: IO[str] | None = None

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        if not self._started:
            cut_torn_line(self.path)
            self._started = True
        if not self.keep_open:
            with open(self.path, "a") as f:
                f.write(line)
            return
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115  # kept open until `close`
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
