"""A run's tracking records on local disk, written before any is sent: nothing is lost when the server
is not there, and what was not delivered can be sent later (`python -m runner.trackers.upload`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

EVENTS, DELIVERED = "events.jsonl", "delivered.json"


class Journal:
    """Append-only events (`<directory>/events.jsonl`) and how many of them reached the tracking server
    under which run id (`delivered.json`). One writer appends; one deliverer marks."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / EVENTS
        self.events: list[dict[str, Any]] = _read_events(path) if path.exists() else []
        state = self.directory / DELIVERED
        self.state: dict[str, Any] = (
            json.loads(state.read_text()) if state.exists() else {"run_id": None, "delivered": 0}
        )
        self._lock = threading.Lock()

    def append(self, event: dict[str, Any]) -> int:
        """Write `event` to the file (it survives this process being killed) and return its index."""
        with self._lock:
            with open(self.directory / EVENTS, "a") as f:
                f.write(json.dumps(event) + "\n")
            self.events.append(event)
            return len(self.events) - 1

    @property
    def pending(self) -> int:
        return len(self.events) - self.state["delivered"]

    def mark_delivered(self, delivered: int, run_id: str | None) -> None:
        self.state = {"run_id": run_id, "delivered": delivered}
        staged = self.directory / f".{DELIVERED}.tmp"
        staged.write_text(json.dumps(self.state))
        staged.replace(self.directory / DELIVERED)


def _read_events(path: Path) -> list[dict[str, Any]]:
    """The events of a journal; a last line cut short (its writer was killed mid-write) is dropped, and
    the file rewritten without it so that appending goes on cleanly."""
    lines = path.read_text().splitlines()
    try:
        return [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        events = [json.loads(line) for line in lines[:-1]]
        path.write_text("".join(json.dumps(event) + "\n" for event in events))
        return events
