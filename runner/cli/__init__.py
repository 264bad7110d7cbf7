"""`python -m runner`: compose the config with Hydra, validate it, launch the ranks, return the metrics."""

from __future__ import annotations

import atexit
import copy
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
import yaml
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.errors import HydraException, InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hydra_plugins.runner_launcher.launcher import RunnerLauncher
from hydra_plugins.runner_sweeper.resumable_sweeper import ResumableSweeper
from runner.build import fast_dev_run, is_inference, locate, records_goodput
from runner.checkpoint.resume import check_finished_run, check_resume, latest_run
from runner.cli.estimate_memory import main as estimate_memory_command
from runner.cli.export import main as export_command
from runner.cli.help import help_text
from runner.cli.init import main as init_project_command
from runner.cli.join import main as join_command
from runner.cli.prepare_data import main as prepare_data_command
from runner.cli.runs import main as runs_command
from runner.cluster import ClusterEnvironment, launched_environment, time_before_start
from runner.compose import (
    CONFIG_NAME,
    HELP_FLAGS,
    RESUME_LAST,
    VERSION_BASE,
    Composed,
    check_hydra_settings,
    checked_arguments,
    composition_error,
    end_command,
    run_composed,
    run_composed_once,
)
from runner.config import CONF_SEARCH_PATH
from runner.errors import (
    EXIT_INTERRUPTED,
    SEARCH_PATH_MISSING,
    ConfigError,
    DataNotPrepared,
    JobFailed,
    RankFailedError,
    TrainingInterrupted,
    TrainingStopped,
    describe_compose_error,
    describe_exception,
    ending,
    raise_terminated,
    signal_name,
    write_failure,
)
from runner.files import write_json
from runner.group_schemas import register_configs
from runner.inference import infer
from runner.launchers import Job
from runner.launchers.base import interrupted
from runner.plan import describe as describe_plan
from runner.run_dir import (
    ENDED,
    FAILED,
    GOODPUT,
    JOB_CONFIG_DIR,
    RESOLVED,
    RUNS_DIR,
    FinishedRun,
    ending_recorded,
    record_ending,
)
from runner.run_dir.lock import run_dir_lock
from runner.run_dir.log import FILE_ONLY, configure_rank_logging
from runner.telemetry.console import goodput_said, metrics_table
from runner.telemetry.goodput import Ledger, end_of_command, job_began
from runner.telemetry.goodput import table as goodput_table
from runner.train import evaluate_weights, train
from runner.validate import Built, check_job

log = logging.getLogger("runner")



def main(cfg: DictConfig) -> float | dict[str, float]:
    """One job: validate, then the launcher runs its ranks. Rank 0's final metrics (also in the job dir's
    `metrics.json`) are returned: `trainer.objective` among them is what Hydra's sweepers get."""
    started = time.time()
    spent = None  # the goodput ledger's sum, once the job ended
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    env = launched_environment()
    if env is not None and env.rank != 0:  # every task of a SLURM sweep job runs this; rank 0 logs
        configure_rank_logging(None, env.rank)
    owned = ExitStack()  # the run dir's lock, for the command's life (ranks a launcher started hold none)
    if threading.current_thread() is threading.main_thread():
        # Until the loop records stop signals (and after it), a SIGTERM stops the job where it is, as a Ctrl-C.
        owned.callback(signal.signal, signal.SIGTERM, signal.signal(signal.SIGTERM, raise_terminated))
    try:
        check_hydra_settings(hydra_cfg)
        if env is None:
            owned.enter_context(run_dir_lock(output_dir))
        fast_dev_run(cfg)
        built, world_size, checkpoint, finished = checks_before_launch(cfg, output_dir, env)
        if cfg.plan:
            _print_plan(cfg, built, world_size, checkpoint, finished)
            return {}
        if finished is not None:
            log.info("%s: nothing to train.%s", finished.describe(), AGAIN)
            built.launcher.skip(f"{finished.describe()}: nothing to train")
            metrics = {k: v for k, v in finished.metrics.items() if v is not None}
        else:
            if built.tracker is not None and (env is None or env.rank == 0):
                built.tracker.warm_up(output_dir)
            metrics, spent = _launched(cfg, _job(cfg, hydra_cfg, output_dir, env, built), built, env)
    except (Exception, KeyboardInterrupt) as err:
        with ending_recorded(output_dir, err):
            _ended(err, hydra_cfg, output_dir, started)
    finally:
        owned.close()
    record_ending(output_dir, 0)
    if not metrics:  # queued, not waited for (launcher.wait=false)
        return metrics
    _say_results(output_dir, metrics, spent, full=cfg.trainer.console == "full")
    return _objective(cfg, metrics)


