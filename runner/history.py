"""A run's metric history: `<run dir>/history.jsonl`, one line per logged set of metrics with its step,
whatever the tracker (also `tracker=none`). Each line is written through to the file at once (a killed
run keeps what it logged); a run resumed from a checkpoint first drops the lines past its step, which it
logs again. What `runner.plots` draws."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

HISTORY = "history.jsonl"


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file the run appends to (its history, its goodput ledger): a line that
    is not one JSON object in UTF-8 is left out, silently where it is the last (a line a kill cut, a
    zero-filled tail), with a warning naming the lines elsewhere (bytes a disk or an editor damaged)."""
    records, damaged = [], []
    lines = Path(path).read_bytes().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is one
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number < len(lines):
            damaged.append(number)
    if damaged:
        log.warning(
            "%s: line(s) %s are not JSON records (damaged bytes): left out of what is read from it.",
            path, ", ".join(map(str, damaged[:10])) + (" ..." if len(damaged) > 10 else ""),
        )  # fmt: skip
    return records


class History:
    """Appends to `<directory>/history.jsonl` (the main process's; others hold None and write nothing),
    through one handle opened at the first line (an open per line cost a log step 10 us) until `close`."""

    def __init__(self, directory: Path | None) -> None:
        self.path = None if directory is None else Path(directory) / HISTORY
        self._file: IO[str] | None = None

    def resume_at(self, step: int) -> None:
        """Keep the lines of steps up to `step` (a resumed run logs the later ones again)."""
        self.close()
        if self.path is None or not self.path.is_file():
            return
        kept = [row for row in read_history(self.path.parent) if row["step"] <= step]
        partial = self.path.with_name(f".{HISTORY}.partial")
        partial.write_text("".join(_line(row) for row in kept))
        partial.replace(self.path)

    def add(self, step: int, values: dict[str, float]) -> None:
        if self.path is None:
            return
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115  # kept open until `close`
        self._file.write(_line({"step": step, **values}))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _line(row: dict[str, Any]) -> str:
    """A row as one JSON line; NaN and infinities (JSON has neither) as their names."""
    return json.dumps({k: v if not isinstance(v, float) or math.isfinite(v) else str(v) for k, v in row.items()}) + "\n"


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run dir's history (whole lines only: a last line cut by a kill is left out), values as
    floats again."""
    path = Path(run_dir) / HISTORY
    if not path.is_file():
        return []
    return [{k: float(v) if isinstance(v, str) else v for k, v in row.items()} for row in json_lines(path)]
