"""Pictures of a run: its curves drawn from its history (`runner.history`) into `<run dir>/plots/`: the
losses, the other eval metrics, the learning rates and the throughput, one PNG each. A run starts
`python -m runner.plots <run dir>` in a process of its own at each evaluation and waits for it at its end
(`trainer.plots`); run by hand, it draws any run dir again. Needs matplotlib (the `plots` extra)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from runner.history import read_history

PLOTS = "plots"  # in a run dir


def curve(rows: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of metric `name`; of a step logged more than once, the last value."""
    points = {row["step"]: row[name] for row in rows if name in row}
    steps = sorted(points)
    return steps, [points[step] for step in steps]


def panels(rows: list[dict[str, Any]]) -> dict[str, list[list[str]]]:
    """figure name -> its panels, each the metrics drawn in it (figures without a metric left out)."""
    names = list(dict.fromkeys(name for row in rows for name in row if name != "step"))
    losses = [name for name in ("train/loss", "eval/loss") if name in names]
    rates = [name for name in names if name == "train/lr" or name.startswith("lr/")]
    speed = [name for name in ("perf/tokens_per_s", "perf/samples_per_s", "perf/mfu") if name in names]
    figures = {
        "loss": [losses],
        "eval": [[name] for name in names if name.startswith("eval/") and name != "eval/loss"],
        "lr": [rates],
        "throughput": [[name] for name in speed],
    }
    return {name: [panel for panel in drawn if panel] for name, drawn in figures.items() if any(drawn)}


def run_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """figure name -> a matplotlib Figure of its panels (a line per metric against the step)."""
    from matplotlib.figure import Figure  # the plots extra; no pyplot: no GUI backend, no global state

    figures = {}
    for name, drawn in panels(rows).items():
        figure = Figure(figsize=(7, 2.8 * len(drawn)), layout="constrained")
        for axes, metrics in zip(figure.subplots(len(drawn), 1, squeeze=False)[:, 0], drawn, strict=True):
            for metric in metrics:
                steps, values = curve(rows, metric)
                axes.plot(steps, values, label=metric, marker="o" if len(steps) < 30 else None, markersize=3)
            axes.set_xlabel("step")
            axes.set_title(", ".join(metrics), fontsize=9)
            axes.grid(alpha=0.3)
            if len(metrics) > 1:
                axes.legend(fontsize=8)
        figures[name] = figure
    return figures


def draw_run(run_dir: Path) -> list[Path]:
    """Write the run's figures to `<run_dir>/plots/<name>.png`, each replaced whole; their paths."""
    out = Path(run_dir) / PLOTS
    out.mkdir(exist_ok=True)
    written = []
    for name, figure in run_figures(read_history(run_dir)).items():
        partial = out / f".{name}.partial.png"
        figure.savefig(partial, dpi=100)
        written.append(partial.replace(out / f"{name}.png"))
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m runner.plots RUN_DIR (a run's dir, holding its history.jsonl)", file=sys.stderr)
        return 2
    for path in draw_run(Path(argv[0])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
