"""A run's directory, the one owner of what is in it: the name of every file and directory a run writes
there (the module that writes it named beside it), where runs go by default, the override that runs a
command again in one, and the record of a run that ran to its end (`record_finished`, `finished_run`),
which a later run in the dir is checked against (`runner.checkpoint.resume.check_finished_run`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runner.errors import EXIT_REFUSED
from runner.files import write_text

RUNS_DIR = "outputs/runs"  # where runs go by default (hydra.run.dir in conf/config.yaml)
JOB_CONFIG_DIR = ".hydra"  # Hydra's files of the job (config, hydra and overrides .yaml; the command's)
RESOLVED = "resolved_config.yaml"  # the settings it ran with (the Trainer, once everything is built)
LOG_FILE = "runner.log"  # every rank's log (runner.run_dir.log)
CHECKPOINTS = "checkpoints"  # the numbered checkpoints and `latest` (runner.checkpoint)
LAST_FINITE = "last_finite"  # in checkpoints/: trainer.checkpoint_last_finite's state
CANDIDATE = ".last_finite.candidate"  # in checkpoints/: the newest state, until the next window shows it finite
MODEL = "model"  # the final weights (trainer.save_model)
FINISHED = "metrics.json"  # the final metrics: the run finished
FINISHED_RECORD = "finished.json"  # a training run ran to its end: its step, settings digest, metrics
HISTORY = "history.jsonl"  # each logged set of metrics with its step (runner.telemetry.history)
LEDGER = "goodput.jsonl"  # the goodput ledger's intervals, appended (runner.telemetry.goodput)
GOODPUT = "goodput.json"  # their sum (runner.telemetry.goodput.summarize)
SPIKES = "spikes.jsonl"  # each loss or gradient-norm spike and what was done (the `spikes` callback)
HANG_DIR = "hang"  # one report per rank that hung (runner.callbacks.watchdog)
PLOTS = "plots"  # the curves drawn from the history (runner.telemetry.plots, the `plots` callback)
PROFILE = "profile"  # each rank's trace and table (the `profile` callback)
BEST = "best"  # the best checkpoints and best.json (the `best_checkpoints` callback)
BEST_RECORD = "best.json"  # in best/: them, best first
TRACKING = "tracking"  # the trackers' journal of records, written before any is sent (runner.trackers)
FAILED = "failed.json"  # a sweep job's: why its training failed (runner.cli)
ENDED = "ended.json"  # how the command's job in the dir ended: its exit status and signal (`record_ending`)
SWEEP_SUMMARY = "summary.csv"  # a sweep's dir: its jobs' settings, ranks and metrics (runner.sweep)
RESULTS = (FINISHED, f"{MODEL}/", FINISHED_RECORD)  # what a finished run trained on in its dir moves aside
REPLACED = "replaced-"  # + a time: a dir of a finished run's files moved aside (`move_aside`)
# Settings that change neither the trained weights nor the final metrics: a finished run re-run with
# other values of these only is not another run.
NOT_RESULTS = (
    "tracker",
    "launcher",
    "plan",
    "sweep",
    "trainer.resume",
    "trainer.overwrite",
    "trainer.progress_bar",
    "trainer.plots",
    "trainer.checkpoint_every",
    "trainer.checkpoint_every_s",
    "trainer.keep_checkpoints",
    "trainer.async_checkpoint",
)


def resume_override(output_dir: Path) -> str:
    """The override that runs a command again in `output_dir` (relative to the working dir when inside
    it), which resumes a stopped run there: what its user is told to add. For a sweep's job, the sweep's
    dir: the sweep's command resumes the job in its sweep (its summary gets it)."""
    key, directory = "hydra.run.dir", Path(output_dir)
    if (sweep := sweep_of(directory)) is not None:
        key, directory = "hydra.sweep.dir", sweep
    shown = os.path.relpath(directory) if directory.resolve().is_relative_to(Path.cwd()) else directory
    return f"{key}={shlex.quote(str(shown))}"


def sweep_of(output_dir: Path) -> Path | None:
    """The sweep dir of the job in `output_dir` (its parent), from the job's `.hydra/hydra.yaml`, which the
    command writes before it launches the ranks; None for a single run or without that file."""
    written = output_dir / JOB_CONFIG_DIR / "hydra.yaml"
    try:
        mode = ((yaml.safe_load(written.read_text()) or {}).get("hydra") or {}).get("mode")
    except (OSError, yaml.YAMLError):
        return None
    return output_dir.parent if str(mode) in ("MULTIRUN", "RunMode.MULTIRUN") else None


def last_written(run_dir: Path) -> tuple[float, str] | None:
    """When the run in `run_dir` last wrote, and what: the later of its log's last line and its newest
    checkpoint's completion (`meta.json` is written last); None for a dir with neither."""
    records = [(run_dir / LOG_FILE, "its log"), *((meta, "its newest checkpoint") for meta in
               run_dir.glob(f"{CHECKPOINTS}/checkpoint_*/meta.json"))]  # fmt: skip
    times = [(path.stat().st_mtime, what) for path, what in records if path.is_file()]
    return max(times, default=None)