def _say_results(
    output_dir: Path, metrics: dict[str, float], spent: dict[str, Any] | None, full: bool
) -> None:
    """The final metrics and the time spent, as `trainer.console` has them said; the log file keeps the
    goodput table whole."""
    log.info("final metrics (output dir %s):\n%s", output_dir, metrics_table(metrics, full))
    if spent is not None:
        said = goodput_said(spent, full)
        log.info("time spent (%s):\n%s", output_dir / GOODPUT, said)
        if said != (whole := goodput_table(spent)):
            log.info("time spent (%s):\n%s", output_dir / GOODPUT, whole, extra=FILE_ONLY)


# Hydra's own entry for what `run_composed_once` leaves to it: a sweep, --cfg, --info, a config asking for
# MULTIRUN, a composition error.
hydra_main = hydra.main(version_base=VERSION_BASE, config_path=CONF_SEARCH_PATH, config_name=CONFIG_NAME)(
    main
)


# What the same command says in the dir of a finished run: how to train it again.
AGAIN = (
    " To train it again, set trainer.overwrite=true (its files move into replaced-<time>/) or give another "
    "hydra.run.dir."
)


def checks_before_launch(
    cfg: DictConfig, output_dir: Path, env: ClusterEnvironment | None
) -> tuple[Built, int, Path | None, FinishedRun | None]:
    """Every check before launch (the config, the hardware and the launcher built; a finished run in the
    dir, which is neither replaced nor trained again; the checkpoint to resume from): what was built, the
    number of ranks, the checkpoint, the finished run (None: the run goes ahead)."""
    if cfg.trainer.fast_dev_run and (output_dir / RESOLVED).exists():
        raise ConfigError(
            f"trainer.fast_dev_run={cfg.trainer.fast_dev_run} in {output_dir}, the dir of a run: a check run "
            "would replace its history and config. Leave hydra.run.dir (and trainer.resume=last) out for a new dir."
        )
    with _checking():
        built, world_size = check_job(cfg)
        # One process checks the files (and moves a damaged latest aside): rank 0 under torchrun/srun.
        verify = env is None or env.rank == 0
        training = not is_inference(cfg.task._target_) and cfg.mode != "evaluate"
        settings = OmegaConf.to_container(_resolved(cfg))
        # A training run must not replace a finished run's results (an inference run's are made again
        # from the same weights), nor resume one of its checkpoints, which may be older than its end.
        finished = None
        if verify and training:
            finished = check_finished_run(
                output_dir,
                settings,  # type: ignore[arg-type]
                resume=cfg.trainer.resume,
                overwrite=cfg.trainer.overwrite,
                dry_run=cfg.plan,
            )
        if finished is not None:
            if env is not None:  # the other ranks, started by torchrun or srun, would wait for this one
                raise ConfigError(f"{finished.describe()}: nothing to train, so no rank runs.{AGAIN}")
            return built, world_size, None, finished
        checkpoint = check_resume(
            cfg.trainer.resume,
            output_dir,
            world_size=world_size,
            checkpoint_format=built.hardware.checkpoint_format,
            reshards=built.hardware.reshards_checkpoints,
            readers=built.hardware.data_parallel_size(world_size),
            split_batches=cfg.trainer.split_batches,
            # the run's one optimizer; an inference task has none
            optimizer_class=locate(cfg.optimizer._target_) if training else None,
            verify=verify,
            settings=settings if verify and training else None,  # type: ignore[arg-type]
            max_steps=cfg.trainer.max_steps if training else None,
            model=built.blueprint.model if built.blueprint is not None else None,
            data_identity=built.blueprint.data.identity() if built.blueprint is not None else None,
        )
    return built, world_size, checkpoint, None


def _print_plan(
    cfg: DictConfig, built: Built, world_size: int, checkpoint: Path | None, finished: FinishedRun | None
) -> None:
    """`plan=true`: what the run would do, from what the checks built."""
    if finished is not None:
        print(f"{finished.describe()}: nothing would run.{AGAIN}")
        return
    with _checking():
        line = built.launcher.describe(cfg, built.hardware)
        resume_from = str(checkpoint) if checkpoint else None
        print(describe_plan(cfg, built.hardware, world_size, line, resume_from, built.blueprint))


