"""Log every parameter group's learning rate (`callbacks=[lr_monitor]`)."""

from __future__ import annotations

from runner.callbacks.base import Callback, Run


class LearningRateMonitor(Callback):
    """Log the learning rate of every parameter group of every optimizer as `lr/<optimizer>_group<g>` at
    each logging step (`trainer.log_every`; `train/lr` is the first group's)."""

    def on_step_end(self, run: Run) -> None:
        if run.step % run.settings.log_every and run.step != run.total_steps:
            return
        run.log_metrics(
            {
                f"lr/{i}_group{g}": group["lr"]
                for i, optimizer in enumerate(run.engine.checkpointer.of_kind("optimizer"))
                for g, group in enumerate(optimizer.param_groups)
            }
        )
