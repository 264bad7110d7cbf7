"""Accelerate's multi-process logger (`get_logger`, `MultiProcessAdapter`)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch.distributed as dist

from runner.cluster import launched_environment

__all__ = ["MultiProcessAdapter", "get_logger"]


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger for code that runs in every process of a job (Accelerate's `MultiProcessAdapter`): a
    record is logged by the main process only (`main_process_only=True`, the default), by every process
    (`main_process_only=False`), or by every process in rank order (`in_order=True`: each waits for the
    ones before it at a barrier). Needs no Accelerator: the rank comes from the process group, else
    from the launcher's environment."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        rank, world_size = process_place()
        if in_order and world_size > 1 and dist.is_initialized():
            for turn in range(world_size):
                if turn == rank:
                    self.logger.log(level, msg, *args, **kwargs)
                dist.barrier()
        elif not main_process_only or rank == 0:
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019 (Accelerate's: one warning per message and logger)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, once per distinct message."""
        self.warning(*args, **kwargs)


def process_place() -> tuple[int, int]:
    """(rank, world size) of this process: the process group's, else the launcher's, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = launched_environment()
    return (env.rank, env.world_size) if env is not None else (0, 1)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """Accelerate's `get_logger`: the logger `name` wrapped in a `MultiProcessAdapter`; `log_level` (else
    `$ACCELERATE_LOG_LEVEL`, if set) becomes the level of that logger and of the root logger."""
    log_level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logger.root.setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
