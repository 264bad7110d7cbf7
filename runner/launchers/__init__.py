"""Launchers: how a job's ranks are started (`conf/launcher/<name>.yaml`)."""

from runner.errors import RankFailedError
from runner.launchers.base import Job, Launcher, run_rank
from runner.launchers.local import LocalLauncher

__all__ = ["Job", "Launcher", "LocalLauncher", "RankFailedError", "run_rank"]
