"""Logging that coexists with a tqdm progress bar."""

from __future__ import annotations

import logging

from tqdm.auto import tqdm


class TqdmHandler(logging.StreamHandler):
    """Write records with `tqdm.write`, above any active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)
