"""Hangs that fail fast: a thread in each rank that ends the rank when the loop makes no progress for too
long (`trainer.hang_timeout_s`), after writing every thread's Python stack to the run dir.

A rank stuck in its own code, or waiting in a collective for a rank that is gone or stuck, would otherwise
sit until the process group's timeout (30 minutes for gloo) or forever. The loop's `watchdog` callback
(`HangWatchdog`, below) reports progress (`Watchdog.progress`) after each optimizer step, each eval batch
and before each checkpoint; where none comes for the limit, the watchdog writes `<run dir>/hang/rank<r>.txt`
(what it saw, then the stacks), logs (to the console too where no runner launcher reports it) one
paragraph naming the rank, its host, the step, the phase and where its main thread is, closes its
trackers' runs as FAILED (`on_hang`), and exits the process with `EXIT_HUNG` `PEERS_REPORT_S` later
(ranks waiting for it in a collective reach their limit meanwhile and report too, rather than fail on a
lost peer); the launcher then stops the other ranks and reports the rank whose main thread was in its
own code (not waiting inside torch), which is the likelier cause.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from runner.callbacks.base import Callback, Run
from runner.run_dir import HANG_DIR
from runner.run_dir.log import LAUNCHER_REPORTS

log = logging.getLogger(__name__)

EXIT_HUNG = 124  # as `timeout` exits: a rank ended for making no progress
FIRST_STEPS_S = 1800.0  # auto: the limit until enough steps are measured (compilation, warm-up)
AUTO_FLOOR_S = 600.0  # auto: never less than this
AUTO_TIMES_MEDIAN = 20  # auto: this many times the median step
MEASURED_STEPS = 10  # auto: steps measured before the limit follows them
PEERS_REPORT_S = 1.0  # a rank that hung exits this long after its report: ranks waiting for it report too
TORCH_DIR = str(Path(torch.__file__).parent)


class Watchdog:
    """Ends this rank when `progress` is not called for the limit: `timeout_s` (0: never), or None for
    one that follows the run: `FIRST_STEPS_S` until `MEASURED_STEPS` steps ended, then
    `AUTO_TIMES_MEDIAN` times their median duration, at least `AUTO_FLOOR_S`."""

    def __init__(
        self,
        timeout_s: float | None,
        run_dir: Path,
        rank: int,
        poll_s: float = 0.5,
        on_hang: Callable[[], None] | None = None,
    ) -> None:
        self.timeout_s, self.run_dir, self.rank, self.poll_s = timeout_s, Path(run_dir), rank, poll_s
        self.on_hang = on_hang  # called (for at most PEERS_REPORT_S) before the rank ends: its trackers
        self.phase, self.step = "training", 0
        self.last = time.monotonic()
        self.steps: deque[float] = deque(maxlen=100)  # the last steps' durations
        self._step_began = self.last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop = threading.get_ident()  # the thread the loop runs in (a Ray worker's is not the main one)

    def start(self) -> Watchdog:
        report_path(self.run_dir, self.rank).unlink(missing_ok=True)  # an earlier attempt's
        self.last = self._step_began = time.monotonic()
        if self.timeout_s != 0:
            self._thread = threading.Thread(target=self._watch, name="runner-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.on_hang = None  # what it holds (the engine's trackers) is released with the loop, not at exit

    def progress(self, phase: str, step: int) -> None:
        """The loop moved on, `step` optimizer steps done: "training" (step `step` ended, or an evaluation
        or checkpoint after it did: training goes on), "evaluating" (an eval batch done), "checkpointing" (a
        checkpoint begins). Only a step that followed a step is measured."""
        now = time.monotonic()
        if phase == "training":
            if self.phase == "training":  # a step ended: its duration
                self.steps.append(now - self._step_began)
            self._step_began = now
        self.phase, self.step, self.last = phase, step, now

    @property
    def limit_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        if len(self.steps) < MEASURED_STEPS:
            return FIRST_STEPS_S
        return max(AUTO_FLOOR_S, AUTO_TIMES_MEDIAN * statistics.median(self.steps))

    def _watch(self) -> None:
        """Wake when the limit passes (not at the next poll after it: ranks that stopped together, in one
        collective, reach their limits together and each reports before a peer's exit ends the
        collective with a lost-peer error), and at least every `poll_s` (the limit may change)."""
        while not self._stop.wait(min(self.poll_s, max(self.last + self.limit_s - time.monotonic(), 0.0))):
            waited = time.monotonic() - self.last
            if waited >= self.limit_s:
                self._end(waited)

    def _end(self, waited: float) -> None:
        """Write what it saw and every thread's stack, say so, and end the process."""
        where, in_torch = thread_position(self._loop)
        host = socket.gethostname()
        doing = (
            f"in step {self.step + 1}" if self.phase == "training" else f"{self.phase} after step {self.step}"
        )
        message = (
            f"rank {self.rank} on {host} made no progress for {waited:.0f} s (trainer.hang_timeout_s: "
            f"{self.limit_s:.0f} s) {doing}; its main thread is at {where}"
            f"{' (waiting inside torch: a collective, or the device)' if in_torch else ''}. Every thread's "
            f"stack: {report_path(self.run_dir, self.rank)}."
        )
        path = report_path(self.run_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        facts = {"rank": self.rank, "host": host, "doing": doing, "where": where, "in_torch": in_torch}
        with open(path, "w") as f:
            f.write(json.dumps({**facts, "message": message}) + "\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        log.error("Training hung: %s", message, extra=LAUNCHER_REPORTS)  # runner's launcher says it once
        ending = threading.Thread(target=self._on_hang, name="runner-watchdog-end", daemon=True)
        ending.start()
        time.sleep(PEERS_REPORT_S)
        ending.join(timeout=PEERS_REPORT_S)  # what did not end by then is left: the rank ends regardless
        logging.shutdown()
        os._exit(EXIT_HUNG)

    def _on_hang(self) -> None:
        if self.on_hang is None:
            return
        try:
            self.on_hang()
        except Exception as err:  # the rank ends anyway: say why its trackers may not be closed
            log.error("after the hang, closing the run failed: %s", err)


def report_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / HANG_DIR / f"rank{rank}.txt"


def read_reports(run_dir: Path, since: float = 0.0) -> dict[int, dict]:
    """rank -> what its watchdog wrote before ending it (the report's first line), of the reports
    written at `since` (a wall-clock time) or later."""
    reports = {}
    for path in (Path(run_dir) / HANG_DIR).glob("rank*.txt"):
        try:
            if path.stat().st_mtime < since:
                continue
            reports[int(path.stem.removeprefix("rank"))] = json.loads(path.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            continue
    return reports


def thread_position(ident: int) -> tuple[str, bool]:
    """Where the thread `ident` is: its innermost frame outside torch ("file:line in function"), and
    whether frames inside torch are below it (it waits in a collective or on the device)."""
    frame = sys._current_frames().get(ident)
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    own = next((f for f in stack if not f.f_code.co_filename.startswith(TORCH_DIR)), None)
    in_torch = bool(stack) and stack[0].f_code.co_filename.startswith(TORCH_DIR)
    if own is None:
        return "an unknown place", in_torch
    return f"{own.f_code.co_filename}:{own.f_lineno} in {own.f_code.co_name}", in_torch


class HangWatchdog(Callback):
    """Ends this rank when the loop makes no progress for `timeout_s` (None: a limit that follows the
    run's steps; see `Watchdog`), its phase told at each point: training after each optimizer step and
    what follows it, evaluating at each eval batch, checkpointing while a checkpoint is saved. A hang
    closes the trackers' runs as FAILED (a failure, not a stop to resume)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.watchdog: Watchdog | None = None

    def on_fit_start(self, run: Run) -> None:
        engine = run.engine
        hung = partial(engine.close_trackers, "FAILED")
        self.watchdog = Watchdog(self.timeout_s, run.output_dir, engine.process_index, on_hang=hung).start()

    def _progress(self, run: Run, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(phase, run.step)

    def on_optimizer_step(self, run: Run) -> None:
        self.watchdog.progress("training", run.step)  # type: ignore[union-attr]  # started at on_fit_start

    def on_eval_batch_end(self, run: Run) -> None:
        self._progress(run, "evaluating")

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        self._progress(run, "training")

    def on_checkpoint_start(self, run: Run) -> None:
        self._progress(run, "checkpointing")

    def on_checkpoint(self, run: Run, path: Path) -> None:
        self._progress(run, "training")

    def on_train_end(self, run: Run) -> None:
        self._stop()

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
