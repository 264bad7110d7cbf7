"""`launcher=ray`: ranks as Ray Train workers on a Ray cluster."""

from runner.launchers.ray.launcher import RayLauncher

__all__ = ["RayLauncher"]
