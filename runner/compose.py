"""The command's Hydra: its arguments checked, the config search path as `@hydra.main` builds it (and the
refusal of a user's file that a shipped one would hide there), a single run composed once, and the claim of
a new run's or sweep's dir (`ClaimDirs`). Nothing here imports torch: `python -m runner` composes a run
(`compose_command`) before torch loads, so that a refusal of its config does not wait for it.

Hydra 1.3's `@hydra.main` composes a run's config twice: in MULTIRUN mode to read `hydra.mode` (a config
may ask for a sweep without `-m`), then in RUN mode for the job, 0.1-0.2 s each on a small CPU machine on
the way to every run's first step. `run_composed_once` composes in RUN mode once and runs the job from
that composition as `Hydra.run` does; a command it does not take (a sweep, `--cfg`, `--info`, help, a
config whose `hydra.mode` is MULTIRUN, a composition that fails) goes through `@hydra.main`, which composes
as it always does and raises its own errors.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml
from hydra import version
from hydra._internal.callbacks import Callbacks
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from hydra.core.utils import run_job
from hydra.errors import HydraException, SearchPathException
from hydra.experimental.callback import Callback
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.cluster import launched_environment, launched_node
from runner.config import CONF_DIR, CONF_SEARCH_PATH
from runner.errors import (
    SEARCH_PATH_MISSING,
    ConfigError,
    describe_compose_error,
    describe_missing_search_path,
    describe_yaml_error,
    ending,
)
from runner.group_schemas import PATH_SETTINGS, register_configs

CONFIG_NAME = "config"  # the primary config: conf/config.yaml
VERSION_BASE = "1.3"  # Hydra's defaults of that version (`hydra.job.chdir: false`, ...)
RESUME_LAST = "trainer.resume=last"  # resolved by `runner.cli.resume_last`, which reads the runs' dirs


HELP_FLAGS = {"--help", "-h"}  # runner's own help (runner.cli.help); --hydra-help is Hydra's
# Hydra's options that take a value, and --info's optional one.
VALUE_OPTIONS = (
    *("--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp"),
    *("--cfg", "-c", "--package", "-p", "--experimental-rerun"),
)
INFO_OPTIONS = ("--info", "-i")
INFO_VALUES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def options_first(arguments: list[str]) -> list[str]:
    """`arguments` with Hydra's options (`-m`, `--config-dir conf`, ...) moved before the overrides, in
    their order: Hydra's parser takes them only there, and `runner experiment=mine -m optimizer.lr=1,2` is
    how users type. An override never starts with `-`."""
    options: list[str] = []
    rest: list[str] = []
    taking_value = False
    for argument in arguments:
        if taking_value:
            options.append(argument)
            taking_value = False
        elif argument.startswith("-"):
            options.append(argument)
            taking_value = argument in VALUE_OPTIONS
        elif options and options[-1] in INFO_OPTIONS and argument in INFO_VALUES:
            options.append(argument)
        else:
            rest.append(argument)
    return options + rest


def check_one_mode(args: Any) -> None:
    """ConfigError for Hydra's modes given together (`-m --cfg job`: Hydra raises a bare ValueError)."""
    modes = [
        flag
        for flag, given in (
            ("-m", args.multirun),
            ("--cfg", args.cfg),
            ("--info", args.info),
            ("--run", args.run),
            ("--shell-completion", args.shell_completion),
        )
        if given
    ]
    if len(modes) > 1:
        raise ConfigError(
            f"{' and '.join(modes)} cannot be given together: each is a way to run the command (a sweep, print the "
            "config, print information, one run). To see the config of one job of a sweep, give --cfg job with that "
            "job's values and without -m (optimizer.lr=1e-3, not optimizer.lr=1e-3,1e-2)."
        )


def check_intervals(arguments: list[str]) -> None:
    """ConfigError for a sweep's `interval(low, high)` written backwards (Optuna's sampler would raise a
    ValueError once the sweep started). Arguments that do not parse are left to Hydra to report."""
    parser = OverridesParser.create()
    for argument in arguments:
        if argument.startswith("-") or "interval(" not in argument:
            continue
        try:
            override = parser.parse_override(argument)
        except HydraException:
            continue
        value = override.value()
        if isinstance(value, IntervalSweep) and value.start > value.end:
            raise ConfigError(
                f"{argument}: the interval is written backwards ({value.start:g} > {value.end:g}). Write "
                f"{override.key_or_group}=interval({value.end:g},{value.start:g})."
            )


