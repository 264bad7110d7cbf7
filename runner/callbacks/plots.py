"""The run's curves drawn while it trains (`trainer.plots`, a built-in callback named `plots`)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch

from runner.callbacks.base import Callback, Run
from runner.errors import install_command
from runner.run_dir import HISTORY

log = logging.getLogger(__name__)


class PlotCurves(Callback):
    """Draw the run's curves into `<run dir>/plots/` (`runner.telemetry.plots`) in a process of its own, started with
    the training and running only on CPU time the run leaves idle: it imports matplotlib while the run
    trains, draws at an evaluation (at most every `every_s` seconds, not while it is drawing, and only where
    the run's threads leave a core free), and at the end, where the run waits for the drawing of its whole
    history and names the files. The loop never waits on a picture; one that cannot be drawn is a warning.
    The main process's (`trainer.plots`, on unless false)."""

    every_s = 30.0  # seconds between drawings during training, at least

    def __init__(self) -> None:
        self.drawer: subprocess.Popen | None = None  # `python -m runner.telemetry.plots --serve`
        self.errors: IO[bytes] | None = None  # its stderr
        self.asked = False  # a drawing asked for and not answered yet
        self.answer: dict[str, Any] = {}  # the latest answer
        self.drawn_from = -1  # the size of the history the latest drawing asked for started from
        self.started = -math.inf  # when it was asked for (time.monotonic)
        self.available = importlib.util.find_spec("matplotlib") is not None
        # Drawings during training only where the run's threads leave a core free: on a machine whose every
        # core computes the run (torch's threads on a CPU), one more process slows it.
        self.spare_core = (os.cpu_count() or 1) > torch.get_num_threads()

    def on_fit_start(self, run: Run) -> None:
        if self.available and run.engine.is_main_process and self.drawer is None:
            self.errors = tempfile.TemporaryFile()  # noqa: SIM115  (closed with the drawer, `_close`)
            self.drawer = subprocess.Popen(
                [sys.executable, "-m", "runner.telemetry.plots", "--idle", "--serve", str(run.output_dir)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errors,
                text=True,
            )

    def _ask(self, run: Run) -> None:
        assert self.drawer is not None and self.drawer.stdin is not None
        history = run.output_dir / HISTORY
        self.drawn_from = history.stat().st_size if history.is_file() else 0
        self.started = time.monotonic()
        try:
            self.drawer.stdin.write("draw\n")
            self.drawer.stdin.flush()
        except OSError:  # it ended: its answer says how
            pass
        self.asked = True

    def _answered(self, wait: bool) -> bool:
        """Whether the drawing asked for is answered (its answer in `self.answer`); `wait`: until it is."""
        assert self.drawer is not None and self.drawer.stdout is not None
        if not wait and select.select([self.drawer.stdout], [], [], 0)[0] == []:
            return False
        line = self.drawer.stdout.readline()
        self.asked = False
        if line:
            self.answer = json.loads(line)
        else:
            assert self.errors is not None
            self.errors.seek(0)
            said = self.errors.read().decode(errors="replace").strip()[-500:]
            self.answer = {"error": f"the drawing process ended (exit {self.drawer.wait()}): {said}"}
        return True

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        due = self.spare_core and time.monotonic() - self.started >= self.every_s
        if self.drawer is not None and due and (not self.asked or self._answered(wait=False)):
            self._ask(run)

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        if not run.engine.is_main_process:
            return
        if not self.available:
            log.info(
                "the run's curves are not drawn: matplotlib is not installed (%s)", install_command("plots")
            )
            return
        self.on_fit_start(run)  # started there, unless this process trained nothing
        if self.asked:
            self._answered(wait=True)
        history = run.output_dir / HISTORY
        if "drawn" not in self.answer or self.drawn_from != (
            history.stat().st_size if history.is_file() else 0
        ):
            self._ask(run)  # the last evaluation's drawing is not of the whole history, or failed
            self._answered(wait=True)
        self._close()
        if "error" in self.answer:
            log.warning("the plots could not be drawn: %s", self.answer["error"])
            return
        log.info("plots: %s", brace_paths([Path(path) for path in self.answer["drawn"]]))

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        """The drawer ends once its stdin does (after a drawing it is doing)."""
        if self.drawer is not None:
            with contextlib.suppress(OSError):
                self.drawer.stdin.close()  # type: ignore[union-attr]
            self.drawer.wait()
            self.drawer.stdout.close()  # type: ignore[union-attr]
            self.errors.close()  # type: ignore[union-attr]
            self.drawer = None


def brace_paths(paths: list[Path]) -> str:
    """Files of one directory as the shell's braces write them, relative to the working directory where
    they are under it: `run/plots/{eval,loss}.png` (one file: its path)."""
    here = Path.cwd()
    shown = sorted(path.relative_to(here) if path.is_relative_to(here) else path for path in paths)
    if len(shown) < 2 or len({(p.parent, p.suffix) for p in shown}) > 1:
        return " ".join(map(str, shown))
    first = shown[0]
    return f"{first.parent}/{{{','.join(p.stem for p in shown)}}}{first.suffix}"
