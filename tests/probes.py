"""Probes for the option tests: a task and an optimizer that record what the training loop did to them, so
that a test fails when an option is silently ignored, and a strategy and a model that count how often they are
built (imported by `python -m runner` through PYTHONPATH).

Each rank appends to `<record>.rank<N>.<kind>`; `read` collects them.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from runner.callbacks import Callback
from runner.data import SyntheticRegression
from runner.hardware import DDP, SingleDevice
from runner.models.mlp import MLP
from runner.tasks.language_modeling import LanguageModeling
from runner.tasks.regression import Regression
from runner.trackers import GeneralTracker


def _append(record: str, kind: str, line: str) -> None:
    with open(f"{record}.rank{os.environ.get('RANK', '0')}.{kind}", "a") as file:
        file.write(line + "\n")


def read(record: str | Path, kind: str, rank: int = 0) -> list[str]:
    """What rank `rank` recorded: one line per training step ("task": the dtype the model's first linear
    layer computed in) or per optimizer step ("optimizer": the total gradient norm it applied)."""
    path = Path(f"{record}.rank{rank}.{kind}")
    return path.read_text().split() if path.exists() else []


class Recording:
    """A task recording for each micro-batch the dtype its model's first linear layer computed in (fp32,
    or the autocast dtype)."""

    def __init__(self, record: str) -> None:
        self.record = record

    def training_step(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
        seen: list[torch.dtype] = []
        handle = linear.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
        try:
            loss = super().training_step(model, batch)
        finally:
            handle.remove()
        if loss.device.type != "meta":  # the check before launch runs one step on meta tensors
            _append(self.record, "task", str(seen[0]).removeprefix("torch."))
        return loss


class RecordingRegression(Recording, Regression):
    pass


class RecordingLanguageModeling(Recording, LanguageModeling):
    pass


class NormRecording:
    """An optimizer recording, at each step it takes, the total norm of the gradients it applies (after
    any clipping and loss unscaling)."""

    def __init__(self, params: Any, record: str, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.record = record

    def step(self, closure: Any = None) -> Any:
        grads = [
            p.grad.detach().flatten()
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        _append(self.record, "optimizer", repr(torch.cat(grads).norm().item()))
        return super().step(closure)


class NormRecordingAdamW(NormRecording, torch.optim.AdamW):
    pass


class NormRecordingSGD(NormRecording, torch.optim.SGD):
    pass


def _count_construction(variable: str = "PROBE_BUILDS", device: str = "") -> None:
    """One line per object built, naming the process that built it (and the device of its parameters) in
    the file $`variable`."""
    with open(os.environ[variable], "a") as file:
        file.write(f"{os.getpid()}{device and ':' + device}\n")


class CountedSingleDevice(SingleDevice):
    def __init__(self, **settings: Any) -> None:
        _count_construction()
        super().__init__(**settings)


class CountedDDP(DDP):
    def __init__(self, **settings: Any) -> None:
        _count_construction()
        super().__init__(**settings)


class CountedMLP(MLP):
    """runner's MLP, counting its constructions in $PROBE_MODELS (with the device it was built on)."""

    @functools.wraps(MLP.__init__)  # its signature, for the sizes the data fills in
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _count_construction("PROBE_MODELS", next(self.parameters()).device.type)


class CountedRegressionData(SyntheticRegression):
    """runner's synthetic regression data, counting the reads of its samples in $PROBE_DATA."""

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        _count_construction("PROBE_DATA")
        return super().load()


class GlobalRNGRegressionData(SyntheticRegression):
    """runner's synthetic regression data, drawing from torch's global RNG as it reads (as a user's may)."""

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        torch.rand(1)
        return super().load()


class _Delayed(torch.utils.data.Dataset):
    """`samples`, each taking `delay_s` to read."""

    def __init__(self, samples: Any, delay_s: float) -> None:
        self.samples, self.delay_s = samples, delay_s

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.delay_s)
        return self.samples[index]


