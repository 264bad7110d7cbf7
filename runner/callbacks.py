"""Callbacks: code a run's training loop calls at its named points (`callbacks` in the config, each a
`_target_`), and the built-in ones: early stopping, the best checkpoints, a learning-rate monitor, and the
pictures of the run's curves (`trainer.plots`).

Every rank calls every callback at the same points with the same metrics (they are reduced over the ranks
first), so a callback that decides something (stop, save) decides it alike everywhere. A callback's
`state_dict` is saved with every checkpoint: a resumed run continues it where the checkpoint left it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import torch

from runner.config import NonNegativeFloat, PositiveInt, TrainerConfig
from runner.engine import Engine
from runner.errors import ConfigError, install_command
from runner.files import write_json
from runner.history import HISTORY

log = logging.getLogger(__name__)

BEST = "best"  # in a run dir: the best checkpoints (`BestCheckpoints`) and best.json
BEST_RECORD = "best.json"


class Run(Protocol):
    """What a callback sees of the run (the Trainer)."""

    engine: Engine
    output_dir: Path
    settings: TrainerConfig  # the trainer settings (`trainer.*`), typed
    total_steps: int  # optimizer steps the run trains
    metrics: dict[str, float]  # the latest value of every metric logged

    @property
    def step(self) -> int:
        """Optimizer steps done."""

    def log_metrics(self, values: dict[str, float]) -> None:
        """Log `values` at this step (the run's metrics, its history, the trackers)."""

    def stop(self, reason: str) -> None:
        """End the run after this step, as if it were the last (`reason` is logged)."""


class Callback:
    """Code the loop runs at its named points; each method does nothing unless overridden. A `monitor`
    argument names an eval metric, checked before launch against those the task reports."""

    def on_fit_start(self, run: Run) -> None:
        """Before the first step (of this process: after a resume, at the step resumed from)."""

    def on_step_end(self, run: Run) -> None:
        """After each optimizer step (its logging, evaluation and checkpoint done)."""

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        """After each evaluation, with its metrics (`eval/...`)."""

    def on_checkpoint(self, run: Run, path: Path) -> None:
        """After a checkpoint was saved to `path` (it may still be written in the background)."""

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


class Callbacks(Callback):
    """A run's callbacks by name, called in that order at each point; checkpointed as one object (the state
    of each by its name: a resume that adds a callback starts it fresh). A callback need not derive from
    `Callback`: a class with any of its methods is called at those points only (and one without
    `state_dict` has no state)."""

    def __init__(self, named: dict[str, Any]) -> None:
        self.named = named

    def _call(self, point: str, *arguments: Any) -> None:
        for callback in self.named.values():
            if (method := getattr(callback, point, None)) is not None:
                method(*arguments)

    def on_fit_start(self, run: Run) -> None:
        self._call("on_fit_start", run)

    def on_step_end(self, run: Run) -> None:
        self._call("on_step_end", run)

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        self._call("on_eval_end", run, metrics)

    def on_checkpoint(self, run: Run, path: Path) -> None:
        self._call("on_checkpoint", run, path)

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


class BestCheckpoints(Callback):
    """Keep the `keep` best checkpoints by `monitor` (an eval metric): `<run dir>/best/step_<n>/`, each a
    whole checkpoint (`trainer.resume=<it>` continues from it), and `best/best.json` listing them best
    first with their step and value. Saved at the evaluations that enter the best `keep`; one pushed out
    is deleted once the run's state no longer needs it: once a checkpoint that records the new list is
    complete (a resume from the checkpoint before would lack it), or at the run's end.

    Args:
        monitor: the metric, e.g. eval/loss.
        mode: min (lower is better) or max.
        keep: how many to keep.
    """

    def __init__(
        self, monitor: str = "eval/loss", mode: Literal["min", "max"] = "min", keep: PositiveInt = 1
    ) -> None:
        self.rule = Monitor("callbacks.best_checkpoints", monitor, mode)
        self.keep = keep
        self.kept: list[dict[str, Any]] = []  # {"step", "value"}, best first
        self.recorded: list[dict[str, Any]] = []  # the list the latest complete checkpoint holds
        self.writing: list[dict[str, Any]] | None = None  # the list of a checkpoint still being written

    def on_fit_start(self, run: Run) -> None:
        """Forget the checkpoints in best/ that this state does not hold (saved after the checkpoint this
        run resumed from, by the run that stopped)."""
        self.recorded = list(self.kept)  # the checkpoint resumed from, or none
        if run.engine.is_main_process:
            self._tidy(run.output_dir / BEST)

    def on_checkpoint(self, run: Run, path: Path) -> None:
        """A checkpoint holds the list now: the bests it does not list may go once it is complete (written
        in the background, at the next point where it is)."""
        self.writing = list(self.kept)
        self._written(run)

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        self.writing, self.recorded = None, list(self.kept)  # finished: the best list is the run's result
        if run.engine.is_main_process:
            self._tidy(run.output_dir / BEST)

    def _written(self, run: Run) -> None:
        """Once the checkpoint being written is complete, its list is the recorded one, and best/ tidied."""
        if self.writing is not None and not run.engine.checkpointer.in_progress:
            self.recorded, self.writing = self.writing, None
            if run.engine.is_main_process:
                self._tidy(run.output_dir / BEST)

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        value = metrics[self.rule.monitor]
        if len(self.kept) == self.keep and not self.rule.better(value, self.kept[-1]["value"]):
            return
        if math.isnan(value):
            return
        entry = {"step": run.step, "value": value}
        ranked = sorted(
            [*self.kept, entry],
            key=lambda e: (e["value"] if self.rule.mode == "min" else -e["value"], e["step"]),
        )
        self.kept = ranked[: self.keep]
        if entry in self.kept:
            run.engine.checkpointer.save_named(run.output_dir / BEST / f"step_{run.step}", run.step)
        self._written(run)
        if run.engine.is_main_process:
            self._tidy(run.output_dir / BEST)
            log.info("best checkpoints by %s: %s", self.rule.monitor, _listed(self.kept))

    def _tidy(self, best: Path) -> None:
        """best/ holds the checkpoints of `kept`, those a checkpoint of the run's state still lists, and the
        record of `kept`; nothing else of ours."""
        needed = [*self.kept, *self.recorded, *(self.writing or [])]
        wanted = {f"step_{e['step']}" for e in needed}
        for found in best.glob("step_*") if best.is_dir() else []:
            if found.name not in wanted:
                shutil.rmtree(found, ignore_errors=True)
        if self.kept:
            record = [e | {"path": str(best / f"step_{e['step']}")} for e in self.kept]
            summary = {"monitor": self.rule.monitor, "mode": self.rule.mode, "best": record}
            write_json(best / BEST_RECORD, summary)

    def state_dict(self) -> dict[str, Any]:
        return {"kept": [dict(e) for e in self.kept]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kept = [dict(e) for e in state["kept"]]


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


class PlotCurves(Callback):
    """Draw the run's curves into `<run dir>/plots/` (`runner.plots`) in a process of its own, started with
    the training and running only on CPU time the run leaves idle: it imports matplotlib while the run
    trains, draws at an evaluation (at most every `every_s` seconds, not while it is drawing, and only where
    the run's threads leave a core free), and at the end, where the run waits for the drawing of its whole
    history and names the files. The loop never waits on a picture; one that cannot be drawn is a warning.
    The main process's (`trainer.plots`, on unless false)."""

    every_s = 30.0  # seconds between drawings during training, at least

    def __init__(self) -> None:
        self.drawer: subprocess.Popen | None = None  # `python -m runner.plots --serve`
        self.errors: IO[bytes] | None = None  # its stderr
        self.asked = False  # a drawing asked for and not answered yet
        self.answer: dict[str, Any] = {}  # the latest answer
        self.drawn_from = -1  # the size of the history the latest drawing asked for started from
        self.started = -math.inf  # when it was asked for (time.monotonic)
        self.available = importlib.util.find_spec("matplotlib") is not None
        # Drawings during training only where the run's threads leave a core free: on a machine whose every
        # core computes the run (torch's threads on a CPU), one more process slows it.
        self.spare_core = (os.cpu_count() or 1) > torch.get_num_threads()

    def on_fit_start(self, run: Run) -> None:
        if self.available and run.engine.is_main_process and self.drawer is None:
            self.errors = tempfile.TemporaryFile()  # noqa: SIM115  (closed with the drawer, `_close`)
            self.drawer = subprocess.Popen(
                [sys.executable, "-m", "runner.plots", "--idle", "--serve", str(run.output_dir)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.errors,
                text=True,
            )

    def _ask(self, run: Run) -> None:
        assert self.drawer is not None and self.drawer.stdin is not None
        history = run.output_dir / HISTORY
        self.drawn_from = history.stat().st_size if history.is_file() else 0
        self.started = time.monotonic()
        try:
            self.drawer.stdin.write("draw\n")
            self.drawer.stdin.flush()
        except OSError:  # it ended: its answer says how
            pass
        self.asked = True

    def _answered(self, wait: bool) -> bool:
        """Whether the drawing asked for is answered (its answer in `self.answer`); `wait`: until it is."""
        assert self.drawer is not None and self.drawer.stdout is not None
        if not wait and select.select([self.drawer.stdout], [], [], 0)[0] == []:
            return False
        line = self.drawer.stdout.readline()
        self.asked = False
        if line:
            self.answer = json.loads(line)
        else:
            assert self.errors is not None
            self.errors.seek(0)
            said = self.errors.read().decode(errors="replace").strip()[-500:]
            self.answer = {"error": f"the drawing process ended (exit {self.drawer.wait()}): {said}"}
        return True

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        due = self.spare_core and time.monotonic() - self.started >= self.every_s
        if self.drawer is not None and due and (not self.asked or self._answered(wait=False)):
            self._ask(run)

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        if not run.engine.is_main_process:
            return
        if not self.available:
            log.info(
                "the run's curves are not drawn: matplotlib is not installed (%s)", install_command("plots")
            )
            return
        self.on_fit_start(run)  # started there, unless this process trained nothing
        if self.asked:
            self._answered(wait=True)
        history = run.output_dir / HISTORY
        if "drawn" not in self.answer or self.drawn_from != (
            history.stat().st_size if history.is_file() else 0
        ):
            self._ask(run)  # the last evaluation's drawing is not of the whole history, or failed
            self._answered(wait=True)
        self._close()
        if "error" in self.answer:
            log.warning("the plots could not be drawn: %s", self.answer["error"])
            return
        log.info("plots: %s", " ".join(sorted(self.answer["drawn"])))

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        """The drawer ends once its stdin does (after a drawing it is doing)."""
        if self.drawer is not None:
            with contextlib.suppress(OSError):
                self.drawer.stdin.close()  # type: ignore[union-attr]
            self.drawer.wait()
            self.drawer.stdout.close()  # type: ignore[union-attr]
            self.errors.close()  # type: ignore[union-attr]
            self.drawer = None


def _listed(kept: list[dict[str, Any]]) -> str:
    return ", ".join(f"step {e['step']} ({e['value']:.6g})" for e in kept)
