"""The share of a data mixture's training samples each source gave so far (a built-in callback named
`mixture`, of every run whose data is a mixture)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from runner.callbacks.base import Callback, Run
from runner.task import SOURCE

log = logging.getLogger(__name__)


class MixtureShares(Callback):
    """Counts the training samples drawn from each source of the mixture (each sample's `SOURCE`), over
    every data-parallel rank, and logs each source's share of them so far as `data/share/<source>` at each
    log step, beside its weight's share, `data/weight/<source>` (`weights`: source name -> its share of
    the draws). The counts are the run's since step 0: they are in every checkpoint, so a resumed run
    goes on from the checkpoint's and logs what the uninterrupted run logs (a rollback returns to the
    checkpoint's: the batches it leaves out are not counted).

    Each rank adds its micro-batches' counts on its device (no wait); they are summed over the ranks, in
    one collective of a number a source, at each log step, evaluation and checkpoint, so that every
    checkpoint holds all of them."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.drawn = torch.zeros(len(weights), dtype=torch.int64)  # every rank's, to the last sum
        self.pending: torch.Tensor | None = None  # this rank's since, on its device

    def on_fit_start(self, run: Run) -> None:
        self.pending = torch.zeros(len(self.weights), dtype=torch.int64, device=run.engine.device)
        weights = ", ".join(f"{name} {share:.1%}" for name, share in self.weights.items())
        log.info("a mixture of %d sources, drawn in the shares: %s", len(self.weights), weights)

    def train_batches(self, run: Run, batches: Iterable[Any]) -> Iterator[Any]:
        for batch in batches:
            assert self.pending is not None
            self.pending += torch.bincount(batch[SOURCE], minlength=len(self.weights))
            yield batch

    def on_log(self, run: Run, values: dict[str, float]) -> None:
        """After the loop's log window (its `train/lr`), alike on every rank."""
        if "train/lr" not in values:
            return
        self.add_up(run)
        shares = (self.drawn.double() / max(1, int(self.drawn.sum()))).tolist()
        run.log(
            {f"data/share/{name}": share for name, share in zip(self.weights, shares, strict=True)}
            | {f"data/weight/{name}": weight for name, weight in self.weights.items()}
        )

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        self.add_up(run)  # before a callback's checkpoint of the best model, say

    def on_checkpoint_start(self, run: Run) -> None:
        self.add_up(run)

    def on_train_end(self, run: Run) -> None:
        total = max(1, int(self.drawn.sum()))
        drawn = ", ".join(
            f"{name} {count / total:.1%} (weight {self.weights[name]:.1%})"
            for name, count in zip(self.weights, self.drawn.tolist(), strict=True)
        )
        log.info("drawn from the mixture's sources: %s of %d samples", drawn, total)

    def add_up(self, run: Run) -> None:
        """Sum every rank's counts since the last sum into `drawn` (a collective: called alike on every rank)."""
        if self.pending is None:
            return
        self.drawn += run.engine.reduce(self.pending, "sum").cpu()
        self.pending.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": dict(zip(self.weights, self.drawn.tolist(), strict=True))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = torch.tensor([state["drawn"].get(name, 0) for name in self.weights], dtype=torch.int64)
        if self.pending is not None:
            self.pending.zero_()
