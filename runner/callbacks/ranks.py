"""Every rank's step time, data wait and memory, and the rank that slows the others (a built-in callback
named `ranks`: `trainer.rank_metrics`, `trainer.straggler_ratio`)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch

from runner.callbacks.base import Callback, LeftOut, Run
from runner.perf import peak_memory_gb
from runner.telemetry.goodput import FetchClock, Ledger

log = logging.getLogger(__name__)

# What each rank measures over a log window, in the order of the gathered row.
MEASURED = ("step_time_s", "data_wait_s", "peak_memory_gb", "peak_host_memory_gb")


class RankMetrics(Callback):
    """At each logging step, one gather of every rank's own figures over the steps since the last: its
    time per step, the time per step it waited for its batches, and its peak device and host memory. They
    are logged (trackers, history) as `rank/<r>/<figure>`; on a CPU device, whose memory is the host's,
    without `peak_memory_gb`. (A run of one process has none: `built_callbacks`.)

    In synchronous training every rank steps at the pace of the slowest, so the step time is alike on every
    rank; a rank that waits longer for its batches than the others delays them all by the difference. That
    rank is a straggler when the steps take `ratio` times as long as they would without its extra wait (the
    excess over the other ranks' median): the console names it when it becomes one and when it is one no
    longer, and each window it slows is in the goodput ledger (`ledger`, the main process's). `ratio` 0:
    no straggler is named."""

    def __init__(self, ratio: float, ledger: Ledger | None = None) -> None:
        self.ratio = ratio
        self.ledger = ledger
        self.fetches = FetchClock()
        self.began: float | None = None  # when the window's steps began (None: at the next step's end)
        self.began_at = 0
        self.stepped = 0.0  # when the latest optimizer step ended
        self.stragglers: set[int] = set()

    def on_fit_start(self, run: Run) -> None:
        self.began = None

    def on_rollback(self, run: Run, from_step: int, left_out: LeftOut) -> None:
        self.began = None

    def on_optimizer_step(self, run: Run) -> None:
        """The steps' time is between optimizer steps' ends, which the gradients' synchronisation aligns
        across the ranks (what a process does alone between a step's end and the next, the main process's
        logging say, falls into the next step of every rank alike); it counts from the end of the first
        step (of the run, after a resume or a rollback): the ranks reach it together, whatever each did
        before."""
        self.stepped = time.perf_counter()
        if self.began is None:
            self.fetches.take()
            self.began, self.began_at = self.stepped, run.step

    def train_batches(self, run: Run, batches: Iterable[Any]) -> Iterable[Any]:
        return self.fetches.timed(batches)

    def on_log(self, run: Run, values: dict[str, float]) -> None:
        """After the loop's log window (its `perf/*`), alike on every rank."""
        if "perf/step_time_s" not in values or self.began is None or run.step == self.began_at:
            return  # not the loop's window, or no step measured yet (the window's first step began them)
        engine = run.engine
        steps = run.step - self.began_at
        waited = self.fetches.take()
        local = [(self.stepped - self.began) / steps, waited / steps, *peak_memory_gb(engine.device)]
        self.began, self.began_at = self.stepped, run.step
        mine = torch.tensor([local], dtype=torch.float32, device=engine.device)
        rows = engine.strategy.all_gather_processes(mine).tolist()  # every rank's, not only data-parallel ones
        cuda = engine.device.type == "cuda"
        figures = [(i, name) for i, name in enumerate(MEASURED) if cuda or name != "peak_memory_gb"]
        run.log({f"rank/{r}/{name}": row[i] for r, row in enumerate(rows) for i, name in figures})
        if self.ratio:
            self.find_stragglers(run, [row[0] for row in rows], [row[1] for row in rows], steps)

    def find_stragglers(self, run: Run, step_times: list[float], waits: list[float], steps: int) -> None:
        """Name the ranks whose extra data wait makes the window's steps `ratio` times as long."""
        step_time = max(step_times)
        found = stragglers(step_time, waits, self.ratio)
        main = run.engine.is_main_process
        for rank, excess in found.items():
            if main and rank not in self.stragglers:
                log.warning(
                    "rank %d is a straggler: it waits %.3g s a step for its batches, %.3g s more than the "
                    "other ranks' median, and every rank waits for it (steps of %.3g s, %.3g s without it; "
                    "trainer.straggler_ratio=%g)",
                    rank, waits[rank], excess, step_time, step_time - excess, self.ratio,
                )  # fmt: skip
            if self.ledger is not None:
                self.ledger.note("straggler", step=run.step, rank=rank, slowed_s=excess * steps)
        for rank in self.stragglers - found.keys():
            if main:
                log.info("rank %d is no longer a straggler (step %d)", rank, run.step)
        self.stragglers = set(found)


def stragglers(step_time: float, waits: list[float], ratio: float) -> dict[int, float]:
    """rank -> its excess: the ranks whose wait for batches (`waits`, seconds a step, by rank) beyond the
    other ranks' median makes steps of `step_time` `ratio` times as long as they would be without it."""
    found = {}
    for rank, waited in enumerate(waits):
        excess = waited - statistics.median(waits[:rank] + waits[rank + 1 :])
        if excess > 0 and step_time > ratio * (step_time - excess):
            found[rank] = excess
    return found
