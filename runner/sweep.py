"""Multiruns (`python -m runner -m ...`): every job checked before the first runs; after the last, the
swept values against each job's final metrics and its goodput (`goodput.json`), the jobs ranked by
`trainer.objective` (`sweep.direction`) and the best named, printed and saved in the sweep's dir as `summary.csv`, and (with the `plots` extra,
matplotlib) `summary.png` (the objective against each swept setting) and `curves.png` (every job's curves);
the sweep's parent run (one per sweep in the tracker) gets them and is closed. The sweeper that resumes a sweep is a Hydra plugin: `hydra_plugins/runner_sweeper`."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.compose import check_hydra_settings
from runner.errors import REPLACED_OPTIONS, ConfigError, describe_compose_error, install_command
from runner.run_dir import FAILED, FINISHED, GOODPUT, JOB_CONFIG_DIR, SWEEP_SUMMARY
from runner.telemetry.history import read_history
from runner.telemetry.plots import ranked, save_figures, sweep_figures
from runner.validate import check_job

log = logging.getLogger("runner")


@dataclass
class JobResult:
    name: str  # its dir in the sweep
    overrides: dict[str, str]
    metrics: dict[str, float]
    failure: str | None = None  # why its training failed (its dir's failed.json), else None: it finished
    spent: dict[str, Any] | None = None  # its goodput ledger's sum (goodput.json), where it has one


class SweepCheck(Callback):
    """Hydra callback (registered in `conf/config.yaml`): before a grid sweep (Hydra's basic sweeper) runs
    its first job, compose and check every job's config, so that a bad value in the middle of a list fails
    the sweep at once, naming each bad job, instead of after the jobs before it ran. (Hydra turns a
    callback's exceptions into warnings: a refusal exits here, with code 2.)"""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = str(config.hydra.launcher.get("_target_", ""))
        if launcher.startswith("hydra_plugins.hydra_submitit_launcher."):  # installed, yet not runner's way
            option = "submitit_slurm" if launcher.endswith(".SlurmLauncher") else "submitit_local"
            print(f"Configuration error: {REPLACED_OPTIONS[f'hydra/launcher={option}']}", file=sys.stderr)
            sys.exit(2)
        if not str(config.hydra.sweeper.get("_target_", "")).endswith(("BasicSweeper", "ResumableSweeper")):
            return  # other sweepers choose their values as they go
        jobs, problems = _grid_jobs(config)
        for number, overrides in enumerate(jobs):
            try:
                check_job(compose(config_name=config.hydra.job.config_name, overrides=list(overrides)))
            except ConfigError as err:
                problems.append(f"job {number} ({' '.join(overrides)}): {err}")
            except (HydraException, OmegaConfBaseException) as err:
                problems.append(f"job {number} ({' '.join(overrides)}): {describe_compose_error(err)}")
        if problems:
            said = chr(10).join(problems).rstrip()
            print(
                f"Configuration error: {said}{'' if said.endswith('.') else '.'} No job was run.",
                file=sys.stderr,
            )
            sys.exit(2)


def _grid_jobs(config: DictConfig) -> tuple[list[list[str]], list[str]]:
    """The grid's jobs (each one's overrides) as the basic sweeper will split them, and the problems of
    the sweep's own settings."""
    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
    problems = []
    try:
        check_hydra_settings(config.hydra)
    except ConfigError as err:
        problems.append(str(err))
    # With the config loader, as the sweeper's own parser: glob() lists a group's options.
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    try:
        parsed = parser.parse_overrides(arguments)
        if sampled := [o.input_line for o in parsed if o.value_type == ValueType.INTERVAL_SWEEP]:
            raise ConfigError(
                f"{', '.join(sampled)}: interval() is a range to sample from, and the grid sweeper runs a list "
                "of values. Sample it with Optuna (hydra/sweeper=optuna, the sweeps extra), or sweep a list: "
                "optimizer.lr=1e-3,3e-3,1e-2."
            )
        return BasicSweeper.split_arguments(parsed, None)[0], problems
    except ConfigError as err:
        return [], [str(err)]
    except (HydraException, OmegaConfBaseException) as err:
        return [], [describe_compose_error(err)]


class SweepSummary(Callback):
    """Hydra callback (registered in `conf/config.yaml`). The sweep's parent run is created before any
    job starts, so that jobs running at once (SLURM array tasks) all find it."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.tracker.get("_target_") and not config.tracker.get("parent_run_id"):
            instantiate(config.tracker).start_sweep(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = read_jobs(sweep_dir)
        if not jobs:
            return
        swept = swept_keys(jobs)
        metrics = sorted({name for job in jobs for name in job.metrics})
        failed = [job for job in jobs if job.failure is not None]
        status = ["status"] if failed else []  # a column only when a job failed
        objective = config.trainer.objective or next(
            (m for m in metrics if m.startswith("eval/")), "train/loss"
        )
        results = {job.name: job.metrics.get(objective) for job in jobs}
        direction = getattr(config.sweep.direction, "value", config.sweep.direction)  # the enum's word
        order = ranked(results, direction)
        rows = [
            [
                job.name,
                *(job.overrides.get(k, "") for k in swept),
                *(["failed" if job.failure else "finished"] if failed else []),
                order.index(job.name) + 1 if job.name in order else None,
                *(job.metrics.get(m) for m in metrics),
                *([job.spent["goodput"], job.spent["wall_s"]] if job.spent else [None, None]),
            ]
            for job in jobs
        ]
        header = ["job", *swept, *status, f"rank ({objective})", *metrics, "goodput", "wall_s"]
        with open(sweep_dir / SWEEP_SUMMARY, "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
        log.info("sweep summary (%s):\n%s", sweep_dir, format_table(header, rows))
        if order:
            best = next(job for job in jobs if job.name == order[0])
            settings = " ".join(f"{k}={best.overrides.get(k, '')}" for k in swept)
            log.info("best: job %s (%s): %s=%.6g", best.name, settings, objective, results[best.name])
        pictures = draw(jobs, swept, objective, results, direction, sweep_dir) if metrics else []
        if config.tracker.get("_target_"):
            instantiate(config.tracker).end_sweep(sweep_dir, [sweep_dir / SWEEP_SUMMARY, *pictures])
        log_time_spent(jobs)
        if failed:  # the sweep ran its other jobs; the command says which failed, and fails
            log.error(
                "%d of %d job(s) failed: %s",
                len(failed),
                len(jobs),
                "; ".join(f"job {job.name} ({job.failure[:300]})" for job in failed),  # type: ignore[index]
            )
            sys.exit(1)


def draw(
    jobs: list[JobResult],
    swept: list[str],
    objective: str,
    results: dict[str, float | None],
    direction: str,
    sweep_dir: Path,
) -> list[Path]:
    """The sweep's pictures (`runner.telemetry.plots.sweep_figures`) as `<sweep dir>/<name>.png`, named on the console;
    none, and one warning, without matplotlib or where one cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        log.warning(
            "the sweep's pictures are not drawn: matplotlib is not installed (%s).", install_command("plots")
        )
        return []
    try:
        figures = sweep_figures(
            {job.name: {k: job.overrides[k] for k in swept if k in job.overrides} for job in jobs},
            objective,
            results,
            direction,
            {job.name: read_history(sweep_dir / job.name) for job in jobs},
        )
        paths = save_figures(figures, sweep_dir)
    except Exception as err:  # a picture never fails the sweep
        log.warning("the sweep's pictures could not be drawn (%s: %s)", type(err).__name__, err)
        return []
    log.info("pictures: %s", " ".join(map(str, paths)))
    return paths


def read_jobs(sweep_dir: Path) -> list[JobResult]:
    """The jobs of the sweep that finished (their dir holds `metrics.json`) or whose training failed
    (`failed.json`), in job order."""
    jobs = []
    for job_dir in sorted(
        {record.parent for name in (FINISHED, FAILED) for record in sweep_dir.glob(f"*/{name}")}
    ):
        overrides = OmegaConf.load(job_dir / JOB_CONFIG_DIR / "overrides.yaml")
        finished = job_dir / FINISHED
        jobs.append(
            JobResult(
                name=job_dir.name,
                overrides=dict(str(o).split("=", 1) for o in overrides if "=" in str(o)),
                metrics=json.loads(finished.read_text()) if finished.is_file() else {},
                failure=None if finished.is_file() else json.loads((job_dir / FAILED).read_text())["message"],
                spent=json.loads((job_dir / GOODPUT).read_text()) if (job_dir / GOODPUT).is_file() else None,
            )
        )
    return sorted(
        jobs, key=lambda job: (not job.name.isdigit(), int(job.name) if job.name.isdigit() else job.name)
    )


def log_time_spent(jobs: list[JobResult]) -> None:
    """One line for the sweep's time: its jobs' wall time and productive step time added up (their
    `goodput.json`), and how many restarts and lost steps they had."""
    spent = [job.spent for job in jobs if job.spent]
    if not spent:
        return
    wall = sum(s["wall_s"] for s in spent)
    train = sum(s["phases_s"].get("train", 0.0) for s in spent)
    log.info(
        "time spent by %d job(s): %.1f s, goodput %.1f%% (%d restart(s), %d step(s) lost)",
        len(spent),
        wall,
        100 * train / wall if wall else 0.0,
        sum(s["restarts"] for s in spent),
        sum(s["lost_steps"] for s in spent),
    )


def swept_keys(jobs: list[JobResult]) -> list[str]:
    """The overrides whose values differ between jobs (all of them for a one-job sweep)."""
    keys = list(dict.fromkeys(k for job in jobs for k in job.overrides))
    differing = [k for k in keys if len({job.overrides.get(k) for job in jobs}) > 1]
    return differing or keys


def format_table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header, *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells)


def _cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else "" if value is None else str(value)
