"""What a run dir says of its run, read from its files and its lock (taking none): its state, how far it
got, its final (or latest) metrics, its goodput, when it started and the overrides it ran with.

The states: `running` (a live process holds the dir's lock), `finished` (it ran to its end), `stopped` (a
stop asked by a person: Ctrl-C, SIGINT), `preempted` (stopped by a scheduler's signal: SIGTERM, SIGUSR1,
SIGUSR2), `failed`, `died` (it ended without a word: kill -9, out of memory, a lost node), `ended` (a job
that trains nothing ended: `mode=evaluate`, inference, a job queued elsewhere) and `unstarted` (no job
started: its config was refused, or `plan=true`; the dir holds its log only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runner.errors import EXIT_INTERRUPTED
from runner.run_dir import ENDED, FAILED, JOB_CONFIG_DIR, LOG_FILE, REPLACED, RESOLVED, finished_run
from runner.run_dir.lock import in_use
from runner.telemetry.goodput import read_ledger, summarize
from runner.telemetry.history import read_history

STATES = ("running", "finished", "stopped", "preempted", "failed", "died", "ended", "unstarted")
PREEMPTION = ("SIGTERM", "SIGUSR1", "SIGUSR2")  # what schedulers send (SLURM, Kubernetes, Ray)


@dataclass(frozen=True)
class RunInfo:
    """One run dir's run, as its files tell it."""

    run_dir: Path
    state: str
    step: int | None = None  # the last step it logged
    max_steps: int | None = None  # trainer.max_steps (None: by epochs)
    objective: str | None = None  # trainer.objective
    metrics: dict[str, float | None] = field(default_factory=dict)  # final, else the latest logged
    goodput: float | None = None  # train time / wall time so far
    started: float | None = None  # when its job began (the goodput ledger's first record)
    overrides: list[str] = field(default_factory=list)  # its command line's, as Hydra recorded them


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a run's dir (a run writes its log there first), not one moved aside in it."""
    return (path / LOG_FILE).is_file() and not path.name.startswith(REPLACED)


def find_runs(root: Path) -> list[Path]:
    """The run dirs at or below `root` (single runs, a sweep's jobs), without those moved aside."""
    if is_run_dir(root):
        return [root]
    return sorted(
        log.parent
        for log in root.rglob(LOG_FILE)
        if is_run_dir(log.parent) and not any(part.startswith(REPLACED) for part in log.relative_to(root).parts)
    )


def read_run(run_dir: Path) -> RunInfo:
    """What `run_dir` says of its run (`RunInfo`)."""
    config = run_config(run_dir)
    trainer = config.get("trainer") or {}
    history = read_history(run_dir)
    finished = finished_run(run_dir)
    metrics: dict[str, float | None] = {}
    for row in history:
        metrics |= {key: value for key, value in row.items() if key != "step"}
    if finished is not None:
        metrics |= finished.metrics
    ledger = read_ledger(run_dir)
    overrides = run_dir / JOB_CONFIG_DIR / "overrides.yaml"
    return RunInfo(
        run_dir=run_dir,
        state=run_state(run_dir),
        step=int(history[-1]["step"]) if history else (finished.step if finished else None),
        max_steps=trainer.get("max_steps"),
        objective=trainer.get("objective"),
        metrics=metrics,
        goodput=summarize(ledger)["goodput"] if ledger else None,
        started=min(record["t0"] for record in ledger) if ledger else None,
        overrides=[str(o) for o in yaml.safe_load(overrides.read_text()) or []] if overrides.is_file() else [],
    )


def run_state(run_dir: Path) -> str:
    """One of `STATES`."""
    if in_use(run_dir):
        return "running"
    if finished_run(run_dir) is not None:
        return "finished"
    if (run_dir / FAILED).is_file():
        return "failed"
    if not (run_dir / JOB_CONFIG_DIR).is_dir():
        return "unstarted"
    ended = _json(run_dir / ENDED)
    if ended is None:
        return "died"
    status, signal = ended["status"], ended.get("signal")
    if status == 0:
        return "ended"
    if status == EXIT_INTERRUPTED or signal is not None:
        return "preempted" if signal in PREEMPTION else "stopped"
    return "failed"


def run_config(run_dir: Path) -> dict[str, Any]:
    """The settings the run ran with (its resolved config, else the job's composed one), or {}."""
    for path in (run_dir / RESOLVED, run_dir / JOB_CONFIG_DIR / "config.yaml"):
        try:
            return yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
    return {}


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None

