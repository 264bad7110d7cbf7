"""Stop a run whose monitored eval metric stopped improving (`callbacks=[early_stopping]`)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from runner.callbacks.base import Callback, Monitor, Run
from runner.config import NonNegativeFloat, PositiveInt

log = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Stop the run when `monitor` (an eval metric) has not improved by more than `min_delta` in
    `patience` evaluations in a row.

    Args:
        monitor: the metric, e.g. eval/loss.
        mode: min (lower is better) or max.
        patience: evaluations without improvement that stop the run.
        min_delta: the least change that counts as an improvement.
    """

    def __init__(
        self,
        monitor: str = "eval/loss",
        mode: Literal["min", "max"] = "min",
        patience: PositiveInt = 3,
        min_delta: NonNegativeFloat = 0.0,
    ) -> None:
        self.rule = Monitor("callbacks.early_stopping", monitor, mode, min_delta)
        self.patience = patience
        self.best: float | None = None
        self.waited = 0  # evaluations since the best

    @classmethod
    def check_settings(cls, node: str, settings: Any, trainer: Any) -> list[str]:
        """It decides on evaluations: with trainer.eval_every=0 there is none while the run trains, in this
        run or one that continues it longer."""
        if trainer.eval_every == 0:
            return [
                f"{node}: trainer.eval_every=0, so the run never evaluates while it trains and early stopping "
                "(which decides on evaluations) could never stop it. Set trainer.eval_every (say, a tenth of "
                f"trainer.max_steps), or leave {node.split('.')[-1]} out of callbacks."
            ]
        return []

    def on_fit_start(self, run: Run) -> None:
        """Warn where this run has too few evaluations left before its last step for the rule to stop it
        (one that is continued longer later may have enough: not refused)."""
        every = run.settings.eval_every
        if every == 0:  # refused before launch (`check_settings`); a loop built otherwise: nothing to say
            return
        left = (run.total_steps - 1) // every - run.step // every  # evaluations before the last step
        needed = self.patience - self.waited + (self.best is None)
        if left < needed:
            log.warning(
                "early stopping cannot stop this run: it evaluates %d more time(s) before its last step "
                "(trainer.eval_every=%d, %d steps) and needs %d (patience=%d) to stop it. Evaluate more often "
                "(trainer.eval_every<=%d) or lower the patience.",
                left, every, run.total_steps, needed, self.patience,
                max(1, (run.total_steps - 1 - run.step) // max(needed, 1)),
            )  # fmt: skip

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        value = metrics[self.rule.monitor]
        if self.rule.better(value, self.best):
            self.best, self.waited = value, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            run.stop(
                f"early stopping: {self.rule.monitor}={value:.6g} has not improved on {self.best:.6g} "
                f"(by more than {self.rule.min_delta:g}, mode {self.rule.mode}) in {self.waited} evaluation(s)"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.waited = state["best"], state["waited"]
