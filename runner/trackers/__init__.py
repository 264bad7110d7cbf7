"""Experiment trackers: what the `tracker` config group builds and `Accelerator(log_with=...)` drives."""

import importlib.util

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

# What each name needs installed, and builds.
_TRACKERS = {
    LoggerType.MLFLOW: ("mlflow", MLflowTracker),
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
        return [tracker() for module, tracker in _TRACKERS.values() if importlib.util.find_spec(module)]
    if kind not in _TRACKERS:
        raise ValueError(
            f"log_with={name!r}: runner has the trackers 'mlflow' and 'tensorboard' (or 'all'); for another, "
            "pass an instance of your own runner.trackers.GeneralTracker subclass."
        )
    module, tracker = _TRACKERS[kind]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"log_with={name!r} needs {module}: pip install {module}.")
    return [tracker()]
