"""An evaluation before the first step (`trainer.eval_at_start`, a built-in callback named `eval_at_start`)."""

from __future__ import annotations

from runner.callbacks.base import Callback, Run


class EvaluateAtStart(Callback):
    """The eval loop before the first step of a run started afresh, logged at step 0 (nanoGPT's first
    evaluation): the untrained model's metrics, the start of every eval curve. A resumed run had it."""

    def on_fit_start(self, run: Run) -> None:
        if run.step == 0:
            run.evaluate()
