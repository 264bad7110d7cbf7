"""What the console says of a run's figures (`trainer.console`): quiet, it leaves out what repeats
itself, a memory figure equal to another and the goodput table of a run with nothing to learn from it;
full, everything. The history, the trackers and `goodput.json` keep every figure either way."""

from __future__ import annotations

from typing import Any

from runner.telemetry.goodput import table

# The goodput table on a quiet console: where goodput is below this, in a run of at least `LONG_RUN_S`
# (a shorter run is mostly its start, which the one line says).
LOW_GOODPUT = 0.5
LONG_RUN_S = 60.0
# (figure, the figure it repeats where the two are equal): on a CPU device, whose memory is the host's.
REPEATS = (("perf/peak_memory_gb", "perf/peak_host_memory_gb"),)


def shown(metrics: dict[str, float], full: bool) -> dict[str, float]:
    """`metrics` as the console shows them: all (`full`), else without a figure equal to the one it repeats."""
    if full:
        return metrics
    left_out = {name for name, of in REPEATS if name in metrics and metrics[name] == metrics.get(of)}
    return {name: value for name, value in metrics.items() if name not in left_out}


def metrics_line(metrics: dict[str, float], full: bool) -> str:
    """The metrics on one line (`train/loss=0.4729  train/lr=0.001 ...`)."""
    return "  ".join(f"{name}={value:.4g}" for name, value in shown(metrics, full).items())


def metrics_table(metrics: dict[str, float], full: bool) -> str:
    """The metrics a line each, their names aligned."""
    metrics = shown(metrics, full)
    width = max(map(len, metrics), default=0)
    return "\n".join(f"  {name:<{width}}  {value:.6g}" for name, value in metrics.items())


def goodput_said(summary: dict[str, Any], full: bool) -> str:
    """The goodput ledger's summary as the console says it: its table (`full`, or goodput low in a long
    run), else its headline, with where the table is, and the stragglers it names."""
    whole = table(summary)
    if full or (summary["goodput"] < LOW_GOODPUT and summary["wall_s"] >= LONG_RUN_S):
        return whole
    headline, *lines = whole.split("\n")
    stragglers = [line for line in lines if line.startswith("  stragglers:")]
    return "\n".join([f"{headline} (each phase: trainer.console=full)", *stragglers])
