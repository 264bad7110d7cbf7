"""Pictures of runs: a run's curves drawn from its history (`runner.telemetry.history`) into `<run dir>/plots/`: the
losses, the other eval metrics, the learning rates and the throughput, one PNG each; and a sweep's, its
jobs ranked by the objective (`sweep_figures`, drawn by `runner.sweep`). A run starts
`python -m runner.telemetry.plots --idle --serve <run dir>` when it starts training, which imports matplotlib while the
run trains and draws each time the run asks (`trainer.plots`); run by hand, `python -m runner.telemetry.plots <dir>`
draws any run dir again, or a finished sweep's pictures and its jobs' (`draw_sweep`). Needs matplotlib (the `plots` extra)."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from runner.files import replacing
from runner.run_dir import HISTORY, PLOTS, RESOLVED, SWEEP_SUMMARY
from runner.telemetry.goodput import read_ledger
from runner.telemetry.history import read_history

# The metrics (train/<name>, eval/<name>, eval/<name>/<source>) `trainer.plots_log_scale` draws on a log scale.
LOG_SCALED = ("loss", "perplexity")


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
    by_rank: dict[str, list[str]] = {}  # a figure of each rank's: rank/<r>/<figure>, a panel per figure
    by_metric: dict[str, list[str]] = {}  # eval/<metric> with a mixture's eval/<metric>/<source>: a panel each
    by_source: dict[str, list[str]] = {}  # a mixture's data/share/<source> beside its data/weight/<source>
    for name in names:
        if name.startswith("rank/"):
            by_rank.setdefault(name.split("/", 2)[2], []).append(name)
        elif name.startswith("eval/"):
            by_metric.setdefault(name.split("/")[1], []).append(name)
        elif name.startswith(("data/share/", "data/weight/")):
            by_source.setdefault(name.split("/", 2)[2], []).append(name)
    figures = {
        "loss": [losses],
        "eval": [panel for panel in by_metric.values() if panel != ["eval/loss"]],  # alone: in "loss"
        "lr": [rates],
        "throughput": [[name] for name in speed],
        "ranks": list(by_rank.values()),
        "mixture": list(by_source.values()),
    }
    return {name: [panel for panel in drawn if panel] for name, drawn in figures.items() if any(drawn)}


def marks(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, what) where the run went on from a checkpoint, from its goodput ledger's `restore` records:
    each attempt after the first ("restarted" where a failed attempt's ranks were restarted in the job,
    else "resumed") and each rollback ("rolled back")."""
    found, attempts, restarted = [], 0, False
    for record in records:
        restarted = restarted or record.get("before") == "restart"
        if record["phase"] != "restore" or "resumed_at" not in record:
            continue
        if "rolled_back_from" in record:
            found.append((record["resumed_at"], "rolled back"))
            continue
        if attempts:
            found.append((record["resumed_at"], "restarted" if restarted else "resumed"))
        attempts, restarted = attempts + 1, False
    return found


def run_figures(
    rows: list[dict[str, Any]],
    title: str | None = None,
    resumed: list[tuple[int, str]] | None = None,
    log_scale: bool = False,
) -> dict[str, Any]:
    """figure name -> a matplotlib Figure of its panels (a line per metric against the step), titled
    `title` (the run's name), with a dashed line at each of `resumed`'s steps (`marks`); `log_scale`: the
    panels of losses and perplexities (`LOG_SCALED`) on a logarithmic y axis."""
    from matplotlib.figure import Figure  # the plots extra; no pyplot: no GUI backend, no global state

    figures = {}
    for name, drawn in panels(rows).items():
        figure = Figure(figsize=(7, 2.8 * len(drawn) + (0.3 if title else 0)), layout="constrained")
        if title:
            figure.suptitle(title, fontsize=10)
        for axes, metrics in zip(figure.subplots(len(drawn), 1, squeeze=False)[:, 0], drawn, strict=True):
            for metric in metrics:
                steps, values = curve(rows, metric)
                label = f"rank {metric.split('/')[1]}" if metric.startswith("rank/") else metric
                axes.plot(steps, values, label=label, marker="o" if len(steps) < 30 else None, markersize=3)
            for step, what in resumed or []:
                axes.axvline(step, color="0.5", linestyle="--", linewidth=0.8)
                axes.annotate(what, (step, 1), xycoords=("data", "axes fraction"), fontsize=7, color="0.4",
                              rotation=90, va="top", ha="right")  # fmt: skip
            axes.set_xlabel("step")
            if log_scale and metrics[0].partition("/")[2].split("/")[0] in LOG_SCALED:
                axes.set_yscale("log")
            ranks = metrics[0].startswith("rank/")
            axes.set_title(f"{metrics[0].split('/', 2)[2]} by rank" if ranks else ", ".join(metrics), fontsize=9)
            axes.grid(alpha=0.3)
            if len(metrics) > 1:
                axes.legend(fontsize=8)
        figures[name] = figure
    return figures


