"""Callbacks: code a run's training loop calls at its named points.

`base` is the contract. The built-ins are the loop's own periodic concerns, made from the trainer's
settings and named: `goodput` (the goodput ledger's phases of the loop), `watchdog`
(`trainer.hang_timeout_s`), `skipped_steps` (`trainer.on_nonfinite=skip`), `spikes` (`trainer.spike`),
`history` (`history.jsonl`), `progress` (the progress bar, `trainer.progress_bar`), `ranks` (every
rank's figures and stragglers, `trainer.rank_metrics`), `mixture` (a data mixture's shares drawn), `profile`
(`trainer.profile`), `plots` (`trainer.plots`), `eval_train` (`trainer.eval_train_batches`) and
`eval_at_start` (`trainer.eval_at_start`). The shipped ones a config adds (`callbacks=[...]`, each a `_target_`): early stopping, the best checkpoints, a
learning-rate monitor. A callback in `callbacks:` named like a built-in replaces it;
`callbacks.<name>=null` switches one off.
"""

from runner.callbacks.base import Callback, Callbacks, Monitor, Run
from runner.callbacks.best_checkpoints import BestCheckpoints
from runner.callbacks.builtin import built_callbacks
from runner.callbacks.early_stopping import EarlyStopping
from runner.callbacks.eval_at_start import EvaluateAtStart
from runner.callbacks.goodput import GoodputLedger
from runner.callbacks.history import RecordHistory
from runner.callbacks.lr_monitor import LearningRateMonitor
from runner.callbacks.mixture import MixtureShares
from runner.callbacks.plots import PlotCurves
from runner.callbacks.profiler import ProfileSteps
from runner.callbacks.progress import ProgressBar
from runner.callbacks.ranks import RankMetrics
from runner.callbacks.skipped_steps import SkippedSteps
from runner.callbacks.spikes import Spikes
from runner.callbacks.watchdog import HangWatchdog

__all__ = [
    "BestCheckpoints",
    "Callback",
    "Callbacks",
    "EarlyStopping",
    "EvaluateAtStart",
    "GoodputLedger",
    "HangWatchdog",
    "LearningRateMonitor",
    "MixtureShares",
    "Monitor",
    "PlotCurves",
    "ProfileSteps",
    "ProgressBar",
    "RankMetrics",
    "RecordHistory",
    "Run",
    "SkippedSteps",
    "Spikes",
    "built_callbacks",
]
