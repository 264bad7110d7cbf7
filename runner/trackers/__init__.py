"""Experiment trackers: what the `tracker` config group builds and `Accelerator(log_with=...)` drives."""

from runner.trackers.base import BlankTracker, Tracker
from runner.trackers.mlflow import MLflowTracker

__all__ = ["BlankTracker", "MLflowTracker", "Tracker", "tracker_from_name"]


def tracker_from_name(name: str) -> Tracker:
    """Accelerate's `log_with` strings ("mlflow", "all") to a tracker."""
    if name not in ("mlflow", "all"):
        raise ValueError(f"log_with={name!r}: the trackers available are 'mlflow' (or 'all').")
    return MLflowTracker()
