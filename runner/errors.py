"""Errors that reach the user as one paragraph (which key, what was expected, how to fix) instead of a
traceback."""

from __future__ import annotations

import dataclasses
import difflib
import errno
import functools
import importlib.util
import os
import re
import signal
import sysconfig
import traceback
from pathlib import Path
from typing import get_origin

import yaml
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError


class ConfigError(ValueError):
    """A problem with the user's configuration or inputs, found before training starts. `details` (the
    traceback of the user's code that raised, say) go to the run's log file, not to the console."""

    def __init__(self, message: str, details: str | None = None) -> None:
        super().__init__(message)
        self.details = details


# This project's name on PyPI (pyproject's project.name); the import package and the command are `runner`.
DISTRIBUTION = "runner-ml"


def install_command(extra: str, *flags: str) -> str:
    """The command that adds the packages of this project's `extra`, as every message gives it. With this
    project installed (from PyPI, a wheel or a checkout, editable too), pip reads the extra from it."""
    return " ".join(["pip install", *flags, f"'{DISTRIBUTION}[{extra}]'"])


# Config group options that Hydra plugins provide: the extra that brings each.
HYDRA_PLUGINS = {"optuna": "sweeps"}

# Hydra plugins' options that runner does its own way, installed or not: what to use instead.
REPLACED_OPTIONS = {
    "hydra/launcher=submitit_slurm": (
        "hydra/launcher=submitit_slurm: runner runs a sweep on SLURM with its own launcher and the same keys as one "
        "run: add launcher=slurm to the sweep (`python -m runner -m launcher=slurm launcher.partition=... "
        "optimizer.lr=1e-3,1e-4`); its jobs are queued as SLURM arrays, one task per rank. The plugin's keys map "
        "to launcher.*: partition, nodes, gpus_per_node, cpus_per_task, mem_gb, timeout_min -> time_min, "
        "account, qos, constraint, setup, additional_parameters -> sbatch_args, srun_args, max_num_timeout -> "
        "max_timeouts, submitit_folder -> folder, name; tasks_per_node is hardware.num_processes."
    ),
    "hydra/launcher=submitit_local": (
        "hydra/launcher=submitit_local: runner runs a sweep's jobs here one after another with the default "
        "launcher, each starting its own ranks: leave hydra/launcher out."
    ),
}


def describe_compose_error(err: Exception) -> str:
    """One paragraph for an error Hydra raised while composing the config (naming the YAML file for one
    found in a file: "In 'experiment/mine': ...")."""
    cause = _omegaconf_cause(err) or err
    in_file = re.match(r"In '([^']+)': ", str(err))
    if in_file and cause is not err:
        return f"{in_file.group(1)}.yaml: {_describe_omegaconf_error(cause)}"
    missing_dir = re.fullmatch(r"Additional config directory '(.*)' not found", str(err))
    if missing_dir:
        return (
            f"--config-dir {missing_dir.group(1)}: no such directory. Pass the folder that holds your config groups "
            "(model/, data/, experiment/, ...), relative to the directory you run in, e.g. `runner --config-dir "
            "./conf experiment=mine`; `runner init <dir>` writes a starter project with one."
        )
    if isinstance(err, OverrideParseException):
        return _unparsed_override(err)
    if isinstance(err, MissingConfigException) and err.options is not None:
        group, _, option = (err.missing_cfg_file or "").rpartition("/")
        if f"{group}={option}" in REPLACED_OPTIONS:
            return REPLACED_OPTIONS[f"{group}={option}"]
        if option in HYDRA_PLUGINS:
            return (
                f"{group}={option}: that option comes from a Hydra plugin that is not installed. Install it with "
                f"`{install_command(HYDRA_PLUGINS[option])}`."
            )
        return (
            f"{group}={option}: there is no option {option!r} in the config group {group!r}. "
            f"Available: {', '.join(sorted(err.options))}. Pick one of those, or add {group}/{option}.yaml to your config dir (`runner --config-dir ./conf ...`)."
        )
    return _describe_omegaconf_error(cause)


