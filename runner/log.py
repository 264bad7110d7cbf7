"""Logging that coexists with a tqdm progress bar, and logging in the ranks of a job."""

from __future__ import annotations

import copy
import logging
import logging.config
from typing import Any

from tqdm.auto import tqdm

FILE_ONLY = {"file_only": True}  # `log.info(..., extra=FILE_ONLY)`: for the log file, not the console


class TqdmHandler(logging.StreamHandler):
    """Write records with `tqdm.write`, above any active progress bar (not those logged with FILE_ONLY)."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "file_only", False):
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


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
