"""The callback contract: what a callback sees of the run (`Run`), the points the loop calls it at
(`Callback`), and a run's callbacks by name (`Callbacks`).

Every rank calls every callback at the same points with the same metrics (they are reduced over the ranks
first), so a callback that decides something (stop, save) decides it alike everywhere. A callback's
`state_dict` is saved with every checkpoint: a resumed run continues it where the checkpoint left it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from runner.config import TrainerConfig
from runner.engine import Engine
from runner.errors import ConfigError


@dataclass(frozen=True)
class LeftOut:
    """The batches a rollback skipped: in each data-parallel process's order, its micro-batches from
    `start` (epoch, batch: where the checkpoint was) up to `end` (where the run was), `end` excluded."""

    start: tuple[int, int]
    end: tuple[int, int]

    def record(self) -> dict[str, dict[str, int]]:
        return {name: {"epoch": e, "batch": b} for name, (e, b) in (("from", self.start), ("to", self.end))}


class Run(Protocol):
    """What a callback sees of the run (the Trainer)."""

    engine: Engine
    output_dir: Path
    settings: TrainerConfig  # the trainer settings (`trainer.*`), typed
    total_steps: int  # optimizer steps the run trains
    metrics: dict[str, float]  # the latest value of every metric logged
    train_loader: Any  # the prepared training loader (its `dataset`, `batch_size`, `collate_fn`)

    @property
    def step(self) -> int:
        """Optimizer steps done."""

    def log_metrics(self, values: dict[str, float]) -> None:
        """Log `values` at this step (the run's metrics, its history, the trackers)."""

    def log(self, values: dict[str, float]) -> None:
        """Log `values` at this step to the trackers and the history, not as the run's metrics (a summary)."""

    def stop(self, reason: str) -> None:
        """End the run after this step, as if it were the last (`reason` is logged)."""

    def evaluate(self, heading: str | None = None, loader: Any = None, prefix: str = "eval") -> None:
        """Run the eval loop now, its metrics logged at this step (and `on_eval_end`); over a prepared
        `loader` of other samples, its metrics named `<prefix>/...` (and no `on_eval_end`)."""

    def roll_back(self, checkpoint: Path) -> None:
        """After this optimizer step (asked in `on_optimizer_step`, alike on every rank): return the model,
        the optimizer, the schedule, the RNGs and the callbacks to `checkpoint`, the data going on where it
        is (the batches since the checkpoint are left out); then `on_rollback`."""

    @property
    def step_loss(self) -> torch.Tensor | None:
        """The last optimizer step's mean loss on this process (on the device), where the run keeps it
        (`trainer.spike`), else None."""

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last optimizer step's total gradient norm before clipping, where the run measures it
        (`trainer.max_grad_norm`, `trainer.spike` of grad_norm), else None."""


class Callback:
    """Code the loop runs at its named points; each method does nothing unless overridden. A `monitor`
    argument names an eval metric, checked before launch against those the task reports."""

    def train_batches(self, run: Run, batches: Iterable[Any]) -> Iterable[Any]:
        """At each epoch's start (and where a rollback starts its pass again): the batches the loop takes, as
        given or wrapped (to time each fetch, say)."""
        return batches

    def on_fit_start(self, run: Run) -> None:
        """Before the first step (of this process: after a resume, at the step resumed from)."""

    def on_optimizer_step(self, run: Run) -> None:
        """Right after each optimizer step, before what is due at it (its logging, evaluation, checkpoints)."""

    def on_step_end(self, run: Run) -> None:
        """After each optimizer step (its logging, evaluation and checkpoint done)."""

    def on_rollback(self, run: Run, from_step: int, left_out: LeftOut) -> None:
        """After the run returned from step `from_step` to an earlier checkpoint's state (`run.step`), the
        batches `left_out` skipped (`Run.roll_back`)."""

    def on_log(self, run: Run, values: dict[str, float]) -> None:
        """After `values` were logged at this step: a logging step's train window and an evaluation's
        metrics (checked finite), a callback's own, the goodput summary at the run's end."""

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        """After each evaluation, with its metrics (`eval/...`)."""

    def on_eval_batch_end(self, run: Run) -> None:
        """After each batch of an evaluation."""

    def on_checkpoint_start(self, run: Run) -> None:
        """Before a numbered checkpoint is saved (one the schedule asks for, or a stop's)."""

    def on_checkpoint(self, run: Run, path: Path) -> None:
        """After a checkpoint was saved to `path` (it may still be written in the background)."""

    def on_train_end(self, run: Run) -> None:
        """When the loop ends (its last step done, or the final evaluation of a run stopped early), before
        the model is saved; in `mode=evaluate`, after the evaluation."""

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        """After training, with the final metrics (the model saved, the run recorded finished)."""

    def on_exception(self, run: Run, error: BaseException) -> None:
        """When the loop fails or is interrupted, before the error goes on."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @classmethod
    def check_settings(cls, node: str, settings: Any, trainer: Any) -> list[str]:
        """Before launch: what is wrong with these settings (`node`: where they are, "callbacks.<name>")
        given the run's `trainer` settings, each one paragraph; none by default."""
        return []


# The points the loop calls, in the order of a run.
POINTS = (
    "train_batches",
    "on_fit_start",
    "on_optimizer_step",
    "on_rollback",
    "on_log",
    "on_eval_batch_end",
    "on_eval_end",
    "on_checkpoint_start",
    "on_checkpoint",
    "on_step_end",
    "on_train_end",
    "on_fit_end",
    "on_exception",
)


def _defined(callback: Any, point: str) -> Any:
    """`callback`'s method for `point`, unless it is `Callback`'s (which does nothing) or it has none."""
    method = getattr(callback, point, None)
    if method is None or getattr(type(callback), point, None) is getattr(Callback, point):
        return None
    return method


class Callbacks(Callback):
    """A run's callbacks by name, called in that order at each point; checkpointed as one object (the state
    of each by its name: a resume that adds a callback starts it fresh). A callback need not derive from
    `Callback`: a class with any of its methods is called at those points only (and one without
    `state_dict` has no state)."""

    def __init__(self, named: dict[str, Any]) -> None:
        self.named = named
        # Each point's methods in order, of the callbacks that define it (not `Callback`'s, which do
        # nothing): the loop calls some points at every step.
        self.methods = {
            point: [method for c in named.values() if (method := _defined(c, point)) is not None]
            for point in POINTS
        }

    def _call(self, point: str, *arguments: Any) -> None:
        for method in self.methods[point]:
            method(*arguments)

    def train_batches(self, run: Run, batches: Iterable[Any]) -> Iterable[Any]:
        for method in self.methods["train_batches"]:
            batches = method(run, batches)
        return batches

    def on_fit_start(self, run: Run) -> None:
        self._call("on_fit_start", run)

    def on_optimizer_step(self, run: Run) -> None:
        for method in self.methods["on_optimizer_step"]:  # at every step: without `_call`'s frame
            method(run)

    def on_step_end(self, run: Run) -> None:
        for method in self.methods["on_step_end"]:
            method(run)

    def on_rollback(self, run: Run, from_step: int, left_out: LeftOut) -> None:
        self._call("on_rollback", run, from_step, left_out)

    def on_log(self, run: Run, values: dict[str, float]) -> None:
        self._call("on_log", run, values)

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        self._call("on_eval_end", run, metrics)

    def on_eval_batch_end(self, run: Run) -> None:
        self._call("on_eval_batch_end", run)

    def on_checkpoint_start(self, run: Run) -> None:
        self._call("on_checkpoint_start", run)

    def on_checkpoint(self, run: Run, path: Path) -> None:
        self._call("on_checkpoint", run, path)

    def on_train_end(self, run: Run) -> None:
        self._call("on_train_end", run)

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        self._call("on_fit_end", run, metrics)

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._call("on_exception", run, error)

    def state_dict(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self.named.items() if hasattr(c, "state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, saved in state.items():
            if hasattr(self.named.get(name), "load_state_dict"):
                self.named[name].load_state_dict(saved)


class Monitor:
    """Which way a metric is better: `mode` "min" or "max", by more than `min_delta`."""

    def __init__(self, key: str, monitor: str, mode: str, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"{key}.mode={mode!r}: expected min (lower {monitor} is better) or max.")
        if min_delta < 0:
            raise ConfigError(f"{key}.min_delta={min_delta}: must be >= 0 (the improvement that counts).")
        self.monitor, self.mode, self.min_delta = monitor, mode, min_delta

    def better(self, value: float, than: float | None) -> bool:
        """Whether `value` improves on `than` (None: nothing yet) by more than `min_delta`; NaN never does."""
        if math.isnan(value):
            return False
        if than is None:
            return True
        return value < than - self.min_delta if self.mode == "min" else value > than + self.min_delta
