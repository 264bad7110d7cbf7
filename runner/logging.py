"""Logging that coexists with a tqdm progress bar, logging in the ranks of a job, and Accelerate's
multi-process logger (`get_logger`)."""

from __future__ import annotations

import copy
import functools
import logging
import logging.config
import os
import sys
from typing import Any

import torch.distributed as dist
from tqdm.auto import tqdm

from runner.cluster import launched_environment

FILE_ONLY = {"file_only": True}  # `log.info(..., extra=FILE_ONLY)`: for the log file, not the console
# Libraries whose info and warnings (a kernel library that cannot load, a deprecation in torch) are for
# the run's log file: the console shows runner's lines, the user's own, and anyone's errors.
LIBRARIES = (
    *("torch", "torchao", "transformers", "datasets", "huggingface_hub", "tokenizers", "safetensors"),
    *("deepspeed", "accelerate", "mlflow", "urllib3", "filelock", "fsspec", "PIL", "submitit"),
)


def for_console(record: logging.LogRecord) -> bool:
    """Whether `record` is shown on the console as well as written to the log file."""
    if getattr(record, "file_only", False):
        return False
    return record.levelno >= logging.ERROR or record.name.partition(".")[0] not in LIBRARIES


class TqdmHandler(logging.StreamHandler):
    """Write records with `tqdm.write`, above any active progress bar (not those logged with FILE_ONLY,
    nor the libraries' warnings: see `for_console`)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not for_console(record):
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class RunLogHandler(logging.FileHandler):
    """The run's log file. A record that cannot be written (the disk full, the dir read-only) is said once
    on stderr in one line, instead of a traceback per record; the run goes on and reports the write
    failure where it matters (a checkpoint)."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
        elif not self.failed:
            self.failed = True
            sys.stderr.write(
                f"runner: the log file {self.baseFilename} cannot be written ({err.strerror}).\n"
            )


class RankPrefix(logging.Filter):
    """Prefix each message with the rank that logged it."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = f"[rank {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            record.msg = self.prefix + str(record.msg)
        return True


def configure_rank_logging(config: dict[str, Any] | None, rank: int) -> None:
    """Apply the job's logging `config` in a rank (its log files are appended to, never truncated); ranks
    other than 0 log warnings and errors only, prefixed with their rank."""
    if config is not None:
        config = copy.deepcopy(config)
        for handler in config.get("handlers", {}).values():
            if "filename" in handler:
                handler["mode"] = "a"
        logging.config.dictConfig(config)
    if rank != 0:
        root = logging.getLogger()
        root.setLevel(logging.WARNING)
        for handler in root.handlers:
            handler.addFilter(RankPrefix(rank))


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
