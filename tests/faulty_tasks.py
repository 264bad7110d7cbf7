"""Tasks and data that misbehave, for the failure tests (imported by `python -m runner` through
PYTHONPATH). Each misbehaves in the ranks only: the check before launch runs one step on meta tensors in
the launching process, where RANK is not set."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from runner.data import SyntheticRegression
from runner.task import model_outputs
from runner.tasks.language_modeling import LanguageModeling
from runner.tasks.regression import Regression


class RaiseOnRank1(Regression):
    """Rank 1 raises at its third step."""

    steps = 0

    def training_step(self, model, batch):
        self.steps += 1
        if os.environ.get("RANK") == "1" and self.steps == 3:
            raise RuntimeError("injected failure on rank 1")
        return super().training_step(model, batch)


class RaiseAtThirdStep(Regression):
    """Raises at its third step (in every process)."""

    steps = 0

    def training_step(self, model, batch):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("injected failure at step 3")
        return super().training_step(model, batch)


class HangOnRank1(Regression):
    """Rank 1 stops answering collectives at its third step."""

    steps = 0

    def training_step(self, model, batch):
        self.steps += 1
        if os.environ.get("RANK") == "1" and self.steps == 3:
            time.sleep(3600)
        return super().training_step(model, batch)


class WaitAtStep(Regression):
    """At its `step`-th training step, waits (at most 5 minutes) until the file `gate` exists: the test acts
    while the run stands at a known point, then lets it go on."""

    def __init__(self, gate: str, step: int) -> None:
        self.gate, self.step, self.steps = Path(gate), step, 0

    def training_step(self, model, batch):
        if next(model.parameters()).device.type != "meta":  # not the check's step before launch
            self.steps += 1
            deadline = time.monotonic() + 300
            while self.steps == self.step and not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().training_step(model, batch)


class RecordPid(Regression):
    """Each rank writes its pid to `<pid_dir>/rank<N>` at its first step, then trains normally."""

    def __init__(self, pid_dir: str) -> None:
        self.pid_dir = Path(pid_dir)
        self.recorded = False

    def training_step(self, model, batch):
        if not self.recorded and "RANK" in os.environ:
            staged = self.pid_dir / f".rank{os.environ['RANK']}.tmp"
            staged.write_text(str(os.getpid()))
            staged.rename(self.pid_dir / f"rank{os.environ['RANK']}")  # readers never see a half-written file
            self.recorded = True
        return super().training_step(model, batch)


class ComputeInInit(SyntheticRegression):
    """Data whose constructor computes with all of torch's threads (it runs in the launching process)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        matrix = torch.randn(1500, 1500)
        self.checksum = float((matrix @ matrix).sum())


class SlowToLoad(SyntheticRegression):
    """Data whose loading (in the ranks, before the first step) touches `$SLOW_DATA_MARKER`, then takes a
    minute: time to interrupt a run before it could write a checkpoint."""

    def load(self):
        Path(os.environ["SLOW_DATA_MARKER"]).touch()
        time.sleep(60)
        return super().load()


class HeldOnceMarked(SyntheticRegression):
    """Data whose loader workers, once `$SLOW_SAMPLES_MARKER` exists, each stop at their next sample
    until `$SLOW_SAMPLES_HOLD` is gone: a worker busy on a sample when its run is killed lives on until
    it is done (and so does what it inherited)."""

    def load(self):
        train, eval_, dims = super().load()
        marker, hold = Path(os.environ["SLOW_SAMPLES_MARKER"]), Path(os.environ["SLOW_SAMPLES_HOLD"])
        return _HeldOnceMarked(train, marker, hold), eval_, dims


class _HeldOnceMarked(torch.utils.data.Dataset):
    def __init__(self, samples, marker: Path, hold: Path) -> None:
        self.samples, self.marker, self.hold, self.held = samples, marker, hold, False

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index):
        if not self.held and torch.utils.data.get_worker_info() is not None and self.marker.exists():
            self.held = True  # in this worker's copy
            while self.hold.exists():
                time.sleep(0.05)
        return self.samples[index]


class OwnTrainingStep(LanguageModeling):
    """Computes its loss in its own training_step (which pipeline parallel cannot split by microbatch)."""

    def training_step(self, model, batch):
        return self.loss(model_outputs(model, batch), batch)


class HangOnRank1Once(HangOnRank1):
    """As HangOnRank1, in the job's first attempt only: the rank group that torch's agent restarts goes on."""

    def training_step(self, model, batch):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return Regression.training_step(self, model, batch)
        return super().training_step(model, batch)


class SkipCollectiveOnRank1(Regression):
    """At the third step every rank but 1 enters a barrier: rank 1 skips that collective and goes on to the
    step's gradient all-reduce, where it waits for ranks that wait in the barrier."""

    steps = 0

    def training_step(self, model, batch):
        self.steps += 1
        if os.environ.get("RANK") not in (None, "1") and self.steps == 3:
            torch.distributed.barrier()
        return super().training_step(model, batch)


class NonFiniteAtSteps(Regression):
    """The loss is NaN at its training steps `at` and after, up to `until` (1-based, inclusive; null: only
    `at`), on rank `rank` alone (null: on every process)."""

    def __init__(self, at: int, until: int | None = None, rank: int | None = None) -> None:
        self.at, self.until, self.rank, self.steps = at, at if until is None else until, rank, 0

    def training_step(self, model, batch):
        loss = super().training_step(model, batch)
        if loss.device.type == "meta":  # the check's step before launch
            return loss
        self.steps += 1
        poisoned = self.at <= self.steps <= self.until
        if poisoned and (self.rank is None or os.environ.get("RANK") == str(self.rank)):
            return loss * float("nan")
        return loss


class PoisonedRegression(SyntheticRegression):
    """SyntheticRegression whose training samples `poisoned` (positions in the training set) have targets
    `factor` times too large: the batch that holds one makes the loss spike, at whatever step the order
    puts it (rolled back past, it is not seen again)."""

    def __init__(self, poisoned: list[int], factor: float = 1000.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.poisoned, self.factor = list(poisoned), factor

    def load(self):
        train, eval_, sizes = super().load()
        for i in self.poisoned:
            train.dataset.tensors["targets"][train.indices[i]] *= self.factor
        return train, eval_, sizes
