"""torch.profiler over a window of optimizer steps (`trainer.profile`, a built-in callback named
`profile`)."""

from __future__ import annotations

from runner.callbacks.base import Callback, Run
from runner.config import ProfileConfig
from runner.perf import Profiler
from runner.run_dir import PROFILE


class ProfileSteps(Callback):
    """Profile the steps `config` names (skip `wait`, warm up `warmup`, record `active`) on every rank:
    `<run dir>/profile/trace_rank<r>.json` and `key_averages_rank<r>.txt` once the window closes."""

    def __init__(self, config: ProfileConfig) -> None:
        self.config = config
        self.profiler: Profiler | None = None

    def on_fit_start(self, run: Run) -> None:
        engine = run.engine
        self.profiler = Profiler(self.config, run.output_dir / PROFILE, engine.process_index, engine.device)
        self.profiler.profile.start()

    def on_step_end(self, run: Run) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        self._stop()

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.profiler is not None:
            self.profiler.profile.stop()
            self.profiler = None
