"""Loss and gradient-norm spikes (`trainer.spike`): each one warned, counted and recorded, and with
`action=rollback` undone as PaLM's recipe does by hand: back to a checkpoint before it, the batches since
left out."""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import torch

from runner.callbacks.base import Callback, LeftOut, Run
from runner.config import SpikeAction, SpikeConfig
from runner.errors import TrainingDiverged
from runner.files import JsonLines
from runner.run_dir import SPIKES

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution times this is its standard deviation


def robust_z(value: float, recent: list[float]) -> tuple[float, float, float]:
    """How many robust standard deviations (1.4826 MAD) `value` lies above the median of `recent`; the
    median and the MAD. A window with no spread (MAD 0) takes a millionth of its median's size as scale."""
    median = statistics.median(recent)
    mad = statistics.median(abs(v - median) for v in recent)
    scale = MAD_TO_SIGMA * mad or 1e-6 * max(abs(median), 1e-12)
    return (value - median) / scale, median, mad


class Spikes(Callback):
    """After each optimizer step taken (one left out by `trainer.on_nonfinite=skip` is not watched), the
    watched values (`metrics`: the step's loss, its gradient norm), averaged over the processes in one
    small collective so that every rank decides alike, against the `window` steps before: a value more
    than `threshold` robust z-scores above their median is a spike. Each is warned, counted as
    `train/spikes` and appended to `<run dir>/spikes.jsonl`; with `action=rollback` the run returns to
    its newest checkpoint written at least `rollback_steps` before it (`Run.roll_back`), and the batches it
    leaves out are recorded with it. Its windows are checkpointed; its counts survive a rollback."""

    def __init__(self, settings: SpikeConfig) -> None:
        self.settings = settings
        self.names = [f"train/{metric.value}" for metric in settings.metrics]
        self.recent = {name: deque(maxlen=settings.window) for name in self.names}
        self.spikes = self.rollbacks = 0
        self.record: JsonLines | None = None
        self.spiked: dict[str, Any] | None = None  # the spike a rollback was asked for, until it is done

    def on_fit_start(self, run: Run) -> None:
        self.record = JsonLines(run.output_dir / SPIKES) if run.engine.is_main_process else None

    def on_optimizer_step(self, run: Run) -> None:
        if run.engine.optimizer_step_was_skipped:
            return
        values = dict(zip(self.names, self._values(run), strict=True))
        spiked = {}
        for name, value in values.items():
            recent = self.recent[name]
            if len(recent) == recent.maxlen and math.isfinite(value):
                z, median, mad = robust_z(value, list(recent))
                if z > self.settings.threshold:
                    spiked[name] = {"value": value, "z": round(z, 2), "median": median, "mad": mad}
        rolls_back = bool(spiked) and self.settings.action == SpikeAction.rollback
        if not rolls_back:  # a value rolled back is not the run's (the windows return to the checkpoint's)
            for name, value in values.items():
                if math.isfinite(value):  # a NaN is trainer.on_nonfinite's
                    self.recent[name].append(value)
        if not spiked:
            return
        self.spikes += 1
        said = ", ".join(
            f"{name} {v['value']:.4g} is {v['z']:.1f} robust z-scores above the median {v['median']:.4g} "
            f"(MAD {v['mad']:.3g})" for name, v in spiked.items()
        )  # fmt: skip
        log.warning("step %d: a spike: %s of the last %d steps", run.step, said, self.settings.window)
        entry = {"step": run.step, "spike": spiked, "action": self.settings.action.value}
        if not rolls_back:
            self._write(entry)
            run.log_metrics({"train/spikes": float(self.spikes)})
            return
        checkpoint = self._checkpoint_before(run)
        self.spiked = entry | {"checkpoint": str(checkpoint)}
        run.roll_back(checkpoint)

    def on_rollback(self, run: Run, from_step: int, left_out: LeftOut) -> None:
        """The checkpoint gave back this callback's windows of then; its counts are the run's since."""
        if self.spiked is None:
            return
        self.rollbacks += 1
        log.warning(
            "rolled back from step %d to %s (step %d); each process's batches from epoch %d batch %d up to "
            "epoch %d batch %d are left out", from_step, self.spiked["checkpoint"], run.step, *left_out.start,
            *left_out.end,
        )  # fmt: skip
        self._write(self.spiked | {"to_step": run.step, "left_out": left_out.record()})
        self.spiked = None
        run.log_metrics({"train/spikes": float(self.spikes), "train/rollbacks": float(self.rollbacks)})

    def _values(self, run: Run) -> list[float]:
        """This step's watched values, averaged over the processes (the gradient norm is alike on all)."""
        engine = run.engine
        parts = {"train/loss": run.step_loss, "train/grad_norm": run.grad_norm}
        stacked = torch.stack([parts[name].detach().float().to(engine.device) for name in self.names])
        return engine.reduce(stacked, "mean").tolist() if engine.num_processes > 1 else stacked.tolist()

    def _checkpoint_before(self, run: Run) -> Path:
        """The newest checkpoint at least `rollback_steps` before this step (the main process's choice),
        or TrainingDiverged naming why there is none."""
        engine, before = run.engine, run.step - self.settings.rollback_steps
        engine.wait_for_checkpoint()  # one being written in the background counts once whole
        found = engine.checkpointer.newest_at_or_before(before) if engine.is_main_process else None
        chosen = engine.broadcast_object_list([str(found or "")])[0]
        if not chosen:
            raise TrainingDiverged(
                f"a spike at step {run.step}, and trainer.spike.action=rollback found no checkpoint of this run "
                f"written at step {before} or before (trainer.spike.rollback_steps={self.settings.rollback_steps}) "
                "to return to: the run was stopped. Save earlier and more often (trainer.checkpoint_every), "
                "keep more (trainer.keep_checkpoints), or watch longer before acting (trainer.spike.window)."
            )
        return Path(chosen)

    def _write(self, entry: dict[str, Any]) -> None:
        if self.record is not None:
            self.record.append(entry)

    def state_dict(self) -> dict[str, Any]:
        return {
            "recent": {name: list(values) for name, values in self.recent.items()},
            "spikes": self.spikes,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, values in state["recent"].items():
            if name in self.recent:
                self.recent[name].clear()
                self.recent[name].extend(values)
        if self.spiked is None:  # a resume; a rollback's load leaves the counts going on
            self.spikes, self.rollbacks = state["spikes"], state["rollbacks"]
