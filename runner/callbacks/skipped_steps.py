"""Count the optimizer steps left out for gradients that were not finite (`trainer.on_nonfinite=skip`)."""

from __future__ import annotations

import logging
from typing import Any

from runner.callbacks.base import Callback, Run
from runner.checkpoint.resume import resume_hint
from runner.errors import TrainingDiverged

log = logging.getLogger(__name__)


class SkippedSteps(Callback):
    """Each optimizer step the prepared optimizer left out because its gradients were NaN or infinite
    (the weights, the optimizer's state and the learning-rate schedule stay as they were; the step's
    losses stay out of `train/loss`): warned with its step, counted as `train/skipped_steps`, and
    `max_skipped_steps` of them in a row stop the run as diverged (a run that only skips is not training).
    The counts are checkpointed: a resumed run goes on counting."""

    def __init__(self, max_skipped_steps: int) -> None:
        self.limit = max_skipped_steps
        self.total = 0
        self.in_a_row = 0

    def on_optimizer_step(self, run: Run) -> None:
        if not run.engine.optimizer_step_was_skipped:
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        log.warning(
            "step %d: the gradients were not finite; its optimizer step was left out (%d in a row, %d in all)",
            run.step,
            self.in_a_row,
            self.total,
        )
        run.log_metrics({"train/skipped_steps": float(self.total)})
        if self.in_a_row >= self.limit:
            raise TrainingDiverged(
                f"the gradients of {self.in_a_row} optimizer steps in a row were NaN or infinite (steps "
                f"{run.step - self.in_a_row + 1}-{run.step}; trainer.on_nonfinite=skip left each out, "
                f"trainer.max_skipped_steps={self.limit}): training diverged and was stopped. Lower "
                "optimizer.lr, clip gradients (trainer.max_grad_norm=1.0), prefer precision=bf16 to fp16, and "
                "check the data for NaN or inf. "
                f"{resume_hint(run.engine.checkpointer.project.checkpoints_dir, run.settings.checkpoint_last_finite)}"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total, self.in_a_row = state["total"], state["in_a_row"]
