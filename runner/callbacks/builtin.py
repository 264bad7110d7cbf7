"""A run's callbacks from its config: the built-ins its trainer settings switch on, then `callbacks:`."""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from runner.callbacks.eval_at_start import EvaluateAtStart
from runner.callbacks.goodput import GoodputLedger
from runner.callbacks.history import RecordHistory
from runner.callbacks.mixture import MixtureShares
from runner.callbacks.plots import PlotCurves
from runner.callbacks.profiler import ProfileSteps
from runner.callbacks.progress import ProgressBar
from runner.callbacks.ranks import RankMetrics
from runner.callbacks.skipped_steps import SkippedSteps
from runner.callbacks.spikes import Spikes
from runner.callbacks.train_sample import EvaluateTrainSample
from runner.callbacks.watchdog import HangWatchdog
from runner.config import NonFinite, TrainerConfig
from runner.telemetry.goodput import Ledger


def built_callbacks(
    callbacks: DictConfig | None,
    trainer: TrainerConfig,
    evaluating: bool = False,
    ledger: Ledger | None = None,
    processes: int = 1,
    mixture: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's callbacks by name, in the order the loop calls them: `goodput` (the main process's
    `ledger`, where the run records one), `watchdog` (`trainer.hang_timeout_s` not 0), those of training
    (`training_callbacks`), `ranks` (`trainer.rank_metrics`, of a run of several `processes`), `mixture`
    (of data that is a `mixture`: its sources' shares of the draws), then those of `callbacks:`, where one
    named like a built-in replaces it and a name set to null switches it off. `evaluating` (`mode=evaluate`,
    which trains nothing): the watchdog and the history only."""
    named: dict[str, Any] = {}
    if ledger is not None and ledger.recording:
        named["goodput"] = GoodputLedger(ledger)
    if trainer.hang_timeout_s != 0:
        named["watchdog"] = HangWatchdog(trainer.hang_timeout_s)
    if evaluating:
        return named | {"history": RecordHistory()}
    named |= training_callbacks(trainer)
    if trainer.rank_metrics and processes > 1:  # after the history: it records the log window before the ranks' figures
        named["ranks"] = RankMetrics(trainer.straggler_ratio, ledger)
    if mixture:
        named["mixture"] = MixtureShares(mixture)
    for name, node in (callbacks or {}).items():
        if node is None:
            named.pop(name, None)
        else:
            named[name] = instantiate(node)
    return named


def training_callbacks(trainer: TrainerConfig) -> dict[str, Any]:
    """The built-ins of a training loop, in their order: `skipped_steps` (`trainer.on_nonfinite=skip`),
    `spikes` (`trainer.spike.window` > 0), `history`, `progress` (`trainer.progress_bar`), `profile`
    (`trainer.profile.active` > 0), `plots` (`trainer.plots`), `eval_train` (`trainer.eval_train_batches`), `eval_at_start`
    (`trainer.eval_at_start`)."""
    named: dict[str, Any] = {}
    if trainer.on_nonfinite == NonFinite.skip:
        named["skipped_steps"] = SkippedSteps(trainer.max_skipped_steps)
    if trainer.spike.window:
        named["spikes"] = Spikes(trainer.spike)
    named["history"] = RecordHistory()
    if trainer.progress_bar:
        named["progress"] = ProgressBar()
    if trainer.profile.active:
        named["profile"] = ProfileSteps(trainer.profile)
    if trainer.plots:
        named["plots"] = PlotCurves()
    if trainer.eval_train_batches:  # before eval_at_start: ready for its evaluation
        named["eval_train"] = EvaluateTrainSample(trainer.eval_train_batches)
    if trainer.eval_at_start:  # after the history and the plots, which record its metrics
        named["eval_at_start"] = EvaluateAtStart()
    return named
