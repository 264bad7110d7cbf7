"""The goodput ledger's phases of the loop (a built-in callback named `goodput`; `runner.telemetry.goodput`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from runner.callbacks.base import Callback, LeftOut, Run
from runner.telemetry.goodput import Ledger, tracked, write_summary


class GoodputLedger(Callback):
    """Records into the main process's `ledger` (whose construction phases the Trainer lapped) the loop's:
    each attempt's first step (`warmup`), the training steps and the time they waited for batches (a step
    left out for gradients that were not finite: `skipped`), the
    blocking part of each checkpoint, each evaluation, and at the run's end `finish`, with the ledger's
    summary logged as `goodput/*` metrics. A failure writes the steps not yet written (they are `lost`
    once a later attempt resumes from an earlier checkpoint)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.stepped = False  # this attempt's first optimizer step is its warm-up
        self.may_skip = False

    def train_batches(self, run: Run, batches: Iterable[Any]) -> Iterable[Any]:
        return self.ledger.batches(batches)

    def on_fit_start(self, run: Run) -> None:
        self.stepped = False
        # Whether a step can be left out (asked at every step only then: the question costs calls).
        engine = run.engine
        self.may_skip = engine.skip_nonfinite_steps or engine.precision.skips_nonfinite_steps

    def on_optimizer_step(self, run: Run) -> None:
        skipped = self.may_skip and run.engine.optimizer_step_was_skipped
        self.ledger.step_done(run.step, first=not self.stepped, skipped=skipped)
        self.stepped = True

    def on_rollback(self, run: Run, from_step: int, left_out: LeftOut) -> None:
        """The steps past the checkpoint rolled back to are lost, as after a restart's resume."""
        self.ledger.lap("restore", resumed_at=run.step, rolled_back_from=from_step)

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        self.ledger.lap("eval", step=run.step)

    def on_checkpoint(self, run: Run, path: Path) -> None:
        self.ledger.lap("checkpoint", step=run.step)

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        """The time so far, for the trackers and the history; the command adds its own end."""
        self.ledger.lap("finish")
        run.log(tracked(write_summary(run.output_dir)))

    def on_exception(self, run: Run, error: BaseException) -> None:
        self.ledger.flush()
