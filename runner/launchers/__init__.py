"""Launchers: how a job's ranks are started (`conf/launcher/<name>.yaml`)."""

from runner.launchers.base import Job, Launcher, RankFailedError, run_rank
from runner.launchers.local import LocalLauncher

__all__ = ["Job", "Launcher", "LocalLauncher", "RankFailedError", "run_rank"]
