"""The run's progress bar (`trainer.progress_bar`, a built-in callback named `progress`)."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from runner.callbacks.base import Callback, Run

# The perf/* metrics the bar shows next to the loss.
SHOWN = ("perf/tokens_per_s", "perf/samples_per_s", "perf/mfu")


class ProgressBar(Callback):
    """A tqdm bar of the optimizer steps, with the latest train loss and throughput: drawn by the local
    main process on a terminal only (piped to a file, a bar's redraws would be hundreds of lines)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_fit_start(self, run: Run) -> None:
        self.bar = tqdm(
            total=run.total_steps,
            initial=run.step,
            desc="train",
            dynamic_ncols=True,
            disable=None if run.engine.is_local_main_process else True,  # None: on a terminal only
        )

    def on_step_end(self, run: Run) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.update(run.step - self.bar.n)

    def on_train_end(self, run: Run) -> None:
        self._close()  # what the run logs next is not under a bar

    def on_log(self, run: Run, values: dict[str, float]) -> None:
        if self.bar is None or self.bar.disable or "train/loss" not in values:
            return
        shown = {name.removeprefix("perf/"): f"{values[name]:.3g}" for name in SHOWN if name in values}
        self.bar.set_postfix({"loss": f"{values['train/loss']:.4f}"} | shown)

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
