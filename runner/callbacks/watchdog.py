"""The hang watchdog (`trainer.hang_timeout_s`, a built-in callback named `watchdog`): the loop's progress
told to `runner.watchdog.Watchdog`, the thread that ends a rank that makes none."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from runner.callbacks.base import Callback, Run
from runner.watchdog import Watchdog


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
