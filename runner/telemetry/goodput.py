"""The goodput ledger: where a run's wall time went, by phase, from the command that launched it to its end,
across every restart, requeue and re-run in the same dir.

The command and the main rank of each attempt append intervals to `<run dir>/goodput.jsonl` as they end
(one line each, on disk once written: a killed process leaves what it recorded, and the next attempt
continues the file). A time no record covers (the queue, an elastic restart, a run that was not running)
belongs to the phase the record after it names in `before`. Steps trained after the checkpoint a later
attempt resumed from become `lost`. `summarize` adds it all up; `goodput.json` and the console's table are
its result. Goodput is productive step time over wall time (docs/checkpoints.md compares it with Google's).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from runner.files import JsonLines, json_lines, write_json
from runner.run_dir import GOODPUT, LEDGER

FLUSH_S = 5.0  # training steps are written together, at least this often (and at every other phase)

# Each phase, what its time is, in the order of the table.
PHASES = {
    "train": "productive training steps (goodput)",
    "queued": "waiting for the scheduler (a SLURM job pending, requeued)",
    "stopped": "no process ran (between a command that ended and the next in the dir)",
    "startup": "process start, imports, the checks before launch",
    "restart": "a failed attempt's end until the restarted ranks began",
    "rendezvous": "process group and device set-up",
    "data": "building the data and its loaders",
    "setup": "building and preparing the model, opening the tracker's run",
    "restore": "loading the checkpoint the run continues from",
    "warmup": "each attempt's first step (compilation, allocator, autotuning)",
    "data_wait": "steps waiting for their batches",
    "skipped": "optimizer steps left out, their gradients not finite (on_nonfinite=skip, fp16's scaler)",
    "checkpoint": "checkpoint saves (the blocking part)",
    "eval": "evaluation",
    "lost": "steps trained after the last checkpoint, discarded by a failure or a spike's rollback",
    "finish": "saving the model, closing trackers, exit",
    "other": "time no record accounts for",
}
# The phases that belong to optimizer steps: those past the checkpoint a later attempt resumed from are lost.
STEP_WORK = ("warmup", "train", "skipped", "checkpoint", "eval")

T = TypeVar("T")


class FetchClock:
    """The seconds spent waiting for the batches of the loaders it times (`timed`), since the last `take`."""

    def __init__(self) -> None:
        self.waited = 0.0

    def timed(self, loader: Iterable[T]) -> Iterator[T]:
        """`loader`'s batches, the time each took to arrive added to `waited`."""
        batches = iter(loader)
        while True:
            began = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.waited += time.perf_counter() - began
            yield batch

    def take(self) -> float:
        """The seconds waited since the last call."""
        waited, self.waited = self.waited, 0.0
        return waited


class Ledger:
    """Appends one process's phases to `<run_dir>/goodput.jsonl` (None: records nothing, the other ranks).

    A phase is the time since the previous one ended (`lap`), from `began`; the first record says what the
    time before it was (`before`). Training steps (`step_done`) are coalesced into one record per `FLUSH_S`
    and written before any other phase, with the time they waited for batches (`batches`).
    """

    def __init__(self, run_dir: Path | None, began: float, before: str) -> None:
        self.path = None if run_dir is None else Path(run_dir) / LEDGER
        self._lines = None if self.path is None else JsonLines(self.path)
        self.mark = began
        self.before: str | None = before
        self.fetches = FetchClock()  # the time the steps since the last record waited for batches
        self._steps: dict[str, Any] | None = None  # the training steps not yet written

    @property
    def recording(self) -> bool:
        return self.path is not None

    def lap(self, phase: str, until: float | None = None, **facts: Any) -> None:
        """The time since the last phase ended (until `until`, else now) was `phase`; `facts` go with it."""
        if self.path is None:
            return
        self.flush()
        now = time.time() if until is None else until
        self._write({"phase": phase, "t0": self.mark, "t1": now, **facts})
        self.mark = now

    def note(self, event: str, **facts: Any) -> None:
        """An event that takes no time of its own (`straggler`: a window of steps a rank slowed), recorded
        where the ledger's time stands."""
        if self.path is not None:
            self._write({"phase": event, "t0": self.mark, "t1": self.mark, **facts})

    def step_done(self, step: int, first: bool = False, skipped: bool = False) -> None:
        """Optimizer step `step` ended; `first`: the attempt's first (its warm-up); `skipped`: it was left
        out (its time is not productive)."""
        if self.path is None:
            return
        if first or skipped:
            self.lap("warmup" if first else "skipped", step=step, waited=self._take_waited())
            return
        now = time.time()
        steps = self._steps
        if steps is None:
            steps = self._steps = {"phase": "train", "t0": self.mark, "first": step}
        steps["t1"], steps["step"] = now, step
        self.mark = now
        if now - steps["t0"] >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        """Write the training steps not yet written."""
        if self._steps is not None:
            steps, self._steps = self._steps, None
            self._write({**steps, "waited": self._take_waited()})

    @property
    def waited(self) -> float:
        """Seconds the steps not yet written waited for their batches."""
        return self.fetches.waited

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """`loader`'s batches, the time spent waiting for each added to the steps' data wait."""
        return self.fetches.timed(loader)

    def _take_waited(self) -> float:
        return round(self.fetches.take(), 6)

    def _write(self, record: dict[str, Any]) -> None:
        if self.before is not None:
            record["before"], self.before = self.before, None
        assert self._lines is not None
        self._lines.append({k: round(v, 6) if isinstance(v, float) else v for k, v in record.items()})