def ranked(results: dict[str, float | None], direction: str) -> list[str]:
    """The names of `results` that have a finite value, best first (`direction`: minimize or maximize)."""
    found = [(value, name) for name, value in results.items() if value is not None and math.isfinite(value)]
    return [name for _, name in sorted(found, reverse=direction == "maximize")]


def sweep_figures(
    jobs: dict[str, dict[str, str]],
    objective: str,
    results: dict[str, float | None],
    direction: str,
    histories: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    """A sweep's pictures: "summary", the objective against each swept setting (a panel each; the best job
    a star), and "curves", every job's training loss and objective against the step (the best job bold).

    Args:
        jobs: job name -> its swept settings (key -> value as given).
        objective: the metric the jobs are ranked by; `results`: its final value by job (None: none).
        direction: minimize or maximize.
        histories: job name -> its history rows.
    """
    from matplotlib.figure import Figure  # the plots extra

    order = ranked(results, direction)
    best = order[0] if order else None
    keys = list(dict.fromkeys(key for settings in jobs.values() for key in settings))
    summary = Figure(figsize=(7, 2.8 * max(1, len(keys))), layout="constrained")
    for axes, key in zip(summary.subplots(max(1, len(keys)), 1, squeeze=False)[:, 0], keys, strict=False):
        _setting_panel(axes, key, [name for name in order if key in jobs[name]], jobs, results, best)
        axes.set_ylabel(objective)
    curves = Figure(figsize=(7, 5.6), layout="constrained")
    for axes, metric in zip(
        curves.subplots(2, 1, squeeze=False)[:, 0], ("train/loss", objective), strict=True
    ):
        names = [*order, *(n for n in jobs if n not in order)]
        labels = {n: f"job {n}: " + ", ".join(f"{k}={v}" for k, v in jobs[n].items()) for n in names}
        _curves_panel(axes, metric, labels, histories, best)
    return {"summary": summary, "curves": curves}


def compare_figure(histories: dict[str, list[dict[str, Any]]], metrics: list[str]) -> Any:
    """The runs' curves overlaid: a panel for each of `metrics` that a run logged, a line per run
    (`histories`: the run's label -> its history rows)."""
    from matplotlib.figure import Figure  # the plots extra

    logged = [m for m in metrics if any(curve(rows, m)[0] for rows in histories.values())]
    figure = Figure(figsize=(7, 2.8 * max(1, len(logged))), layout="constrained")
    for axes, metric in zip(figure.subplots(max(1, len(logged)), 1, squeeze=False)[:, 0], logged, strict=False):
        _curves_panel(axes, metric, {label: label for label in histories}, histories, None)
    return figure


def _setting_panel(
    axes: Any,
    key: str,
    done: list[str],
    jobs: dict[str, dict[str, str]],
    results: dict[str, float | None],
    best: str | None,
) -> None:
    """The objective of the jobs `done` (ranked) against their value of `key`: a line over numbers (log
    scale over a decade or more), points over categories; the best job a star."""
    values = [jobs[name][key] for name in done]
    numeric = all(_number(v) is not None for v in values)
    categories = list(dict.fromkeys(values))  # one position per value, the best job's first
    xs = [_number(v) for v in values] if numeric else [categories.index(v) for v in values]
    points = sorted(zip(xs, done, strict=True)) if numeric else list(zip(xs, done, strict=True))
    axes.plot(
        [x for x, _ in points],
        [results[n] for _, n in points],
        marker="o",
        linestyle="-" if numeric else "",
    )
    if best in done:
        axes.plot(
            [xs[done.index(best)]],
            [results[best]],
            marker="*",
            markersize=16,
            color="red",
            linestyle="",
            label=f"best: job {best}",
        )
        axes.legend(fontsize=8)
    if numeric and min(xs) > 0 and max(xs) / min(xs) >= 10:  # a decade or more: as learning rates go
        axes.set_xscale("log")
    if not numeric:
        axes.set_xticks(range(len(categories)), categories, fontsize=7, rotation=30)
    axes.set_xlabel(key)
    axes.grid(alpha=0.3)


def _curves_panel(
    axes: Any,
    metric: str,
    labels: dict[str, str],
    histories: dict[str, list[dict[str, Any]]],
    best: str | None,
) -> None:
    """`metric` against the step for each run of `labels` (name -> its label) that logged it, in that
    order (the best one bold)."""
    for name, label in labels.items():
        steps, values = curve(histories.get(name, []), metric)
        if steps:
            axes.plot(
                steps,
                values,
                label=label,
                linewidth=2.5 if name == best else 1.0,
                marker="o" if len(steps) < 30 else None,
                markersize=3,
            )
    axes.set_title(metric, fontsize=9)
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(fontsize=7)


def _number(value: str) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def save_figures(figures: dict[str, Any], directory: Path) -> list[Path]:
    """Write each figure to `<directory>/<name>.png`, each replaced whole; their paths."""
    directory.mkdir(exist_ok=True)
    written = []
    for name, figure in figures.items():
        with replacing(directory / f"{name}.png") as staging:
            figure.savefig(staging, dpi=100, format="png")
        written.append(directory / f"{name}.png")
    return written


def draw_run(run_dir: Path) -> list[Path]:
    """Write the run's figures to `<run_dir>/plots/<name>.png` (on the scale its `trainer.plots_log_scale`
    asks); their paths."""
    run_dir = Path(run_dir)
    sweep_job = (run_dir.parent / SWEEP_SUMMARY).is_file() or (run_dir.parent / "multirun.yaml").is_file()
    title = f"{run_dir.parent.name}/{run_dir.name}" if sweep_job else run_dir.name
    resolved = run_dir / RESOLVED
    trainer = (yaml.safe_load(resolved.read_text()) or {}).get("trainer", {}) if resolved.is_file() else {}
    figures = run_figures(
        read_history(run_dir), title, marks(read_ledger(run_dir)), bool(trainer.get("plots_log_scale"))
    )
    return save_figures(figures, run_dir / PLOTS)


def draw_sweep(sweep_dir: Path) -> list[Path]:
    """Draw a finished sweep's pictures again from its `summary.csv` and its jobs' histories, as the sweep
    drew them (`sweep_figures`), and each job's own; their paths. The sweep's direction is its ranks'."""
    with open(sweep_dir / SWEEP_SUMMARY, newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), list(reader)
    rank = next(name for name in header if name.startswith("rank ("))
    objective = rank.removeprefix("rank (").removesuffix(")")
    swept = header[1 : header.index("status" if "status" in header else rank)]
    jobs = {row["job"]: {k: row[k] for k in swept if row[k] != ""} for row in rows}
    results = {row["job"]: _number(row.get(objective, "")) for row in rows}
    by_rank = sorted((int(row[rank]), results[row["job"]]) for row in rows if row[rank])
    direction = "maximize" if len(by_rank) > 1 and by_rank[0][1] > by_rank[-1][1] else "minimize"
    histories = {name: read_history(sweep_dir / name) for name in jobs}
    drawn = [path for name in jobs if histories[name] for path in draw_run(sweep_dir / name)]
    return drawn + save_figures(sweep_figures(jobs, objective, results, direction, histories), sweep_dir)


def yield_the_cpu() -> None:
    """Run only on CPU time nothing else wants (Linux's SCHED_IDLE, else the lowest priority): a training
    loop's threads next to a drawing lose none of their time, even where they are as many as the cores."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def serve(run_dir: Path) -> None:
    """Draw the run each time a line arrives on stdin, until it ends; answer each with one JSON line on
    stdout: `{"drawn": [paths]}` or `{"error": why}`. matplotlib is imported before the first request, so a
    run that starts this as it starts training waits only for the drawing itself."""
    import matplotlib.figure  # noqa: F401  (the import, ahead of the first request)

    for _ in sys.stdin:
        try:
            answer = {"drawn": [str(path) for path in draw_run(run_dir)]}
        except Exception as err:  # the run warns and goes on: a picture is never worth its training
            answer = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--idle"]:
        yield_the_cpu()
        argv = argv[1:]
    serving = argv[:1] == ["--serve"]
    argv = argv[1:] if serving else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "usage: python -m runner.telemetry.plots [--idle] [--serve] DIR (a run's dir, holding its history.jsonl, or a "
            "sweep's, holding its summary.csv; --idle: only on CPU time nothing else wants; --serve: draw a run "
            "at each line on stdin, answering each with a JSON line)",
            file=sys.stderr,
        )
        return 2
    directory = Path(argv[0])
    if serving:
        serve(directory)
        sys.stdout.flush()
        os._exit(0)  # every answer given: no teardown of matplotlib for the run to wait out
    if (directory / HISTORY).is_file():
        drawn = draw_run(directory)
    elif (directory / SWEEP_SUMMARY).is_file():
        try:
            drawn = draw_sweep(directory)
        except (KeyError, StopIteration, ValueError) as err:  # not the table runner.sweep writes
            print(
                f"{directory / SWEEP_SUMMARY} is not a sweep's summary as runner writes it (no job, settings and rank "
                f"columns: {type(err).__name__} {err}); run the sweep again to write it.",
                file=sys.stderr,
            )
            return 2
    else:
        print(
            f"{directory} is neither a run's dir (no {HISTORY}) nor a sweep's (no {SWEEP_SUMMARY}): give the dir "
            "of a run (outputs/runs/<date>_<time>) or of a finished sweep (outputs/sweeps/<date>_<time>).",
            file=sys.stderr,
        )
        return 2
    for path in drawn:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
