"""Experiment trackers: what the `tracker` config group builds and `Accelerator(log_with=...)` drives."""

import importlib.util

from runner.errors import install_command
from runner.trackers.base import BlankTracker, GeneralTracker, LoggerType, Tracker
from runner.trackers.mlflow import MLflowTracker
from runner.trackers.tensorboard import TensorBoardTracker

__all__ = [
    "BlankTracker",
    "GeneralTracker",
    "LoggerType",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "trackers_from_name",
]

# What each name builds, and the extra (its module too) that it needs installed; None: a dependency.
_TRACKERS = {
    LoggerType.MLFLOW: (None, MLflowTracker),
    LoggerType.TENSORBOARD: ("tensorboard", TensorBoardTracker),
}


def trackers_from_name(name: str | LoggerType) -> list[Tracker]:
    """Accelerate's `log_with` names (or `LoggerType`s) to trackers: "mlflow", "tensorboard", or "all"
    (every one of them whose package is installed)."""
    try:
        kind = LoggerType(getattr(name, "value", name))
    except ValueError:
        kind = None
    if kind is LoggerType.ALL:
        return [
            tracker()
            for extra, tracker in _TRACKERS.values()
            if extra is None or importlib.util.find_spec(extra)
        ]
    if kind not in _TRACKERS:
        raise ValueError(
            f"log_with={name!r}: runner has the trackers 'mlflow' and 'tensorboard' (or 'all'); for another, "
            "pass an instance of your own runner.trackers.GeneralTracker subclass."
        )
    extra, tracker = _TRACKERS[kind]
    if extra is not None and importlib.util.find_spec(extra) is None:
        raise ValueError(f"log_with={name!r} needs {extra}: {install_command(extra)}.")
    return [tracker()]