class SlowRankRegressionData(SyntheticRegression):
    """runner's synthetic regression data whose training samples take `delay_s` each to read on the rank
    `slow_rank` (a straggler: a slow disk, a busy host)."""

    def __init__(self, delay_s: float = 0.0, slow_rank: int = 1, **settings: Any) -> None:
        super().__init__(**settings)
        self.delay_s, self.slow_rank = delay_s, slow_rank

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        train, eval_, sizes = super().load()
        if int(os.environ.get("RANK", "0")) == self.slow_rank:
            train = _Delayed(train, self.delay_s)
        return train, eval_, sizes


class LossRecordingRegression(Regression):
    """The regression task recording, per call of its loss, whether torch.compile traced it:
    "compiled" (the value `is_compiling()` had when the call was traced) or "eager"."""

    def __init__(self, record: str) -> None:
        self.record = record

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        if outputs.device.type != "meta":  # not the checks' and the FLOP count's steps on meta tensors
            _append(self.record, "loss", "compiled" if torch.compiler.is_compiling() else "eager")
        return super().loss(outputs, batch)


class ComputeRecordingLanguageModeling(LanguageModeling):
    """A language-modelling task recording, per micro-batch, how the compute options left the model it
    trains: "<compiled blocks>,<checkpointed blocks>,<root compiled>,<float8 linears>"."""

    def __init__(self, record: str) -> None:
        self.record = record

    def training_step(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        loss = super().training_step(model, batch)
        if loss.device.type != "meta":
            modules = list(model.modules())
            blocks = [m for m in modules if type(m).__name__ == "Block"]
            compiled = sum(m._compiled_call_impl is not None for m in blocks)
            checkpointed = sum("_unchecked_forward" in m.__dict__ for m in blocks)
            root = next(m for m in modules if type(m).__name__ == "GPT")
            float8 = sum(type(m).__name__ == "Float8Linear" for m in modules)
            line = f"{compiled},{checkpointed},{int(root._compiled_call_impl is not None)},{float8}"
            _append(self.record, "compute", line)
        return loss


class RecordingCallback(Callback):
    """Records each point the loop calls it at ("<point>|<step>|<calls>"), and counts the calls in its
    state (what a resumed run continues); at the fit's start, whether the cyclic garbage collector is on
    ("gc")."""

    def __init__(self, record: str) -> None:
        self.record = record
        self.calls = 0

    def _seen(self, run: Any, point: str) -> None:
        self.calls += 1
        _append(self.record, "callback", f"{point}|{run.step}|{self.calls}")

    def on_fit_start(self, run: Any) -> None:
        self._seen(run, "fit_start")
        _append(self.record, "gc", "collecting" if gc.isenabled() else "paused")

    def on_step_end(self, run: Any) -> None:
        self._seen(run, "step_end")

    def on_eval_end(self, run: Any, metrics: dict[str, float]) -> None:
        self._seen(run, f"eval_end:{','.join(sorted(metrics))}")

    def on_log(self, run: Any, values: dict[str, float]) -> None:
        self._seen(run, f"log:{','.join(sorted(values))}")

    def on_checkpoint(self, run: Any, path: Path) -> None:
        self._seen(run, f"checkpoint:{path.name}")

    def on_fit_end(self, run: Any, metrics: dict[str, float]) -> None:
        self._seen(run, "fit_end")

    def on_exception(self, run: Any, error: BaseException) -> None:
        self._seen(run, f"exception:{type(error).__name__}")

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = state["calls"]


class FinalWeights(Callback):
    """Writes the whole model's weights (gathered from every rank, frozen ones included) to `path` as
    safetensors when the fit ends."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, run: Any, metrics: dict[str, float]) -> None:
        weights = run.engine.get_state_dict(run.model)
        if run.engine.is_main_process:
            save_file({name: t.contiguous() for name, t in weights.items()}, self.path)


class OnlyStepEnd:
    """A user's callback as docs/callbacks.md allows: a plain class with one of the methods (no base
    class, no state): appends the step to `record` after each."""

    def __init__(self, record: str) -> None:
        self.record = record

    def on_step_end(self, run: Any) -> None:
        with open(self.record, "a") as f:
            f.write(f"{run.step}\n")


class StopAtStep(Callback):
    """Ends the run after optimizer step `at` (as a user's stopping callback, docs/callbacks.md)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, run: Any) -> None:
        if run.step >= self.at:
            run.stop(f"step {self.at} reached")


class _HeldPickle:
    """Pickled (a background checkpoint writes the callbacks' state in its thread) the first time in a
    process: writes `marker`, then waits (at most 5 minutes) until `gate` exists."""

    held = False  # this process held one write already

    def __init__(self, gate: str, marker: str) -> None:
        self.gate, self.marker = gate, marker

    def __reduce__(self) -> tuple[Any, ...]:
        if not _HeldPickle.held:
            _HeldPickle.held = True
            Path(self.marker).write_text("a checkpoint's write is held\n")
            deadline = time.monotonic() + 300
            while not Path(self.gate).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return (_HeldPickle, (self.gate, self.marker))


class HoldFirstWrite(Callback):
    """Holds the run's first checkpoint write until the file `gate` exists, having written `marker`: with
    trainer.async_checkpoint=true the test acts while that write is pending in the background."""

    def __init__(self, gate: str, marker: str) -> None:
        self.gate, self.marker = gate, marker

    def state_dict(self) -> dict[str, Any]:
        return {"held": _HeldPickle(self.gate, self.marker)}


class FileTracker(GeneralTracker):
    """A user's own tracker (Accelerate's GeneralTracker contract), by `_target_` in a `tracker/` option of
    the user's config dir: each call a JSON line of `path`."""

    name = "file"

    def __init__(self, path: str, prefix: str = "") -> None:
        super().__init__()
        self.path, self.prefix = Path(path), prefix

    def _write(self, **call: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(call) + "\n")

    def start(self) -> None:
        self._write(op="start")

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._write(op="config", max_steps=values["trainer"]["max_steps"])

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._write(op="log", step=step, values={f"{self.prefix}{k}": v for k, v in values.items()})

    def finish(self) -> None:
        self._write(op="finish")


class SampleOrder(Callback):
    """Each rank appends, for every batch it trains on, "<time> <step> <rank> <world size> <sample ids>" to
    `<record>.rank<N>.samples` (a sample's id: the CRC-32 of its features): `global_batches` puts the
    global batches back together."""

    def __init__(self, record: str) -> None:
        self.record = record

    def train_batches(self, run: Any, batches: Any) -> Any:
        for batch in batches:
            features = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()))
            ids = ",".join(f"{zlib.crc32(row.numpy().tobytes()):08x}" for row in features.cpu())
            world = os.environ.get("WORLD_SIZE", "1")
            _append(
                self.record,
                "samples",
                f"{time.time():.6f} {run.step + 1} {os.environ.get('RANK', '0')} {world} {ids}",
            )
            yield batch


