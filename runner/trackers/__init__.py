"""Experiment trackers: what the `tracker` config group builds and `Accelerator(log_with=...)` drives."""

import importlib.util

from runner.errors import ConfigError, install_command
from runner.trackers.base import BlankTracker, GeneralTracker, LoggerType, Tracker
from runner.trackers.mlflow import MLflowTracker
from runner.trackers.tensorboard import TensorBoardTracker
from runner.trackers.wandb import WandbTracker

__all__ = [
    "BlankTracker",
    "GeneralTracker",
    "LoggerType",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "trackers_from_name",
]

# What each name builds, and the extra (its module too) that it needs installed; None: a dependency.
_TRACKERS = {
    LoggerType.MLFLOW: (None, MLflowTracker),
    LoggerType.TENSORBOARD: ("tensorboard", TensorBoardTracker),
    LoggerType.WANDB: ("wandb", WandbTracker),
}


def trackers_from_name(name: str | LoggerType) -> list[Tracker]:
    """Accelerate's `log_with` names (or `LoggerType`s) to trackers: "mlflow", "tensorboard", "wandb", or
    "all" (every one of them whose package is installed and that can run here: W&B online needs a login)."""
    try:
        kind = LoggerType(getattr(name, "value", name))
    except ValueError:
        kind = None
    if kind is LoggerType.ALL:
        return [
            made
            for extra, tracker in _TRACKERS.values()
            if (extra is None or importlib.util.find_spec(extra)) and (made := _made(tracker)) is not None
        ]
    if kind not in _TRACKERS:
        raise ValueError(
            f"log_with={name!r}: runner has the trackers 'mlflow', 'tensorboard' and 'wandb' (or 'all'); for another, "
            "pass an instance of your own runner.trackers.GeneralTracker subclass."
        )
    extra, tracker = _TRACKERS[kind]
    if extra is not None and importlib.util.find_spec(extra) is None:
        raise ValueError(f"log_with={name!r} needs {extra}: {install_command(extra)}.")
    return [tracker()]


def _made(tracker: type[Tracker]) -> Tracker | None:
    """`tracker()`, or None where it cannot run here (W&B online without a login)."""
    try:
        return tracker()
    except ConfigError:
        return None
