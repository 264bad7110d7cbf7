"""Keep a run's best checkpoints by an eval metric (`callbacks=[best_checkpoints]`)."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any, Literal

from runner.callbacks.base import Callback, Monitor, Run
from runner.config import PositiveInt
from runner.files import write_json
from runner.run_dir import BEST, BEST_RECORD

log = logging.getLogger(__name__)



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
            run.engine.checkpointer.save(run.output_dir / BEST / f"step_{run.step}", step=run.step)
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




def _listed(kept: list[dict[str, Any]]) -> str:
    return ", ".join(f"step {e['step']} ({e['value']:.6g})" for e in kept)