def end_of_command(run_dir: Path) -> dict[str, Any] | None:
    """The launching command ends: the time since the last record is `finish`; the ledger summed into
    `goodput.json`. The summary, None where the run recorded nothing."""
    path = Path(run_dir) / LEDGER
    if not path.is_file():
        return None
    global _job_ended
    now = _job_ended = time.time()
    JsonLines(path).append({"phase": "finish", "t0": now, "t1": now, "before": "finish"})
    return write_summary(run_dir)


def write_summary(run_dir: Path) -> dict[str, Any]:
    """`goodput.json` in `run_dir`: the ledger summed (`summarize`); returned."""
    summary = summarize(read_ledger(run_dir))
    write_json(Path(run_dir) / GOODPUT, summary)
    return summary


def read_ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger's records (whole lines only: a line cut by a kill or damaged is left out: `json_lines`)."""
    path = Path(run_dir) / LEDGER
    if not path.is_file():
        return []
    return json_lines(path)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per phase over the records' span (they add up to it: overlaps count once, a gap goes to the
    `before` of the record after it, else `other`); step work past the step a later attempt resumed from
    is `lost`. `goodput`: train / wall."""
    records = sorted(records, key=lambda r: r["t0"])
    seconds = [0.0] * len(records)
    phases = dict.fromkeys(PHASES, 0.0)
    cursor = records[0]["t0"] if records else 0.0
    for i, record in enumerate(records):
        if record["t0"] > cursor:
            gap = record.get("before", "other")
            phases[gap if gap in phases else "other"] += record["t0"] - cursor
        seconds[i] = max(0.0, record["t1"] - max(record["t0"], cursor))
        cursor = max(cursor, record["t1"])
    lost_steps = 0
    resumed_later = float("inf")  # the lowest step an attempt after the record resumed from
    for i in reversed(range(len(records))):
        record = records[i]
        step = record.get("step")
        if record["phase"] in STEP_WORK and step is not None and step > resumed_later:
            phases["lost"] += seconds[i]
            if record["phase"] in ("warmup", "train", "skipped"):
                lost_steps += step - max(record.get("first", step), int(resumed_later) + 1) + 1
        else:
            waited = min(record.get("waited", 0.0), seconds[i])
            phases["data_wait"] += waited
            phases[record["phase"] if record["phase"] in phases else "other"] += seconds[i] - waited
        if "resumed_at" in record:
            resumed_later = min(resumed_later, record["resumed_at"])
    wall = cursor - records[0]["t0"] if records else 0.0
    return {
        "goodput": phases["train"] / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "phases_s": {name: value for name, value in phases.items() if value > 0},
        "attempts": sum(1 for r in records if "resumed_at" in r and "rolled_back_from" not in r),
        "rollbacks": sum(1 for r in records if "rolled_back_from" in r),
        "restarts": sum(1 for r in records if r.get("before") == "restart"),
        "resizes": resizes(records),
        "lost_steps": lost_steps,
        **stragglers(records),
    }


def resizes(records: list[dict[str, Any]]) -> int:
    """How many attempts ran on another number of ranks than the attempt before (an elastic job that lost
    or took in a node), from the ranks each attempt met with (its `rendezvous` record's `world_size`)."""
    sizes = [r["world_size"] for r in records if r["phase"] == "rendezvous" and "world_size" in r]
    return sum(1 for before, after in itertools.pairwise(sizes) if after != before)


def stragglers(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The log windows a straggler slowed (`RankMetrics`): how many, the ranks, and the time every rank
    waited for them (the straggler's excess data wait); nothing when there was none."""
    slowed = [r for r in records if r["phase"] == "straggler"]
    if not slowed:
        return {}
    return {
        "straggler_windows": len(slowed),
        "straggler_ranks": sorted({r["rank"] for r in slowed}),
        "straggler_s": sum(r["slowed_s"] for r in slowed),
    }


def table(summary: dict[str, Any]) -> str:
    """The summary as the console shows it: a headline, then a line per phase with time."""
    wall = summary["wall_s"]
    counts = [f"{summary['attempts']} attempt(s)"] if summary["attempts"] > 1 else []
    if summary["restarts"]:
        counts.append(f"{summary['restarts']} restart(s)")
    if summary["rollbacks"]:
        counts.append(f"{summary['rollbacks']} rollback(s)")
    if summary.get("resizes"):
        counts.append(f"{summary['resizes']} resize(s)")
    if summary["attempts"] > 1 or summary["lost_steps"] or summary["rollbacks"]:
        counts.append(f"{summary['lost_steps']} step(s) lost")
    lines = [f"goodput {summary['goodput']:.1%} of {wall:.1f} s{''.join(', ' + c for c in counts)}"]
    for name, value in summary["phases_s"].items():
        lines.append(f"  {name:<10} {value:9.2f} s  {value / wall if wall else 0:6.1%}  {PHASES[name]}")
    if "straggler_windows" in summary:
        ranks = ", ".join(str(rank) for rank in summary["straggler_ranks"])
        lines.append(
            f"  stragglers: rank {ranks} in {summary['straggler_windows']} log window(s); every rank waited "
            f"{summary['straggler_s']:.2f} s for them (within train and data_wait)"
        )
    return "\n".join(lines)


def tracked(summary: dict[str, Any]) -> dict[str, float]:
    """The summary as the trackers' `goodput/*` metrics."""
    return {
        "goodput/goodput": summary["goodput"],
        "goodput/wall_s": summary["wall_s"],
        "goodput/restarts": float(summary["restarts"]),
        "goodput/rollbacks": float(summary["rollbacks"]),
        "goodput/resizes": float(summary.get("resizes", 0)),
        "goodput/lost_steps": float(summary["lost_steps"]),
        **{f"goodput/{name}_s": value for name, value in summary["phases_s"].items()},
        **({"goodput/straggler_s": summary["straggler_s"]} if "straggler_s" in summary else {}),
    }


def job_began() -> float:
    """When this process's job began: when the process started, or, after a job of its own (a sweep's jobs
    run one after another in one process), when that one ended (a rank forked since started later)."""
    return max(_job_ended or 0.0, process_start_time())


_job_ended: float | None = None  # when the last job this process ran ended (`end_of_command`)


def process_start_time() -> float:
    """When this process started (wall clock, to 10 ms), from its start time since boot on Linux;
    elsewhere, when this module was imported. The same value at every call in a process (the command's
    records and its in-process rank's start together), and a forked child's own."""
    pid = os.getpid()
    if pid not in _started:
        _started[pid] = _read_start_time()
    return _started[pid]


_started: dict[int, float] = {}  # pid -> its start: a forked child inherits the parent's entry, not its own


def _read_start_time() -> float:
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, starttime, after the command name
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since
    except (OSError, ValueError, IndexError, AttributeError):
        return IMPORTED


IMPORTED = time.time()