def _job(
    cfg: DictConfig, hydra_cfg: DictConfig, output_dir: Path, env: ClusterEnvironment | None, built: Built
) -> Job:
    """The job the launcher runs; its config saved in its dir (by rank 0), and a sweep's parent run made."""
    if env is None or env.rank == 0:
        _save_job_config(cfg, hydra_cfg, output_dir)
        for past in (FAILED, ENDED):  # a job run again in its dir: how the last one ended is past
            (output_dir / past).unlink(missing_ok=True)
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.tracker._target_ and not cfg.tracker.parent_run_id:
        # One parent run per sweep; each job's run is its child.
        cfg.tracker.parent_run_id = instantiate(cfg.tracker).parent_for_sweep(Path(hydra_cfg.sweep.dir))
    return Job(
        cfg=_resolved(cfg),
        output_dir=output_dir,
        entry=infer
        if is_inference(cfg.task._target_)
        else evaluate_weights
        if cfg.mode == "evaluate"
        else train,
        logging_config=OmegaConf.to_container(hydra_cfg.job_logging, resolve=True),  # type: ignore[arg-type]
        strategy=built.hardware,
        blueprint=built.blueprint,
    )


def _launched(
    cfg: DictConfig, job: Job, built: Built, env: ClusterEnvironment | None
) -> tuple[dict[str, float], dict[str, Any] | None]:
    """The launcher runs the job: its metrics, and the goodput ledger's sum (None: not recorded here, or the
    job goes on). The command's own start is the ledger's first phase; its end is the last."""
    recorded = records_goodput(cfg) and (env is None or env.rank == 0)
    ledger = Ledger(job.output_dir if recorded else None, job_began(), time_before_start("stopped"))
    ledger.lap("startup")
    try:
        metrics = built.launcher.launch(job)
    except (TrainingInterrupted, KeyboardInterrupt):
        raise  # the run goes on later (resumed, requeued, or queued still): so does its ledger
    except BaseException:
        if recorded:
            with suppress(OSError):  # the job's own error is what the command reports
                end_of_command(job.output_dir)
        raise
    if not (recorded and metrics):
        return metrics, None
    if HydraConfig.get().mode == RunMode.RUN:
        CLOSING.append(job.output_dir)
    return metrics, end_of_command(job.output_dir)


def _objective(cfg: DictConfig, metrics: dict[str, float]) -> float | dict[str, float]:
    """What Hydra's sweepers get: `trainer.objective` among the final metrics, or all of them (null)."""
    objective = cfg.trainer.objective
    if objective is None:
        return metrics
    if objective not in metrics:
        log.error(
            "Configuration error: trainer.objective=%s is not among the final metrics (%s). Name one of those, "
            "or null to return them all.",
            objective,
            ", ".join(metrics),
        )
        sys.exit(2)
    return metrics[objective]


# What ends a job in one paragraph of its own (`runner.errors.ENDINGS`); any other error a rank raised is
# a failure in the user's frames.
REPORTED = (ConfigError, InstantiationException, RankFailedError, TrainingInterrupted, TrainingStopped)


def _ended(err: BaseException, hydra_cfg: DictConfig, output_dir: Path, started: float) -> NoReturn:
    """End the job that `err` stopped: its one paragraph (the whole traceback to the log file only) and its
    exit status (`runner.errors.ENDINGS`; a Ctrl-C before the loop, 128 + the signal); a failure goes
    through `_failed`. An OSError that is not a full or unwritable disk is raised again."""
    if isinstance(err, KeyboardInterrupt):
        # A Ctrl-C or SIGTERM before the loop started, or a second Ctrl-C: no checkpoint now.
        signum = getattr(err, "signum", signal.SIGINT)
        log.warning("Training interrupted: %s", interrupted(signal_name(signum), output_dir, since=started))
        sys.exit(128 + signum)  # as the shell reports a process that the signal ended (130 for Ctrl-C)
    if not isinstance(err, REPORTED):
        if isinstance(err, OSError):  # the job's own files (its config, metrics) on a full or read-only disk
            if (reason := write_failure(err)) is None:
                raise err
            log.error(
                "Training stopped: the run could not write to %s: %s. Free space or fix the permissions there, "
                "or give the run another dir (hydra.run.dir=...).",
                output_dir,
                reason,
            )
            sys.exit(1)
        # the one rank this process ran raised: the user's frames; the rest in the log
        log.error("Training failed: %s", describe_exception(err))
        log.info("%s", "".join(traceback.format_exception(err)), extra=FILE_ONLY)
        _failed(hydra_cfg, output_dir, f"Training failed: {type(err).__name__}: {err}")
    if isinstance(err.__cause__, ConfigError):  # a class the config names refused its arguments
        err = err.__cause__
    elif isinstance(err, InstantiationException):
        err = ConfigError(str(err))
    heading, status = ending(err)
    log.log(logging.WARNING if status == EXIT_INTERRUPTED else logging.ERROR, "%s: %s", heading, err)
    if details := getattr(err, "details", None):
        log.info("%s", details, extra=FILE_ONLY)
    if status == 1:
        _failed(hydra_cfg, output_dir, f"{heading}: {err}")
    sys.exit(status)


