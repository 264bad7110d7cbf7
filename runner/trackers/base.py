"""The tracker contract, with Accelerate's `GeneralTracker` names."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


class Tracker(ABC):
    """Records one run's configuration and metrics. `Accelerator` calls these on the main process only.

    `name` is what `Accelerator.get_tracker(name)` looks up; `tracker` is the underlying client object.
    """

    name: str

    log_model: bool = False  # whether the runner attaches the final model files

    @abstractmethod
    def start(
        self,
        project_name: str | None = None,
        logging_dir: str | None = None,
        tags: dict[str, Any] | None = None,
    ) -> None:
        """Open the run (`Accelerator.init_trackers` does, on the main process): `logging_dir` is where a
        tracker that has none of its own keeps local files, `tags` are added to its own."""

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

    def start(self, project_name=None, logging_dir=None, tags=None) -> None:
        """Nothing to open."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Nothing to record."""

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Nothing to record."""

    def finish(self, status: str = "FINISHED") -> None:
        """Nothing to close."""