def _unparsed_override(err: OverrideParseException) -> str:
    """An override Hydra's grammar cannot read: a value with non-ASCII letters, `=`, spaces or quotes
    needs quotes of its own, inside the shell's."""
    reason = " ".join(err.message.split()).split(" See https://")[0]
    key, sep, value = err.override.partition("=")
    if not sep or value[:1] in ("'", '"'):
        return f"{err.override}: Hydra cannot read this override ({reason}). See {OVERRIDE_GRAMMAR}."
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return (
        f"{err.override}: Hydra cannot read this value unquoted ({reason}): a value holding letters beyond "
        f"ASCII, `=`, spaces or quotes must be quoted for Hydra, inside the shell's quotes: "
        f"'{key}=\"{escaped}\"'. See {OVERRIDE_GRAMMAR}."
    )


OVERRIDE_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def _omegaconf_cause(err: BaseException) -> OmegaConfBaseException | None:
    """The OmegaConf error that `err` was raised from or while handling (Hydra wraps them), if any."""
    seen = err.__cause__ or err.__context__
    while seen is not None and not isinstance(seen, OmegaConfBaseException):
        seen = seen.__cause__ or seen.__context__
    return seen


def _describe_omegaconf_error(cause: BaseException) -> str:
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        return _unknown_key(cause)
    if isinstance(cause, ValidationError) and cause.full_key:
        expected = cause.msg.split("\n")[0]
        return (
            f"{cause.full_key}: {expected}. Give a value of the type the schema declares in runner/config.py."
        )
    return " ".join(line.strip() for line in str(cause).splitlines() if line.strip())


SEARCH_PATH_MISSING = r"provider=.*, path=.* is not available\."  # what Hydra warns


def describe_missing_search_path(warning: str) -> str:
    """One paragraph for a config search path entry (`hydra.searchpath`) that does not exist."""
    found = re.search(r"path=(.*) is not available", warning)
    entry = found.group(1) if found else warning
    return (
        f"hydra.searchpath: {entry!r} is not there (no folder {os.path.abspath(entry)}, nor an installed package of "
        "that name), so the config options in it cannot be found. Give the folder that holds your config groups, "
        "relative to the directory you run in (hydra.searchpath=[file://conf], or --config-dir ./conf), or "
        "pkg://<module> of an installed package."
    )


def _unknown_key(cause: OmegaConfBaseException) -> str:
    key = str(cause.key)
    parent = cause.full_key.rpartition(".")[0]
    node = cause.parent_node
    if isinstance(node, DictConfig) and get_origin(node._metadata.ref_type) is dict and parent:
        # a mapping of the user's own keys (launcher.env): Hydra merges `parent={...}` into it, adding none
        return (
            f"{cause.full_key}: {parent} holds keys of your own, and Hydra adds none to it from `{parent}={{...}}` "
            f"(it merges that mapping into the one there). Add the key with +{cause.full_key}=<value>, or give the "
            f"whole mapping with ++{parent}={{{key}: <value>}}."
        )
    if dataclasses.is_dataclass(cause.object_type):
        valid = [f.name for f in dataclasses.fields(cause.object_type)]
    elif isinstance(cause.parent_node, DictConfig):
        valid = [str(k) for k in cause.parent_node]
    else:
        valid = []
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    where = f"{parent!r}" if parent else "the top level"
    return (
        f"{cause.full_key}: there is no key {key!r} in {where}.{hint} "
        f"Valid keys: {', '.join(valid) or '(none)'}. Check the spelling in your YAML or on the command line."
    )


EXIT_REFUSED = 2  # a config refused before anything started (as argparse and Hydra exit)
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by a signal after checkpointing; run the same command again


def signal_name(signum: int | None) -> str:
    """How a stop signal is named to the user: "Ctrl-C" for SIGINT, else its name ("a signal": unknown)."""
    if signum is None:
        return "a signal"
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class JobFailed(Exception):
    """A job of a sweep whose training failed (diverged, a rank failed): its dir records why
    (`failed.json`), Hydra records the job as failed, and the sweep goes on to its next job."""