def _failed(hydra_cfg: DictConfig, output_dir: Path, message: str) -> NoReturn:
    """End a job whose training failed: exit 1; a job of a sweep records why in its dir (`failed.json`,
    for the sweep's summary) and raises JobFailed instead, so that the sweep goes on to its next job."""
    if hydra_cfg.mode != RunMode.MULTIRUN:
        sys.exit(1)
    write_json(output_dir / FAILED, {"message": message}, indent=None)
    raise JobFailed(message)


def leave_the_heap() -> None:
    """The command's last exit handler: finalise what the run left as cyclic garbage (a writer closing its
    file, say), close the goodput ledger of the run this command ran (its `finish` ends here, as late as
    the command sees), then exempt the rest from the collections of the interpreter's shutdown, which
    would walk the whole heap (torch, its compiler, Hydra) again: about 0.5 s of every command's exit."""
    gc.collect()
    while CLOSING:
        with suppress(OSError):  # the run ended and said so: its ledger's last moments are no error
            end_of_command(CLOSING.pop())
    gc.freeze()


# The run dir whose goodput ledger the command closes at its exit (`leave_the_heap`); a sweep's jobs close
# theirs as they end.
CLOSING: list[Path] = []


def run(composed: Composed | None = None) -> None:
    """Console entry point (`runner`, `python -m runner`): composition errors become one paragraph on stderr
    and exit code 2. `composed`: the run `runner.compose.compose_command` composed already (before torch
    loaded). `runner init <dir>` writes a starter project instead, `runner prepare-data <overrides>` the
    token shards of the data they compose, `runner estimate-memory <overrides>` the model's memory."""
    register_configs()
    if sys.argv[1:2] and sys.argv[1] in SUBCOMMANDS:  # never a Hydra override (those hold a `=`)
        _run_subcommand(sys.argv[1], sys.argv[2:])
        return
    for plugin in (ResumableSweeper, RunnerLauncher):
        Plugins.instance().register(plugin)  # Hydra's scan misses them in an editable install
    try:
        sys.argv[1:] = composed.arguments if composed else checked_arguments(sys.argv[1:], resume_last)
    except ConfigError as err:
        end_command(err)
    _importable_cwd()
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra raise instead of printing its own report
    env = launched_environment()
    if env is not None and env.rank != 0:
        sys.argv += _scratch_output_dir(env.rank)
    try:
        with warnings.catch_warnings():
            # Hydra only warns about a search path entry that is not there; its options then go missing.
            warnings.filterwarnings("error", message=SEARCH_PATH_MISSING, category=UserWarning)
            _answer(composed)
    except (UserWarning, HydraException, OmegaConfBaseException, yaml.YAMLError, OSError) as err:
        end_command(composition_error(err))
    # What a sweep's launcher raises (`Launcher.launch_sweep`): its jobs refused before any is queued, a
    # job whose tasks died on SLURM, or the wait for them stopped.
    except (ConfigError, RankFailedError, TrainingInterrupted, TrainingStopped) as err:
        end_command(err)


def _answer(composed: Composed | None) -> None:
    """Help, or the command's run (`composed`, else composed here), or what Hydra's own main takes."""
    if HELP_FLAGS & set(sys.argv[1:]):
        print(help_text(sys.argv[1:], width=shutil.get_terminal_size().columns))
    elif composed is not None:
        run_composed(composed, main)
    elif not run_composed_once(get_args_parser().parse_args(), main):
        hydra_main()