def checked_arguments(
    arguments: list[str], resolve: Callable[[list[str]], list[str]] = lambda arguments: arguments
) -> list[str]:
    """The command line's arguments, options first and then `resolve`d (`runner.cli.resume_last`), once the
    checks that need no composition pass (a ConfigError otherwise)."""
    arguments = options_first(arguments)
    check_intervals(arguments)
    arguments = resolve(arguments)
    parsed = get_args_parser().parse_args(arguments)
    check_one_mode(parsed)
    check_config_dirs(user_config_dirs(parsed))
    return arguments


def composition_error(err: BaseException) -> ConfigError:
    """What composing the config raised, as the one paragraph the command ends with; `err` itself raised
    again where it is not the config's fault."""
    if isinstance(err, UserWarning):
        return ConfigError(describe_missing_search_path(str(err)))
    if isinstance(err, HydraException | OmegaConfBaseException):
        return ConfigError(describe_compose_error(err))
    if isinstance(err, yaml.YAMLError):  # a config file of the search path (the user's --config-dir)
        return ConfigError(describe_yaml_error(err))
    # Hydra making the job's dir: a file in its place, a read-only or full disk
    if isinstance(err, OSError) and err.errno in (errno.EEXIST, errno.ENOTDIR, errno.EACCES, errno.EROFS, errno.ENOSPC):
        return ConfigError(
            f"the run's dir cannot be made at {err.filename} ({err.strerror}). Give hydra.run.dir "
            "(hydra.sweep.dir with -m) a directory you can write, or a new one."
        )
    raise err


def end_command(err: BaseException) -> NoReturn:
    """The command's end for what stopped it before or after its jobs: one paragraph on stderr, the exit
    status of `runner.errors.ENDINGS`."""
    heading, status = ending(err)
    print(f"{heading}: {err}", file=sys.stderr)
    sys.exit(status)


def command_hydra(config_dir: str | None) -> Hydra:
    """Hydra with the command's search path as `@hydra.main` builds it: Hydra's and runner's groups, then
    `--config-dir`'s, before the structured configs (a shipped option hides a user's of its name, which
    `check_config_dirs` refuses)."""
    version.setbase(VERSION_BASE)
    search_path = create_automatic_config_search_path(None, None, CONF_SEARCH_PATH)
    if config_dir is not None:
        directory = os.path.abspath(config_dir)
        if not os.path.isdir(directory):
            raise SearchPathException(f"Additional config directory '{directory}' not found")
        search_path.prepend("command-line", f"file://{directory}", anchor=SearchPathQuery(provider="schema"))
    return Hydra.create_main_hydra2(task_name="runner", config_search_path=search_path)


def user_config_dirs(args: argparse.Namespace) -> dict[str, str]:
    """The directories of the user's own config groups that Hydra's parsed command line `args` add, each by
    how it was given: `--config-dir`, and the `file://` entries of `hydra.searchpath`, from an override or
    else from the user's primary config (all come after runner's groups in the search path). An override or
    a primary config that does not parse is Hydra's error."""
    dirs = {} if args.config_dir is None else {args.config_dir: f"--config-dir {args.config_dir}"}
    given = [o for o in args.overrides if o.startswith("hydra.searchpath=")]
    try:
        entries = [e for o in OverridesParser.create().parse_overrides(given) for e in o.value() or []]
    except (HydraException, TypeError):
        return dirs
    where = ""
    if not given:  # as Hydra: an override replaces the primary config's own
        entries, where = primary_searchpath(args)
    for entry in entries:
        if isinstance(entry, str) and entry.startswith("file://"):
            dirs.setdefault(entry.removeprefix("file://"), f"hydra.searchpath entry {entry}{where}")
    return dirs


def primary_searchpath(args: argparse.Namespace) -> tuple[list[object], str]:
    """The `hydra.searchpath` of the user's primary config (`--config-name` in `--config-dir`, where Hydra
    reads that key too), and " in <its file>"; nothing where the primary config is runner's own."""
    if args.config_dir is None or args.config_name is None:
        return [], ""
    name = args.config_name if args.config_name.endswith(".yaml") else f"{args.config_name}.yaml"
    path = Path(args.config_dir) / name
    # Runner's own of that name is the one read (`check_config_dirs` refuses the user's); a missing one is
    # Hydra's error.
    if (CONF_DIR / name).is_file() or not path.is_file():
        return [], ""
    try:
        entries = OmegaConf.select(OmegaConf.load(path), "hydra.searchpath")
    except Exception:  # a file that does not load: Hydra's error when it composes
        return [], ""
    return (list(entries), f" in {path}") if isinstance(entries, ListConfig) else ([], "")


