"""A run's metric history: `<run dir>/history.jsonl`, one line per logged set of metrics with its step,
whatever the tracker (also `tracker=none`). Each line is written through to the file at once (a killed
run keeps what it logged); a run resumed from a checkpoint first drops the lines past its step, which it
logs again. What `runner.telemetry.plots` draws."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from runner.files import JsonLines, json_lines, write_text
from runner.run_dir import HISTORY


class History:
    """Appends to `<directory>/history.jsonl` (the main process's; others hold None and write nothing),
    through one handle opened at the first line until `close`."""

    def __init__(self, directory: Path | None) -> None:
        self.path = None if directory is None else Path(directory) / HISTORY
        self._lines = None if self.path is None else JsonLines(self.path, keep_open=True)

    def resume_at(self, step: int) -> None:
        """Keep the lines of steps up to `step` (a resumed run logs the later ones again)."""
        self.close()
        if self.path is None or not self.path.is_file():
            return
        kept = [row for row in read_history(self.path.parent) if row["step"] <= step]
        write_text(self.path, "".join(json.dumps(_named(row)) + "\n" for row in kept))

    def add(self, step: int, values: dict[str, float]) -> None:
        if self._lines is not None:
            self._lines.append(_named({"step": step, **values}))

    def close(self) -> None:
        if self._lines is not None:
            self._lines.close()


def _named(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with NaN and infinities (JSON has neither) as their names."""
    return {k: v if not isinstance(v, float) or math.isfinite(v) else str(v) for k, v in row.items()}


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of a run dir's history (whole lines only: a last line cut by a kill is left out), values as
    floats again."""
    path = Path(run_dir) / HISTORY
    if not path.is_file():
        return []
    return [{k: float(v) if isinstance(v, str) else v for k, v in row.items()} for row in json_lines(path)]