SUBCOMMANDS = {
    "init": init_project_command,
    "prepare-data": prepare_data_command,
    "estimate-memory": estimate_memory_command,
    "runs": runs_command,
    "export": export_command,
    "join": join_command,
}


def _run_subcommand(name: str, arguments: list[str]) -> None:
    """`runner init`, `runner prepare-data` or `runner estimate-memory`, its errors ended as the command's."""
    try:
        SUBCOMMANDS[name](arguments)
    except (HydraException, OmegaConfBaseException) as err:
        end_command(ConfigError(describe_compose_error(err)))
    except (ConfigError, DataNotPrepared) as err:
        end_command(err)


def resume_last(arguments: list[str]) -> list[str]:
    """`trainer.resume=last` (as Lightning's `ckpt_path="last"`): the command runs again in the dir of
    outputs/runs that a run of the same `experiment=` wrote last (`latest_run`: by time, not by name),
    resuming its latest checkpoint (a changed setting is refused there as in any resume, a finished run
    trains nothing); ConfigError where there is none, or two tie, or with a sweep or a run dir of its own."""
    asked = RESUME_LAST
    if asked not in arguments:
        return arguments
    if any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in arguments) or {
        "-m",
        "--multirun",
    } & set(arguments):
        raise ConfigError(
            f"{asked} picks the run dir itself (the one of {RUNS_DIR} written last); it takes no hydra.run.dir and no sweep "
            "(-m: a sweep resumes with its own command). Give trainer.resume=auto hydra.run.dir=<the run's dir> instead."
        )
    chosen = [a.split("=", 1)[1] for a in arguments if a.startswith("experiment=")]
    experiment = chosen[-1] if chosen else None
    latest = latest_run(Path(RUNS_DIR), experiment)
    if latest is None:
        raise ConfigError(
            f"{asked}: {Path(RUNS_DIR).absolute()} holds no run of "
            f"{f'experiment={experiment}' if experiment else 'the default experiment'} to resume. Run it first "
            "(without trainer.resume), or name a checkpoint: trainer.resume=<dir>."
        )
    which = f"experiment={experiment}" if experiment else "the default experiment"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(latest.written))
    before = f"; the one before it: {latest.runner_up}" if latest.runner_up else ""
    print(
        f"{asked}: resuming {latest.run_dir} (the run of {which} written last: {latest.what} at {when}{before})",
        file=sys.stderr,
    )
    return [a for a in arguments if a != asked] + ["trainer.resume=auto", f"hydra.run.dir={latest.run_dir}"]


def _importable_cwd() -> None:
    """The directory the command runs in is importable (as `python -m` makes it), for the `runner` console
    script too: a user's `_target_: mypkg.nets.MyNet` finds ./mypkg without PYTHONPATH."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _scratch_output_dir(rank: int) -> list[str]:
    """Started by torchrun or srun, every rank runs this CLI, but a job has one output dir: rank 0's.
    The others get a throw-away dir for Hydra (deleted at exit) and use rank 0's, which the Accelerator
    broadcasts, for everything they write."""
    scratch = tempfile.mkdtemp(prefix=f"runner-rank{rank}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null"]


@contextmanager
def _checking() -> Iterator[None]:
    """Run the checks (which build user objects) on one torch thread: once OpenMP's threads have run in a
    process, ranks forked from it hang at their first parallel op. And with the cyclic collector paused, as
    for the command's imports (`runner.__main__`): the meta step imports `torch._dynamo` (0.2 s less here)."""
    threads, collecting = torch.get_num_threads(), gc.isenabled()
    torch.set_num_threads(1)
    gc.disable()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if collecting:
            gc.enable()


def _save_job_config(cfg: DictConfig, hydra_cfg: DictConfig, output_dir: Path) -> None:
    """What Hydra writes into `.hydra/` at a job's start (the config, Hydra's own, the overrides), written
    here once the job passed its checks instead (`hydra.output_subdir: null` in conf/config.yaml)."""
    directory = output_dir / JOB_CONFIG_DIR
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "config.yaml": cfg,
        "hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}),
        "overrides.yaml": hydra_cfg.overrides.task,
    }
    for name, node in files.items():
        (directory / name).write_text(OmegaConf.to_yaml(node))


def _resolved(cfg: DictConfig) -> DictConfig:
    """A copy with every interpolation resolved (ranks cannot resolve `${hydra:...}`)."""
    resolved = copy.deepcopy(cfg)
    OmegaConf.resolve(resolved)
    return resolved