def check_config_dirs(dirs: dict[str, str]) -> None:
    """Refuse a user's config dir (`user_config_dirs`) holding files named as runner's own (`model/mlp.yaml`):
    Hydra reads runner's groups first, so those would never be read, and the run would train runner's option
    as if it were the user's."""
    for config_dir, given in dirs.items():
        if not os.path.isdir(config_dir) or Path(config_dir).resolve() == CONF_DIR.resolve():
            continue  # a missing dir is Hydra's error; runner's own conf dir shadows nothing
        shadowed = sorted(
            path.relative_to(config_dir).as_posix()
            for path in Path(config_dir).rglob("*.yaml")
            if (CONF_DIR / path.relative_to(config_dir)).is_file()
        )
        if not shadowed:
            continue
        options = ", ".join(
            f"{name.rpartition('/')[0]}={Path(name).stem}" if "/" in name else name for name in shadowed
        )
        group, _, option = shadowed[0].rpartition("/")
        rename = (
            f"{group}/my_{option} and choose it with {group}=my_{Path(option).stem}"
            if group
            else f"my_{option}"
        )
        raise ConfigError(
            f"{given}: {', '.join(shadowed)} {'has' if len(shadowed) == 1 else 'have'} the name of runner's own "
            f"{options}, which Hydra reads first (runner's groups come before yours in its search path): yours "
            f"would never be read. Rename yours (e.g. {rename})."
        )


def check_hydra_settings(hydra_cfg: DictConfig) -> None:
    """ConfigError for a Hydra setting runner does not take: `hydra.job.chdir=true` (a job run inside its
    own dir), where the config's relative paths (data.path, checkpoint=, a sweep's too) are the user's,
    taken from the directory the command runs in, as the ranks take them."""
    if hydra_cfg.job.get("chdir"):
        raise ConfigError(
            "hydra.job.chdir=true: runner runs each job in the directory you run the command in, so that relative "
            "paths (data.path, checkpoint=, trainer.resume=) mean the same before launch and in every rank; the "
            "job's files go to its run dir (hydra.run.dir) all the same. Leave hydra.job.chdir out."
        )


class ClaimDirs(Callback):
    """Hydra callback (registered in `conf/config.yaml`): a time-stamped run or sweep dir (`${now:...}` in
    `hydra.run.dir` or `hydra.sweep.dir`, as the defaults) names a new run or sweep. It is claimed by
    creating it before anything is written there, and where another command started in the same second
    has it, `<dir>_1`, `<dir>_2`, ... is taken instead (commands started together from a shell loop each
    get their own). A dir named outright is left as it is: running there again resumes its run or sweep
    (or is refused while it runs)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _claim(config.hydra.run)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _claim(config.hydra.sweep):  # each job's config is composed again from the Hydra overrides
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir={config.hydra.sweep.dir}")


def _claim(node: DictConfig) -> bool:
    """Where `node.dir` is time-stamped, create it (else the first of `<dir>_1`, `<dir>_2`, ... that
    is free) and set `node.dir` to it; whether it was. A dir that cannot be made is left to the run's
    own check, which refuses it saying why (a callback's exception would be only Hydra's warning)."""
    if "${now:" not in str(OmegaConf.to_container(node, resolve=False)["dir"]):
        return False
    base = claimed = Path(node.dir)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for number in itertools.count(1):
            try:
                claimed.mkdir()
                break
            except FileExistsError:
                claimed = base.with_name(f"{base.name}_{number}")
    except OSError:
        return False
    node.dir = str(claimed)
    return True


@dataclass
class Composed:
    """One run's config as the command composed it, with the checked arguments and the Hydra that did."""

    arguments: list[str]
    hydra: Hydra
    config_name: str
    cfg: DictConfig


