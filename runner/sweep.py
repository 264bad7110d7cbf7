"""Multiruns (`python -m runner -m ...`): every job checked before the first runs; after the last, the
swept values against each job's final metrics, printed and saved in the sweep's dir as `summary.csv` and
`summary.png` (with the `plots` extra, matplotlib); the sweep's parent run (one per sweep in the tracker)
gets both and is closed. The sweeper that resumes a sweep is a Hydra plugin: `hydra_plugins/runner_sweeper`."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.checkpoint.resume import FINISHED
from runner.cli import FAILED, JOB_CONFIG_DIR
from runner.errors import REPLACED_OPTIONS, ConfigError, describe_compose_error, install_command
from runner.validate import check_job

log = logging.getLogger("runner")


@dataclass
class JobResult:
    name: str  # its dir in the sweep
    overrides: dict[str, str]
    metrics: dict[str, float]
    failure: str | None = None  # why its training failed (its dir's failed.json), else None: it finished


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
        params = config.hydra.sweeper.get("params") or {}
        arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
        problems = []
        try:
            jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(arguments), None)[0]
        except (HydraException, OmegaConfBaseException) as err:
            jobs, problems = [], [describe_compose_error(err)]
        for number, overrides in enumerate(jobs):
            try:
                check_job(compose(config_name=config.hydra.job.config_name, overrides=list(overrides)))
            except ConfigError as err:
                problems.append(f"job {number} ({' '.join(overrides)}): {err}")
            except (HydraException, OmegaConfBaseException) as err:
                problems.append(f"job {number} ({' '.join(overrides)}): {describe_compose_error(err)}")
        if problems:
            print(f"Configuration error: {chr(10).join(problems)} No job was run.", file=sys.stderr)
            sys.exit(2)


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
        rows = [
            [
                job.name,
                *(job.overrides.get(k, "") for k in swept),
                *(["failed" if job.failure else "finished"] if failed else []),
                *(job.metrics.get(m) for m in metrics),
            ]
            for job in jobs
        ]
        header = ["job", *swept, *status, *metrics]
        with open(sweep_dir / "summary.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
        if metrics and importlib.util.find_spec("matplotlib") is None:
            log.warning(
                "summary.png is not drawn: matplotlib is not installed (%s).", install_command("plots")
            )
        elif metrics:  # not when every job failed
            plot(jobs, swept, metrics, sweep_dir / "summary.png")
        log.info("sweep summary (%s):\n%s", sweep_dir, format_table(header, rows))
        if config.tracker.get("_target_"):
            summaries = [sweep_dir / "summary.csv", sweep_dir / "summary.png"]
            instantiate(config.tracker).end_sweep(sweep_dir, [path for path in summaries if path.is_file()])
        if failed:  # the sweep ran its other jobs; the command says which failed, and fails
            log.error(
                "%d of %d job(s) failed: %s",
                len(failed),
                len(jobs),
                "; ".join(f"job {job.name} ({job.failure[:300]})" for job in failed),  # type: ignore[index]
            )
            sys.exit(1)


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
            )
        )
    return sorted(
        jobs, key=lambda job: (not job.name.isdigit(), int(job.name) if job.name.isdigit() else job.name)
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


def plot(jobs: list[JobResult], swept: list[str], metrics: list[str], path: Path) -> None:
    """One panel per metric: against the swept value when a single numeric value was swept, else one bar
    per job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = len(swept) == 1 and all(_is_number(job.overrides.get(swept[0])) for job in jobs)
    fig, axes = plt.subplots(len(metrics), 1, figsize=(7, 2.6 * len(metrics)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        done = [job for job in jobs if metric in job.metrics]
        values = [job.metrics[metric] for job in done]
        if numeric:
            xs = [float(job.overrides[swept[0]]) for job in done]
            order = sorted(range(len(xs)), key=xs.__getitem__)
            ax.plot([xs[i] for i in order], [values[i] for i in order], marker="o")
            if min(xs) > 0 and max(xs) / min(xs) > 100:
                ax.set_xscale("log")
            ax.set_xlabel(swept[0])
        else:
            labels = [", ".join(f"{k}={job.overrides.get(k, '')}" for k in swept) for job in done]
            ax.barh(range(len(done)), values)
            ax.set_yticks(range(len(done)), labels, fontsize=7)
        ax.set_title(metric, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _is_number(value: str | None) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except ValueError:
        return False