def global_batches(record: str | Path) -> dict[int, list[str]]:
    """Each step's global batch, as the last attempt that trained the step saw it: its ranks' samples in
    rank order (`SampleOrder`, over every rank file, whichever attempts wrote them)."""
    seen: dict[int, list[tuple[float, int, int, list[str]]]] = {}
    for path in Path(record).parent.glob(f"{Path(record).name}.rank*.samples"):
        for line in path.read_text().splitlines():
            when, step, rank, world, ids = line.split()
            seen.setdefault(int(step), []).append((float(when), int(rank), int(world), ids.split(",")))
    batches = {}
    for step, records in seen.items():
        records.sort()
        world = records[-1][2]
        last = sorted(records[-world:], key=lambda r: r[1])
        assert [r[1] for r in last] == list(range(world)), (step, last)
        batches[step] = [sample for r in last for sample in r[3]]
    return batches


class GateAtStep(Callback):
    """After optimizer step `step` (of a run of `world` ranks, if given), waits (at most 5 minutes) until
    the file `gate` exists: the test acts while the run stands at a known step, then lets it go on."""

    def __init__(self, gate: str, step: int, world: int | None = None) -> None:
        self.gate, self.step, self.world = Path(gate), step, world

    def on_step_end(self, run: Any) -> None:
        if self.world is not None and int(os.environ.get("WORLD_SIZE", "1")) != self.world:
            return
        deadline = time.monotonic() + 300
        while run.step == self.step and not self.gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
