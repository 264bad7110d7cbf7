"""The run's metric history (`history.jsonl`, a built-in callback named `history`)."""

from __future__ import annotations

from runner.callbacks.base import Callback, LeftOut, Run
from runner.telemetry.history import History


class RecordHistory(Callback):
    """Appends every set of metrics the run logs, with its step, to `<run dir>/history.jsonl` (the main
    process's; `runner.telemetry.history`), whatever the tracker; a run resumed from a checkpoint (or rolled
    back to one) first drops the lines past its step, which it logs again. What `runner.telemetry.plots` draws."""

    def __init__(self) -> None:
        self.history: History | None = None

    def on_fit_start(self, run: Run) -> None:
        self.history = History(run.output_dir if run.engine.is_main_process else None)
        self.history.resume_at(run.step)  # a run started afresh (step 0): none of an earlier one's lines

    def on_log(self, run: Run, values: dict[str, float]) -> None:
        if self.history is not None:
            self.history.add(run.step, values)

    def on_rollback(self, run: Run, from_step: int, left_out: LeftOut) -> None:
        if self.history is not None:
            self.history.resume_at(run.step)  # as a resume: the steps rolled back are logged again

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        self._close()

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.history is not None:
            self.history.close()
            self.history = None
