"""The run's logs: a console that coexists with a tqdm progress bar, the run's log file, and the
logging configuration of each rank of a job."""

from __future__ import annotations

import copy
import logging
import logging.config
import sys
from typing import Any

from tqdm.auto import tqdm

FILE_ONLY = {"file_only": True}  # `log.info(..., extra=FILE_ONLY)`: for the log file, not the console
# `log.error(..., extra=LAUNCHER_REPORTS)`: what runner's launcher reads from the run dir and reports itself
# (a watchdog's hang report): in a rank that it started, for the log file only, not said twice on the console
LAUNCHER_REPORTS = {"launcher_reports": True}
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


def _not_reported_by_the_launcher(record: logging.LogRecord) -> bool:
    return not getattr(record, "launcher_reports", False)


class RankPrefix(logging.Filter):
    """Prefix each message with the process that logged it: "[rank 1] ", "[node 1] "."""

    def __init__(self, rank: int, kind: str = "rank") -> None:
        super().__init__()
        self.prefix = f"[{kind} {rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            record.msg = self.prefix + str(record.msg)
        return True


def configure_rank_logging(
    config: dict[str, Any] | None, rank: int, kind: str = "rank", launcher_reports: bool = False
) -> None:
    """Apply the job's logging `config` in a rank (its log files are appended to, never truncated; None: a
    rank that another launcher started, torchrun or srun); ranks other than 0 (or the agents of nodes other
    than 0: `kind` "node") log warnings and errors only, prefixed with their rank. `launcher_reports`: a
    launcher of runner's waits for this rank and reports its failures itself, so its console leaves out
    what is logged with LAUNCHER_REPORTS."""
    if config is not None:
        config = copy.deepcopy(config)
        for handler in config.get("handlers", {}).values():
            if "filename" in handler:
                handler["mode"] = "a"
        logging.config.dictConfig(config)
    if launcher_reports:
        for handler in logging.getLogger().handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.addFilter(_not_reported_by_the_launcher)
    if rank != 0:
        root = logging.getLogger()
        root.setLevel(logging.WARNING)
        for handler in root.handlers:
            handler.addFilter(RankPrefix(rank, kind))
