"""A run's tracking records on local disk, written before any is sent: nothing is lost when the server
is not there, and what was not delivered can be sent later (`python -m runner.trackers.upload`)."""

from __future__ import annotations

import fcntl
import json
import threading
from pathlib import Path
from typing import IO, Any

from runner.files import JsonLines, read_json_lines, write_json

EVENTS, DELIVERED, SENDER_LOCK = "events.jsonl", "delivered.json", "sender.lock"


class Journal:
    """Append-only events (`<directory>/events.jsonl`) and how many of them reached the tracking server
    under which run id (`delivered.json`). One process writes events (its first cuts a line a killed
    writer left torn); one sender at a time (holding `lock_for_sending`) reads them and marks what it
    delivered; both may run at once."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.events: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {"run_id": None, "delivered": 0}
        self._read = 0  # bytes of EVENTS already in `events`
        self._lines = JsonLines(self.directory / EVENTS)
        self._lock = threading.Lock()
        self.refresh()

    def refresh(self) -> Journal:
        """Read the events appended since the last read, whole lines only (a line still being written is
        read next time), and the delivery state."""
        path = self.directory / EVENTS
        if path.exists():
            events, self._read = read_json_lines(path, self._read)
            self.events += events
        state = self.directory / DELIVERED
        if state.exists():
            self.state = json.loads(state.read_text())
        return self

    def append(self, event: dict[str, Any]) -> None:
        """Write `event` as one line of the file (it survives this process being killed)."""
        with self._lock:
            self._lines.append(event)

    @property
    def pending(self) -> int:
        """Events read and not yet delivered."""
        return len(self.events) - self.state["delivered"]

    def mark_delivered(self, delivered: int, run_id: str | None) -> None:
        """The first `delivered` events reached the server, for run `run_id`."""
        self.state.pop("error", None)
        self._save(run_id=run_id, delivered=delivered)

    def mark_failed(self, error: str) -> None:
        """Sending failed with `error`; the next success clears it."""
        self._save(error=error)

    def mark_closed(self) -> None:
        """The sender stopped following the journal after the events read so far (all sent, or given up)."""
        self._save(closed=len(self.events))

    def _save(self, **changes: Any) -> None:
        self.state = {**self.state, **changes}
        write_json(self.directory / DELIVERED, self.state, indent=None)

    def lock_for_sending(self) -> IO | None:
        """The journal's sender lock, taken (closing the file releases it, as the holder's death does), or
        None when another process holds it."""
        lock = open(self.directory / SENDER_LOCK, "a")  # noqa: SIM115 (the caller closes it)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        return lock
