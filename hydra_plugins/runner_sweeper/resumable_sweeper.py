"""`hydra/sweeper=runner` (runner's default): Hydra's grid sweeper, resumable. A Hydra plugin (Hydra takes
sweepers from the `hydra_plugins` package only); it imports nothing of runner, so that finding it costs
other Hydra apps nothing."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger("runner")

SWEEP_RECORD = "sweep.json"  # in the sweep's dir: every job's overrides, in job order
FINISHED = "metrics.json"  # in a job's dir: the job ran to its end
FAILED = "failed.json"  # in a job's dir: its training failed (runner.cli writes why)
RESUME_OVERRIDE = "sweep.resume"  # not part of what a job is


class AnotherSweep(ValueError):
    """The sweep dir holds a sweep other than the one asked for."""


class ResumableSweeper(Sweeper):
    """Hydra's grid sweeper (`hydra/sweeper=runner`, the default) that picks a sweep up where it stopped.

    Run again in the same sweep dir (`hydra.sweep.dir=...`) with the same values, it skips the jobs whose
    dir holds `metrics.json` (they finished; their dirs stay untouched) and launches the others, numbered
    as before, so that an interrupted job resumes from its own dir's latest checkpoint
    (`trainer.resume=auto`). On SLURM each run of consecutive unfinished jobs is one array. A sweep dir
    that holds another sweep is refused, naming the difference; `sweep.resume=false` starts over, moving
    the previous jobs' dirs into `replaced-<time>/`.

    (It is not a subclass of Hydra's `BasicSweeper`, whose module Hydra's plugin scan executes again,
    replacing the class; it calls that class's `split_arguments` as it finds it.)
    """

    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None) -> None:
        self.max_batch_size = max_batch_size
        self.params = params or {}
        self.config: DictConfig | None = None
        self.launcher: Launcher | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> list[Sequence[JobReturn]]:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        params = [f"{key}={value}" for key, value in self.params.items()]  # hydra.sweeper.params
        overrides = parser.parse_overrides([*params, *arguments])
        jobs = [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
        sweep_dir = Path(self.config.hydra.sweep.dir)
        composed = [self.compose(number, job) for number, job in enumerate(jobs)]
        settings = [job_settings(cfg) for cfg in composed]
        dirs = [sweep_dir / job_subdir(cfg) for cfg in composed]
        try:
            finished = previous_jobs(
                sweep_dir,
                jobs,
                settings,
                dirs,
                resume=OmegaConf.select(self.config, "sweep.resume", default=True),
            )
        except AnotherSweep as err:  # the sweep's config errors read as runner's (exit 2)
            print(f"Configuration error: {err}", file=sys.stderr)
            sys.exit(2)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        (sweep_dir / SWEEP_RECORD).write_text(
            json.dumps({"jobs": [job_identity(job) for job in jobs], "settings": settings}, indent=1)
        )
        if finished:
            log.info(
                "resuming the sweep in %s: job(s) %s finished before and are not run again",
                sweep_dir,
                ", ".join(map(str, sorted(finished))),
            )
        returns: list[Sequence[JobReturn]] = []
        for start, batch in unfinished_batches(jobs, finished, self.max_batch_size):
            self.validate_batch_is_legal(batch)  # composes each job's config: bad values fail before any runs
            results = self.launcher.launch(batch, initial_job_idx=start)
            for result in results:
                if not recorded_failure(result):
                    _ = result.return_value  # raises what a job raised
            returns.append(results)
        return returns

    def compose(self, number: int, overrides: list[str]) -> DictConfig:
        """Job `number`'s config, as the launcher will compose it (its number set, for its dir's name)."""
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, job_identity(overrides))
        with open_dict(cfg):
            cfg.hydra.job.num = cfg.hydra.job.id = number
        return cfg


def job_settings(cfg: DictConfig) -> dict[str, Any]:
    """A job's composed config as dotted keys (Hydra's own node and `sweep` left out, interpolations as
    written): what an edited YAML changes even where the overrides stay the same."""
    container = OmegaConf.to_container(cfg, resolve=False)
    return {
        key: value
        for key, value in flat(container).items()  # type: ignore[arg-type]
        if key.split(".")[0] not in ("hydra", "sweep")
    }


def job_subdir(cfg: DictConfig) -> str:
    """A job's dir in the sweep dir: `hydra.sweep.subdir` (the job's number by default, or a pattern of
    the user's such as `${hydra.job.override_dirname}`). The sweep dir is the sweeper's own: a job's
    config resolves a `${now:...}` in it afresh."""
    return str(cfg.hydra.sweep.subdir)


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys."""
    if not isinstance(node, dict) or not node:
        return {prefix: node}
    found: dict[str, Any] = {}
    for key, value in node.items():
        found |= flat(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def recorded_failure(result: JobReturn) -> bool:
    """Whether `result` is a job whose training failed and that recorded why in its dir (`failed.json`):
    the sweep goes on, and its summary names it. Any other failure ends the sweep."""
    if result.status != JobStatus.FAILED or result.hydra_cfg is None:
        return False
    return (Path(result.hydra_cfg.hydra.runtime.output_dir) / FAILED).is_file()


def job_identity(overrides: Sequence[str]) -> list[str]:
    """What makes a job of a sweep this job: its overrides, but whether to resume the sweep."""
    return [o for o in overrides if not o.startswith(f"{RESUME_OVERRIDE}=")]


def previous_jobs(
    sweep_dir: Path,
    jobs: list[list[str]],
    settings: list[dict[str, Any]],
    dirs: list[Path],
    *,
    resume: bool,
) -> set[int]:
    """The jobs of this sweep that finished before (their `dirs` hold metrics.json). AnotherSweep when
    `sweep_dir` holds another sweep: other jobs, or the same jobs composed to other `settings` (an edited
    YAML); unless `resume` is false: then the previous jobs' dirs are moved aside and none finished."""
    record = sweep_dir / SWEEP_RECORD
    job_dirs = (  # a job's dir holds its .hydra/ (under any subdir pattern)
        [d for d in sweep_dir.iterdir() if d.is_dir() and (d.name.isdigit() or (d / ".hydra").is_dir())]
        if sweep_dir.is_dir()
        else []
    )
    if not resume:
        if job_dirs:
            aside = sweep_dir / f"replaced-{time.strftime('%Y-%m-%d_%H-%M-%S')}"
            aside.mkdir()
            for job_dir in job_dirs:
                job_dir.rename(aside / job_dir.name)
            log.warning("sweep.resume=false: starting over; the previous jobs' dirs are in %s", aside)
        return set()
    if not record.exists():
        if job_dirs:
            raise AnotherSweep(
                f"hydra.sweep.dir={sweep_dir} holds job dirs ({', '.join(sorted(d.name for d in job_dirs))}) but "
                f"no {SWEEP_RECORD} saying which sweep they belong to, so they cannot be resumed. Give this sweep "
                "another hydra.sweep.dir, or add sweep.resume=false to start over (those dirs are moved aside)."
            )
        return set()
    try:
        recorded = json.loads(record.read_text())
        before = recorded["jobs"]
    except (ValueError, KeyError, TypeError) as err:  # cut short, or edited by hand
        raise AnotherSweep(
            f"hydra.sweep.dir={sweep_dir}: its {SWEEP_RECORD} cannot be read ({type(err).__name__}: {err}), so "
            "which jobs finished cannot be told. Add sweep.resume=false to start over (the previous jobs' dirs "
            "are moved aside), or give this sweep another hydra.sweep.dir."
        ) from None
    now = [job_identity(job) for job in jobs]
    if before != now:
        raise AnotherSweep(
            f"hydra.sweep.dir={sweep_dir} holds another sweep: {describe_difference(before, now)}. Run it with "
            "its own values to resume it, give this sweep another hydra.sweep.dir, or add sweep.resume=false to "
            "start over (the previous jobs' dirs are moved aside)."
        )
    changed = [
        f"job {number}: {changes}"
        for number, (was, now_settings) in enumerate(
            zip(recorded.get("settings") or [], settings, strict=False)
        )
        if (changes := describe_changes(was, now_settings))
    ]
    if changed:
        raise AnotherSweep(
            f"hydra.sweep.dir={sweep_dir} holds this sweep's jobs composed with other settings (a config file "
            f"changed since): {'; '.join(changed[:3])}{'; ...' if len(changed) > 3 else ''}. Restore them to resume "
            "it, give this sweep another hydra.sweep.dir, or add sweep.resume=false to start over (the previous "
            "jobs' dirs are moved aside)."
        )
    return {number for number, directory in enumerate(dirs) if (directory / FINISHED).exists()}


def describe_changes(before: dict[str, Any], now: dict[str, Any]) -> str:
    """The settings that differ, as `key=old there, new here`, at most three."""
    keys = [
        key
        for key in sorted(before.keys() | now.keys())
        if before.get(key, "<unset>") != now.get(key, "<unset>")
    ]
    shown = [f"{key}={before.get(key, '<unset>')} there, {now.get(key, '<unset>')} here" for key in keys[:3]]
    return ", ".join(shown) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def describe_difference(before: list[list[str]], now: list[list[str]]) -> str:
    """How two sweeps' job lists differ, in a few words: their sizes, then the first jobs that differ."""
    parts = []
    if len(before) != len(now):
        parts.append(f"it had {len(before)} job(s), this one has {len(now)}")
    for number, (old, new) in enumerate(zip(before, now, strict=False)):
        if old != new and len(parts) < 4:
            was = " ".join(o for o in old if o not in new) or "(nothing)"
            becomes = " ".join(o for o in new if o not in old) or "(nothing)"
            parts.append(f"job {number} had {was} where this one has {becomes}")
    return "; ".join(parts)


def unfinished_batches(
    jobs: list[list[str]], finished: set[int], max_batch_size: int | None
) -> list[tuple[int, list[list[str]]]]:
    """The jobs to launch, as (number of the first, jobs): runs of consecutive unfinished jobs (a
    launcher numbers a batch's jobs from its first), each cut to `max_batch_size`."""
    batches: list[tuple[int, list[list[str]]]] = []
    for number, job in enumerate(jobs):
        if number in finished:
            continue
        start, batch = batches[-1] if batches else (-1, [])
        if (
            batches
            and start + len(batch) == number
            and (max_batch_size is None or len(batch) < max_batch_size)
        ):
            batch.append(job)
        else:
            batches.append((number, [job]))
    return batches
