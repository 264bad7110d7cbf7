"""The tracker contract, with Accelerate's `GeneralTracker` names."""

from __future__ import annotations

import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from runner.errors import ConfigError


class LoggerType(str, Enum):
    """Accelerate's tracker names for `log_with`; runner has MLFLOW and TENSORBOARD (ALL: those of them
    that are installed). A `GeneralTracker` of the user's own takes the others' place."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"


def flatten(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A nested configuration's leaves, with their keys joined by dots."""
    for key, value in values.items():
        if isinstance(value, Mapping):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def directory_setting(path: str | None, key: str) -> str | None:
    """`path` (a directory a tracker writes under, made when missing) unless it, or a directory it would
    be made in, is a file or cannot be written: then a ConfigError naming `key`, before any run starts."""
    if path is None:
        return None
    for part in (Path(path).expanduser().absolute(), *Path(path).expanduser().absolute().parents):
        if part.exists():
            if not part.is_dir():
                raise ConfigError(
                    f"{key}={path}: {part} is a file, not a directory. Give a directory (it is made if missing)."
                )
            try:  # a file made and removed: what access() cannot tell root (/proc, a read-only bind mount)
                with tempfile.NamedTemporaryFile(dir=part):
                    pass
            except OSError:
                raise ConfigError(
                    f"{key}={path}: {part} cannot be written here (read-only, or not this user's). Give a directory "
                    "this run can write (it is made if missing)."
                ) from None
            break
    return path


class Tracker(ABC):
    """Records one run's configuration and metrics. `Accelerator` calls these on the main process only.

    `name` is what `Accelerator.get_tracker(name)` looks up; `tracker` is the underlying client object.
    """

    name: str

    log_model: bool = False  # whether the runner attaches the final model files
    main_process_only: bool = True  # False: every process starts it and logs to it

    def describe(self) -> str:
        """Where the runs go, for `plan=true`."""
        return self.name

    def warm_up(self, logging_dir: Path) -> None:
        """Called by the launching process once a run passed its checks, before its ranks start (which
        give `logging_dir` to `start`): get ready, so that the run's end waits less. Nothing by default."""

    def open(self, project_name: str, logging_dir: str | None, init_kwargs: dict[str, Any]) -> None:
        """What `Accelerator.init_trackers` calls: `start`, with the tracker's `init_kwargs`."""
        self.start(project_name, logging_dir=logging_dir, **init_kwargs)

    def close(self, status: str = "FINISHED") -> None:
        """What `Accelerator.end_training` (and the runner's loop, on failure) calls: `finish`."""
        self.finish(status)

    @abstractmethod
    def start(
        self,
        project_name: str | None = None,
        logging_dir: str | None = None,
        tags: dict[str, Any] | None = None,
        resumed_at: int | None = None,
        run_name: str | None = None,
    ) -> None:
        """Open the run (`Accelerator.init_trackers` does, on the main process): `logging_dir` is where a
        tracker that has none of its own keeps local files, `tags` are added to its own. `resumed_at`: the
        run continues its earlier records from this step (a restart after a checkpoint), so the steps
        after it that the earlier process logged come again: the run must not hold them twice.
        `run_name`: the run's name, where the tracker was given none."""

    @abstractmethod
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters (a nested dict is flattened to dotted keys)."""

    @abstractmethod
    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Record scalar metrics at `step`."""

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        """Attach a file or directory to the run."""

    def parent_for_sweep(self, sweep_dir: Path) -> str | None:
        """The id of the run that groups the jobs of the sweep in `sweep_dir` (created by its first job),
        or None where this tracker has no such thing."""
        return None

    def start_sweep(self, sweep_dir: Path) -> None:
        """Before the sweep's jobs start: create its parent run, or reopen the one a previous run of the
        same sweep closed (a resumed sweep)."""

    def end_sweep(self, sweep_dir: Path, artifacts: list[Path]) -> None:
        """Attach the sweep's summary files to its parent run and close it."""

    @abstractmethod
    def finish(self, status: str = "FINISHED") -> None:
        """Close the run as `status`: "FINISHED", "FAILED" (the training raised) or "KILLED" (stopped by
        a signal, to be resumed)."""

    @property
    def tracker(self) -> Any:
        return self


class BlankTracker(Tracker):
    """What `Accelerator.get_tracker` returns where no tracker runs (processes other than the main one):
    every call does nothing, so code that logs needs no `if is_main_process`."""

    name = "blank"

    def start(self, project_name=None, logging_dir=None, tags=None, resumed_at=None, run_name=None) -> None:
        """Nothing to open."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Nothing to record."""

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Nothing to record."""

    def finish(self, status: str = "FINISHED") -> None:
        """Nothing to close."""


class GeneralTracker(Tracker):
    """Accelerate's base for a tracker of one's own, passed in `Accelerator(log_with=[MyTracker(...)])`:
    define `name`, and `store_init_configuration`, `log(values, step=None, **kwargs)` and the `tracker`
    property (the client object; default: the tracker itself); optionally `start()` (called by
    `init_trackers`, after the process group exists) and `finish()`."""

    requires_logging_directory: bool = False

    def __init__(self, _blank: bool = False) -> None:
        if _blank:
            return
        if not hasattr(self, "name"):
            raise NotImplementedError(
                f"{type(self).__name__} must define `name` (what get_tracker looks up)."
            )

    def open(self, project_name: str, logging_dir: str | None, init_kwargs: dict[str, Any]) -> None:
        self.start()

    def close(self, status: str = "FINISHED") -> None:
        self.finish()

    def start(self) -> None:  # type: ignore[override]
        """Open the run (nothing by default: a tracker may open it in its constructor)."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters (nothing by default)."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record `values` at `step` (nothing by default)."""

    def finish(self) -> None:  # type: ignore[override]
        """Close the run (nothing by default)."""