class TrainingInterrupted(Exception):
    """Training stopped on SIGTERM, SIGUSR1 or SIGUSR2 after writing a checkpoint it can resume from.

    Args:
        signum: the signal that stopped it, where known (SLURM's preemption signal means: requeue).
    """

    def __init__(self, message: str, signum: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum


class Terminated(KeyboardInterrupt):
    """A stop signal (SIGTERM) that came before the training loop records signals: the run stops where it
    is, as on a Ctrl-C, with nothing new to resume from (`signum` says which signal; exit 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_terminated(signum: int, frame: object) -> None:
    """A signal handler: raise Terminated in the main thread."""
    raise Terminated(signum)


class TrainingStopped(RuntimeError):
    """The run cannot go on, for a reason one paragraph says (exit 1, no traceback)."""


class DataNotPrepared(RuntimeError):
    """`runner prepare-data` could not write its shards (a full disk, a read-only dir): one paragraph, exit 1."""


class TrainingDiverged(TrainingStopped):
    """A metric became NaN or infinite: the run stops instead of training on, or reporting, garbage."""


class RendezvousError(TrainingStopped):
    """The ranks of a job did not all meet: which did not, and on which hosts."""


class RankFailedError(RuntimeError):
    """A rank of the job raised or was killed; the other ranks were stopped. `details` (the whole
    traceback) go to the run's log file, not to the console."""

    def __init__(self, message: str, details: str | None = None) -> None:
        super().__init__(message)
        self.details = details


# What ended a command -> the heading of the one paragraph that says so, and the command's exit status:
# 2, the command is wrong and nothing ran; 75 (EX_TEMPFAIL), stopped after a checkpoint: run it again;
# 1, the training failed. The first kind an error is decides.
ENDINGS: tuple[tuple[type[BaseException], str, int], ...] = (
    (ConfigError, "Configuration error", EXIT_REFUSED),
    (TrainingInterrupted, "Training interrupted", EXIT_INTERRUPTED),
    (RankFailedError, "Training failed", 1),
    (TrainingStopped, "Training stopped", 1),
    (DataNotPrepared, "Data not prepared", 1),
)


def ending(err: BaseException) -> tuple[str, int]:
    """The heading and exit status of a command that `err` ended (`ENDINGS`; any other: a failure)."""
    return next(
        ((heading, status) for kind, heading, status in ENDINGS if isinstance(err, kind)),
        ("Training failed", 1),
    )


_WRITE_FAILURES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
}


def write_failure(err: BaseException) -> str | None:
    """Why `err` (or what caused it) failed to write a file, when the disk is full or not writable; else None.
    Also for errors that only quote the OS error (safetensors: "... (os error 28)")."""
    while err is not None:
        code = err.errno if isinstance(err, OSError) else None
        if code is None and (found := re.search(r"os error (\d+)", str(err))):
            code = int(found.group(1))
        if code in _WRITE_FAILURES:
            where = f" ({err.filename})" if isinstance(err, OSError) and err.filename else ""
            return f"{_WRITE_FAILURES[code]}{where}"
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return None


def describe_yaml_error(err: yaml.YAMLError) -> str:
    """One paragraph for a config file that is not valid YAML: the file, the line and column, the problem."""
    mark = getattr(err, "problem_mark", None)
    where = (
        f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}"
        if mark is not None
        else "a config file"
    )
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    return (
        f"{where}: not valid YAML ({problem}{'; ' + context if context else ''}). Fix the syntax there (a bracket or "
        "quote left open, a tab for indentation, a missing space after a colon)."
    )


@functools.cache
def library_dirs() -> tuple[str, ...]:
    """Where runner's code (its package, and its shipped tasks: a folder of their own in a checkout) and
    the libraries' live: a traceback's frames outside these are the user's."""
    tasks = importlib.util.find_spec("runner.tasks")
    return tuple(
        str(Path(directory).resolve()) + os.sep
        for directory in {
            Path(__file__).parent,  # runner's package
            *(tasks.submodule_search_locations or [] if tasks else []),
            # the standard library and site-packages (not the prefix: a container's /usr holds apps too)
            *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
        }
    )


def is_library_file(filename: str) -> bool:
    """Whether a traceback's `filename` is runner's, Python's or an installed library's code."""
    return filename.startswith("<") or str(Path(filename).resolve()).startswith(library_dirs())


def describe_exception(err: BaseException) -> str:
    """What a user is told of an exception raised while training: where it passed through the user's own
    code (a model, a task, a data source), from the first frame of it down to where it was raised, with its
    notes (the step); runner's and the libraries' frames above it left out. An exception that passed
    through no user code (runner's own, or a library's) keeps its whole traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    first = next((i for i, frame in enumerate(frames) if not is_library_file(frame.filename)), None)
    if first is None:
        return "".join(traceback.format_exception(err)).rstrip()
    kept = traceback.StackSummary.from_list(frames[first:])
    notes = "".join(f"\n{note}" for note in getattr(err, "__notes__", []))
    return (
        f"{type(err).__qualname__}: {err}{notes}\nRaised in your code:\n{''.join(kept.format()).rstrip()}\n"
        "(runner's and the libraries' frames above it are in the run's log)"
    )