@dataclass(frozen=True)
class FinishedRun:
    """A training run that ran to its end in `output_dir`: its last step (None where an earlier version
    wrote only `metrics.json`), its final metrics, and its checkpoint of that step (None: it has none,
    so its latest, if any, is older than its end)."""

    output_dir: Path
    step: int | None
    metrics: dict[str, float | None]
    final_checkpoint: Path | None = None

    def describe(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{self.output_dir} holds a run that finished{at} ({FINISHED}, model/)"


def settings_digest(settings: dict[str, Any]) -> str:
    """SHA-256 of the settings that make a run's results (NOT_RESULTS left out), key order aside."""
    return hashlib.sha256(json.dumps(flat_settings(settings), sort_keys=True, default=str).encode()).hexdigest()


def finite_metrics(metrics: dict[str, float]) -> dict[str, float | None]:
    """`metrics` as JSON can hold them: NaN and infinities (JSON has neither) as null."""
    return {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in metrics.items()}


def record_finished(
    output_dir: Path,
    step: int,
    settings: dict[str, Any],
    metrics: dict[str, float],
    final_checkpoint: Path | None,
) -> None:
    """Record, once the final results are written, that the training run in `output_dir` ran to `step`
    with `settings` (the resolved config), and its checkpoint of that step if it wrote one: a later run
    in the dir reads it in `check_finished_run`."""
    record = {
        "step": step,
        "settings_digest": settings_digest(settings),
        "final_checkpoint": str(final_checkpoint.relative_to(output_dir)) if final_checkpoint else None,
        "metrics": finite_metrics(metrics),
    }
    write_text(output_dir / FINISHED_RECORD, json.dumps(record, indent=2, allow_nan=False))


def finished_run(output_dir: Path) -> FinishedRun | None:
    """The finished training run in `output_dir` (its `finished.json`, or from earlier versions its
    `metrics.json` next to its resolved config), or None."""
    record = output_dir / FINISHED_RECORD
    if record.is_file():
        written = json.loads(record.read_text())
        final = written["final_checkpoint"]
        return FinishedRun(output_dir, written["step"], written["metrics"], final and output_dir / final)
    if (output_dir / FINISHED).is_file() and (output_dir / RESOLVED).is_file():
        return FinishedRun(output_dir, None, json.loads((output_dir / FINISHED).read_text()))
    return None


def record_ending(output_dir: Path, status: int, signum: int | None = None) -> None:
    """Record that the job in `output_dir` ended with exit `status` (0: its end; a stop signal's
    `signum`, where one stopped it), for `runner.run_dir.state`; not a refusal (exit 2: the dir's run, if
    any, stays as it was) nor in a dir where no job started (it holds nothing but its log)."""
    if status != EXIT_REFUSED and (output_dir / JOB_CONFIG_DIR).is_dir():
        name = None if signum is None else signal.Signals(signum).name
        with suppress(OSError):  # a full or read-only disk: the ending the command reports stays its own
            write_text(output_dir / ENDED, json.dumps({"status": status, "signal": name, "time": time.time()}))


@contextmanager
def ending_recorded(output_dir: Path, err: BaseException) -> Iterator[None]:
    """Inside: the job in `output_dir` ends because of `err` (its exit, or the exception a sweep's job
    ends with); that ending recorded (`record_ending`), with the stop signal `err` carries."""
    signum = getattr(err, "signum", None) or (signal.SIGINT if isinstance(err, KeyboardInterrupt) else None)
    try:
        yield
    except SystemExit as exit:
        record_ending(output_dir, exit.code if isinstance(exit.code, int) else 1, signum)
        raise
    except Exception:
        record_ending(output_dir, 1, signum)
        raise


def move_aside(output_dir: Path, names: tuple[str, ...] | None = None) -> Path:
    """Move `names` of `output_dir` (None: everything but its log and earlier such dirs) into a new
    `replaced-<time>/` there (`_1`, `_2` added within a second), copying its resolved config too; that dir."""
    stamp = time.strftime(f"{REPLACED}%Y%m%d-%H%M%S")
    aside, n = output_dir / stamp, 0
    while aside.exists():
        n += 1
        aside = output_dir / f"{stamp}_{n}"
    aside.mkdir()
    if names is None:
        entries = [e for e in output_dir.iterdir() if e.name != LOG_FILE and not e.name.startswith(REPLACED)]
    else:
        entries = [
            output_dir / name.rstrip("/") for name in names if (output_dir / name.rstrip("/")).exists()
        ]
        if (output_dir / RESOLVED).is_file():
            shutil.copy2(output_dir / RESOLVED, aside / RESOLVED)
    for entry in entries:
        entry.rename(aside / entry.name)
    return aside


def flat_settings(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys, the settings in NOT_RESULTS left out."""
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if name not in NOT_RESULTS:
            flat |= flat_settings(value, name) if isinstance(value, dict) and value else {name: value}
    return flat
