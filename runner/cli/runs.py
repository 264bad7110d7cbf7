"""`runner runs [DIR or GLOB ...]`: a table of the runs in the run dirs below `outputs/` (or those given): each
run's state, step of its max, objective and chosen metrics, goodput, start time, and the overrides that
differ between the runs listed, as their dirs tell it (`runner.run_dir.state`). `runner runs compare A B`: the
settings in which two runs differ and their curves overlaid in one PNG."""

from __future__ import annotations

import argparse
import glob
import math
import time
from pathlib import Path

from runner.errors import ConfigError
from runner.run_dir import LOG_FILE, RUNS_DIR
from runner.run_dir.state import STATES, RunInfo, find_runs, is_run_dir, read_run, run_config
from runner.telemetry.history import read_history
from runner.telemetry.plots import compare_figure, save_figures
from runner.trackers.base import flatten

DEFAULT_ROOT = Path(RUNS_DIR).parent  # outputs/: single runs and sweeps


def main(arguments: list[str]) -> None:
    """Print the table of the runs `arguments` select (or, after `compare`, compare two)."""
    if arguments[:1] == ["compare"]:
        compare(arguments[1:])
        return
    parser = argparse.ArgumentParser(prog="runner runs", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help=f"run dirs, dirs holding them, or globs (default: {DEFAULT_ROOT}/)")
    parser.add_argument("--state", help=f"only runs in these states, comma-separated ({', '.join(STATES)})")
    parser.add_argument("--last", type=int, metavar="N", help="only the N runs that started last")
    parser.add_argument("--metrics", default="", help="metrics to show beside the objective, comma-separated")
    args = parser.parse_args(arguments)
    states = [s.strip() for s in args.state.split(",")] if args.state else []
    if unknown := [s for s in states if s not in STATES]:
        raise ConfigError(f"--state {args.state}: no state {', '.join(unknown)}; the states are {', '.join(STATES)}.")
    if args.last is not None and args.last < 1:
        raise ConfigError(f"--last {args.last}: give a number of runs, 1 or more.")
    runs = [read_run(run_dir) for run_dir in _selected(args.paths)]
    runs = [run for run in runs if not states or run.state in states]
    runs.sort(key=lambda run: (run.started is not None, run.started or 0.0, str(run.run_dir)))  # oldest first
    if args.last:
        runs = runs[-args.last :]
    if not runs:
        print("no runs" + (f" in the states {', '.join(states)}" if states else ""))
        return
    print(table(runs, [m.strip() for m in args.metrics.split(",") if m.strip()]))


def compare(arguments: list[str]) -> None:
    """Print the settings in which two runs differ and draw their curves overlaid, a panel a metric."""
    parser = argparse.ArgumentParser(prog="runner runs compare", description=compare.__doc__)
    parser.add_argument("runs", nargs=2, metavar="RUN_DIR", help="the two runs' dirs, as `runner runs` lists them")
    parser.add_argument(
        "--metrics", default="", help="the curves, comma-separated (default: train/loss and the runs' objectives)"
    )
    parser.add_argument("--out", default="compare.png", help="the PNG to write (default: compare.png)")
    args = parser.parse_args(arguments)
    dirs = [Path(path) for path in args.runs]
    for run_dir in dirs:
        if not is_run_dir(run_dir):
            raise ConfigError(
                f"runner runs compare {run_dir}: not a run's dir (it holds no {LOG_FILE}). Give two run dirs, "
                "as `runner runs` lists them."
            )
    out = Path(args.out)
    if out.suffix != ".png":
        raise ConfigError(f"runner runs compare --out {out}: the picture is a PNG; give a path ending in .png.")
    labels = [_shown(run_dir) for run_dir in dirs]
    print(settings_diff(labels, [dict(flatten(run_config(run_dir))) for run_dir in dirs]))
    objectives = [run.objective for run in map(read_run, dirs) if run.objective]
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] or ["train/loss", *objectives]
    histories = {label: read_history(run_dir) for label, run_dir in zip(labels, dirs, strict=True)}
    figure = compare_figure(histories, list(dict.fromkeys(metrics)))
    save_figures({out.stem: figure}, out.parent)
    print(f"the curves of {', '.join(a.get_title() for a in figure.axes) or 'no metric either run logged'}: {out}")


def settings_diff(labels: list[str], settings: list[dict[str, object]]) -> str:
    """The settings (dotted keys) whose values differ between the runs, as aligned columns headed by `labels`."""
    keys = sorted({key for flat in settings for key in flat if len({str(f.get(key, "<unset>")) for f in settings}) > 1})
    if not keys:
        return "the runs' settings are the same"
    rows = [["setting", *labels], *([key, *(str(f.get(key, "<unset>")) for f in settings)] for key in keys)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _selected(paths: list[str]) -> list[Path]:
    """The run dirs below each of `paths` (a dir, or a glob of dirs); a path that names nothing is an error."""
    if not paths:
        return find_runs(DEFAULT_ROOT) if DEFAULT_ROOT.is_dir() else []
    found: dict[Path, None] = {}
    for path in paths:
        matches = sorted(Path(match) for match in glob.glob(path)) or [Path(path)]
        if not any(match.is_dir() for match in matches):
            raise ConfigError(f"runner runs {path}: no such directory. Give run dirs, dirs holding them, or a glob.")
        for match in matches:
            found |= dict.fromkeys(find_runs(match) if match.is_dir() else [])
    return list(found)


def table(runs: list[RunInfo], metrics: list[str]) -> str:
    """The runs as aligned columns: run, state, step, the objective's and `metrics`' values, goodput,
    start, and the overrides not shared by all of them."""
    shared = set.intersection(*(set(run.overrides) for run in runs)) if len(runs) > 1 else set()
    rows = [["run", "state", "step", "objective", *metrics, "goodput", "started", "overrides"]]
    for run in runs:
        step = "-" if run.step is None else f"{run.step}" + (f"/{run.max_steps}" if run.max_steps else "")
        rows.append(
            [
                _shown(run.run_dir),
                run.state,
                step,
                f"{run.objective}={_value(run.metrics.get(run.objective))}" if run.objective else "-",
                *(_value(run.metrics.get(metric)) for metric in metrics),
                "-" if run.goodput is None else f"{run.goodput:.0%}",
                "-" if run.started is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.started)),
                " ".join(o for o in run.overrides if o not in shared) or "-",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    )


def _value(value: float | None) -> str:
    if value is None:
        return "-"
    return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4g}"


def _shown(run_dir: Path) -> str:
    """`run_dir` relative to the working dir where it is inside it."""
    resolved = run_dir.resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else str(run_dir)