def compose_command(arguments: list[str]) -> Composed | None:
    """The command's one run composed before torch loads (`python -m runner` calls this first): its
    arguments checked and its config composed against `runner.group_schemas`, a refusal of either raised
    as the ConfigError the command ends with. None, having composed nothing, for what `runner.cli.run`
    takes as it is: a subcommand, help, a sweep or another of Hydra's modes, `trainer.resume=last`, a
    rank or a pod of a launched job."""
    if (
        (arguments and not arguments[0].startswith("-") and "=" not in arguments[0])  # a subcommand
        or HELP_FLAGS & set(arguments)
        or RESUME_LAST in arguments
        or launched_environment() is not None
        or launched_node() is not None
    ):
        return None
    register_configs()
    arguments = checked_arguments(arguments)
    try:
        with warnings.catch_warnings():
            # Hydra only warns about a search path entry that is not there; its options then go missing.
            warnings.filterwarnings("error", message=SEARCH_PATH_MISSING, category=UserWarning)
            composed = composed_run(get_args_parser().parse_args(arguments), arguments)
    except (UserWarning, HydraException, OmegaConfBaseException, yaml.YAMLError, OSError) as err:
        GlobalHydra.instance().clear()
        raise composition_error(err) from None
    if composed is None:
        GlobalHydra.instance().clear()
    elif problems := path_problems(composed.cfg):
        GlobalHydra.instance().clear()
        raise ConfigError("\n\n".join(problems))
    return composed


def path_problems(cfg: DictConfig) -> list[str]:
    """What the settings of a shipped option name that is not there (`group_schemas.PATH_SETTINGS`, the
    `Exists` its class declares): a missing data file is refused before torch loads, in the words its
    class's constructor would use."""
    problems = []
    for node in cfg:
        try:
            node_cfg = cfg[node]
            declared = PATH_SETTINGS.get(node_cfg.get("_target_")) if isinstance(node_cfg, DictConfig) else None
            for key, exists in (declared or {}).items():
                if (problem := exists.problem(f"{node}.{key}", node_cfg.get(key))) is not None:
                    problems.append(problem)
        except OmegaConfBaseException:  # a value given later (`???`) or resolved later: checked before launch
            continue
    return problems


def composed_run(args: argparse.Namespace, arguments: list[str]) -> Composed | None:
    """The config that Hydra's parsed command line `args` compose in RUN mode, as `@hydra.main` would (what
    composing raises is raised); None, having composed nothing, where the command is not one run:
    `-m`, `--cfg`, `--info`, help, completion, `--config-path`, or a config that sets `hydra.mode` to
    MULTIRUN (Hydra's own path takes it then)."""
    if (
        args.multirun
        or args.cfg
        or args.info
        or args.help
        or args.hydra_help
        or args.shell_completion
        or args.resolve
        or args.experimental_rerun is not None
        or args.config_path is not None
    ):
        return None
    config_name = args.config_name or CONFIG_NAME
    hydra = command_hydra(args.config_dir)
    cfg = hydra.compose_config(config_name, list(args.overrides), run_mode=RunMode.RUN, with_log_configuration=True)
    if cfg.hydra.mode == RunMode.MULTIRUN:
        return None
    if cfg.hydra.mode is None:  # what `@hydra.main` adds for a run that no config gave a mode
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
    return Composed(arguments, hydra, config_name, cfg)


def run_composed(composed: Composed, task_function: TaskFunction) -> None:
    """Run `task_function` on the composed config, as `Hydra.run` does."""
    cfg, config_name = composed.cfg, composed.config_name
    try:
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name=config_name)
        job = run_job(
            hydra_context=HydraContext(config_loader=composed.hydra.config_loader, callbacks=callbacks),
            task_function=task_function,
            config=cfg,
            job_dir_key="hydra.run.dir",
            job_subdir_key=None,
        )
        callbacks.on_run_end(config=cfg, config_name=config_name, job_return=job)
        _ = job.return_value  # raises what the job raised
    finally:
        GlobalHydra.instance().clear()


def run_composed_once(args: argparse.Namespace, task_function: TaskFunction) -> bool:
    """Run `task_function` on the config that Hydra's parsed command line `args` compose, as `Hydra.run`
    does, composing it once. False, having run nothing, where the command is not one run (`composed_run`)
    or its config does not compose (`@hydra.main` composes it again and raises its error)."""
    try:
        composed = composed_run(args, [])
    except Exception:
        composed = None
    if composed is None:
        GlobalHydra.instance().clear()
        return False
    run_composed(composed, task_function)
    return True
