"""Per-step overhead of runner's Accelerator against a plain PyTorch loop, measured in the same run.

A 4-layer MLP, batch 64, AdamW and a LambdaLR schedule, data from a DataLoader; modes fp32, bf16
(autocast) and gradient accumulation 4. Two methods, each with an A/A control (a second plain loop):

1. Counted (deterministic): the Python and C function calls each loop makes per optimizer step, counted
   by a profile hook over `--count-steps` steps, and the self time of runner's own functions under
   cProfile (inflated by the profiler, so an upper bound). The A/A count difference is exactly 0.
2. Timed: plain and runner loops alternate in interleaved rounds; each round times the CPU time of
   `--steps` optimizer steps on one thread with garbage collection paused. Reported per optimizer step:
   the median of the per-round differences (the overhead), the ratio it gives, and the A/A difference
   (what the method cannot resolve). Twice: at width 256 (the MLP of the README's numbers) and at width 8,
   where Python dominates and an overhead is easiest to see.

3. `python -m runner`'s loop (the Trainer on the default experiment: the 4 x 256 MLP on the synthetic
   regression, AdamW, warm-up and cosine decay, a log line every 10 steps, no tracker) against the same
   training written plainly, which reads the loss and writes a line every 10 steps too. A callback of the
   run interleaves them: after every `--steps` of the Trainer's steps it runs as many of the plain loop and
   of its A/A copy, all timed as in 2, and counts the calls of one such round of each.

Not a test: nothing here gates CI.

    python benchmarks/step_overhead.py [--rounds 60] [--steps 10] [--count-steps 50] [--threads 1]

About 2 minutes on the project's 2-core machine (4.3 on a slow day). `step_instructions.py` counts the same loops' instructions.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from torch.utils.data import DataLoader, TensorDataset

import runner
from runner import Accelerator
from runner.callbacks import Callback, Run
from runner.config import CONF_PACKAGE
from runner.group_schemas import register_configs
from runner.models import MLP
from runner.schedulers import cosine
from runner.train import Trainer

BATCH = 64
RUNNER_CODE = str(Path(runner.__file__).parent)


def make_parts(width: int, seed: int = 0):
    torch.manual_seed(seed)
    model = MLP(in_features=width, out_features=width, hidden_size=width, num_layers=4)
    data = TensorDataset(torch.randn(BATCH * 64, width), torch.randn(BATCH * 64, width))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, loader, optimizer, scheduler


def batches(loader) -> Iterator:
    while True:
        yield from loader


def accumulation_of(mode: str) -> int:
    return 4 if mode == "accum4" else 1


def plain_loop(mode: str, width: int) -> Callable[[int], None]:
    """A function running `n` optimizer steps of the plain loop."""
    model, loader, optimizer, scheduler = make_parts(width)
    accumulation = accumulation_of(mode)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "bf16" else nullcontext
    stream = batches(loader)
    count = 0

    def run(steps: int) -> None:
        nonlocal count
        for _ in range(steps * accumulation):
            x, y = next(stream)
            with autocast():
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            (loss / accumulation if accumulation > 1 else loss).backward()
            count += 1
            if count % accumulation == 0:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    return run


def runner_loop(mode: str, width: int) -> Callable[[int], None]:
    """A function running `n` optimizer steps of the same loop through runner's Accelerator."""
    model, loader, optimizer, scheduler = make_parts(width)
    accelerator = Accelerator(
        cpu=True,
        mixed_precision="bf16" if mode == "bf16" else "no",
        gradient_accumulation_steps=accumulation_of(mode),
    )
    model, loader, optimizer, scheduler = accelerator.prepare(model, loader, optimizer, scheduler)
    stream = batches(loader)

    def run(steps: int) -> None:
        for _ in range(steps * accumulation_of(mode)):
            x, y = next(stream)
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    return run


def counting_calls(name: str) -> Callable[[], int]:
    """Start counting the Python and C calls of this thread (of the loop `name`); the function returned
    stops and answers."""
    calls = 0

    def hook(frame, event, arg) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(hook)

    def stop() -> int:
        sys.setprofile(None)
        return calls

    return stop


def count_calls(run: Callable[[int], None], steps: int) -> int:
    """Python and C function calls made by `run(steps)` on this thread."""
    stop = counting_calls("")
    try:
        run(steps)
    finally:
        calls = stop()
    return calls


def runner_self_time(run: Callable[[int], None], steps: int) -> tuple[float, list[tuple[str, float]]]:
    """Seconds per step spent in runner's own functions (their self time) under cProfile, and the five
    that are called most, with their calls per step."""
    profile = cProfile.Profile()
    profile.runcall(run, steps)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    ours = {
        f"{Path(file).name}:{name}": (calls, self_time)
        for (file, _, name), (_, calls, self_time, *_) in stats.items()
        if file.startswith(RUNNER_CODE)
    }
    busiest = sorted(ours.items(), key=lambda item: -item[1][0])[:5]
    return sum(t for _, t in ours.values()) / steps, [(name, calls / steps) for name, (calls, _) in busiest]


def counted(mode: str, steps: int) -> tuple[float, float, float, float, list[tuple[str, float]]]:
    """Calls per optimizer step of plain and runner, the A/A difference of two plain loops, runner's own
    self time per step under cProfile and its busiest functions (width 8: the count does not depend on it)."""
    loops = {"plain": plain_loop(mode, 8), "runner": runner_loop(mode, 8), "control": plain_loop(mode, 8)}
    for run in loops.values():
        run(2)  # warm-up: first-call paths (lazy imports, caches) are not per step
    calls = {name: count_calls(run, steps) / steps for name, run in loops.items()}
    self_time, busiest = runner_self_time(loops["runner"], steps)
    return calls["plain"], calls["runner"], calls["control"] - calls["plain"], self_time, busiest


def measure(mode: str, width: int, rounds: int, steps: int) -> tuple[float, float, float, float]:
    """Median seconds per optimizer step of plain and runner, the median of their per-round differences,
    and the same difference for a second, identical plain loop (the A/A control: what the method cannot
    resolve)."""
    loops = {
        "plain": plain_loop(mode, width),
        "runner": runner_loop(mode, width),
        "control": plain_loop(mode, width),
    }
    for run in loops.values():
        run(max(1, steps // 4))  # warm-up
    times: dict[str, list[float]] = {name: [] for name in loops}
    gc.collect()
    gc.disable()  # a collection landing in one loop's round would be charged to it
    try:
        for r in range(rounds):
            order = list(loops)[r % 3 :] + list(loops)[: r % 3]  # rotate who goes first
            for name in order:
                start = time.thread_time()  # CPU time of this thread: not charged for preemption
                loops[name](steps)
                times[name].append((time.thread_time() - start) / steps)
    finally:
        gc.enable()

    plain, ours = statistics.median(times["plain"]), statistics.median(times["runner"])
    return plain, ours, median_difference(times, "runner"), median_difference(times, "control")


def median_difference(times: dict[str, list[float]], name: str) -> float:
    """The median over rounds of `name`'s time less the plain loop's in the same round."""
    return statistics.median(a - b for a, b in zip(times[name], times["plain"], strict=True))


# `python -m runner`'s loop: the default experiment's overrides for each mode
LOOP_MODES = {"fp32": [], "bf16": ["precision=bf16"], "accum4": ["trainer.gradient_accumulation_steps=4"]}
LOG_EVERY = 10  # the default experiment's `trainer.log_every`


def plain_training(run: Run, accumulation: int, bf16: bool, log: Path) -> Callable[[int], None]:
    """The default experiment written plainly, on the run's data: a function running `n` optimizer steps,
    which reads the mean loss and writes a line every LOG_EVERY steps (a plain script's print)."""
    torch.manual_seed(1)
    model = MLP(in_features=16, out_features=1, hidden_size=256, num_layers=4)
    loader = DataLoader(
        run.train_loader.base_dataloader.dataset,  # type: ignore[attr-defined]  # the run's data
        batch_size=64,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = cosine(optimizer, num_training_steps=run.total_steps, warmup_ratio=0.05, min_lr_ratio=0.1)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else nullcontext
    stream = batches(loader)
    window, done = torch.zeros(()), 0
    out = log.open("a")

    def train(steps: int) -> None:
        nonlocal window, done
        for _ in range(steps):
            for _ in range(accumulation):
                batch = next(stream)
                with autocast():
                    outputs = model(batch["inputs"])
                loss = F.mse_loss(outputs.float(), batch["targets"])
                (loss / accumulation if accumulation > 1 else loss).backward()
                window += loss.detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            done += 1
            if done % LOG_EVERY == 0:
                out.write(f"step {done}: loss {window.item() / (LOG_EVERY * accumulation):.4f}\n")
                out.flush()
                window.zero_()

    return train


class Interleaved(Callback):
    """The benchmark inside the run (`callbacks.interleaved._target_=step_overhead.Interleaved`): times
    each round of `steps` of the Trainer's optimizer steps (from this callback's return to its next call
    `steps` steps later), then runs as many steps of the plain training and of its A/A copy, timed alike;
    counts the calls of one round of each; stops the run after `rounds` rounds."""

    def __init__(self, mode: str, rounds: int, steps: int, log: str, threads: int) -> None:
        self.mode, self.rounds, self.steps, self.log, self.threads = mode, rounds, steps, Path(log), threads
        self.times: dict[str, list[float]] = {"runner": [], "plain": [], "control": []}
        self.calls: dict[str, float] = {}
        self.loops: dict[str, Callable[[int], None]] = {}
        self.began = 0.0
        self.counting: Callable[[], int] | None = None  # stops the count of the Trainer's round

    def on_fit_start(self, run: Run) -> None:
        torch.set_num_threads(self.threads)  # the run set its own: both loops run on the benchmark's
        accumulation, bf16 = run.settings.gradient_accumulation_steps, self.mode == "bf16"
        self.loops = {
            name: plain_training(run, accumulation, bf16, self.log) for name in ("plain", "control")
        }
        for train in self.loops.values():
            train(2 * LOG_EVERY)  # warm-up

    def on_step_end(self, run: Run) -> None:
        if run.step % self.steps:
            return
        now = time.thread_time()
        measured, count_next = len(self.times["plain"]), False
        if self.counting is not None:
            self.calls["runner"] = self.counting() / self.steps
            self.counting = None
        if run.step > 2 * LOG_EVERY:  # the Trainer's warm-up: its first steps
            self.times["runner"].append((now - self.began) / self.steps)
            names = list(self.loops)[measured % 2 :] + list(self.loops)[: measured % 2]
            for name in names:
                start = time.thread_time()
                self.loops[name](self.steps)
                self.times[name].append((time.thread_time() - start) / self.steps)
            if measured == 1:  # one more round of each plain loop, counted, then a round of the Trainer
                for name, train in self.loops.items():
                    gc.collect()
                    stop = counting_calls(name)
                    train(self.steps)
                    self.calls[name] = stop() / self.steps
                count_next = True
        if len(self.times["runner"]) == self.rounds:
            run.stop("benchmark done")
        gc.collect()
        gc.disable()
        if count_next:
            self.counting = counting_calls("runner")
        self.began = time.thread_time()

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        gc.enable()


def runner_training(mode: str, rounds: int, steps: int) -> Interleaved:
    """`python -m runner`'s loop on the default experiment in `mode`, interleaved with the plain training:
    the callback, holding the times and counts."""
    arguments = {"rounds": rounds, "steps": steps, "threads": torch.get_num_threads()}
    return trainer_with(mode, "step_overhead.Interleaved", (rounds + 4) * steps, arguments)  # type: ignore[return-value]


def trainer_with(mode: str, callback: str, max_steps: int, arguments: dict[str, object]) -> Callback:
    """Run `python -m runner`'s loop on the default experiment in `mode` (no tracker, evaluation, saved model
    or plots) for at most `max_steps`, with the callback `callback` (a dotted path) made with `mode`,
    `arguments` and `log` (a file for the plain training's lines); return that callback."""
    register_configs()
    with tempfile.TemporaryDirectory() as tmp, initialize_config_module(CONF_PACKAGE, version_base="1.3"):
        overrides = [
            *LOOP_MODES[mode],
            "tracker=none",
            f"trainer.max_steps={max_steps}",
            "trainer.eval_every=0",
            "trainer.save_model=false",
            "trainer.plots=false",
            "trainer.progress_bar=false",
            f"+callbacks.measured._target_={callback}",
            f"+callbacks.measured.mode={mode}",
            f"+callbacks.measured.log={tmp}/plain.log",
            *(f"+callbacks.measured.{key}={value}" for key, value in arguments.items()),
        ]
        trainer = Trainer(compose("config", overrides=overrides), Path(tmp))
        measured = trainer.callbacks.named["measured"]
        trainer.fit()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--count-steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = ("fp32", "bf16", "accum4")
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); per optimizer step (accum4: 4 micro-batches)"
    )
    print(f"\n1. Counted over {args.count_steps} steps")
    print(
        f"{'mode':<8} {'plain calls':>12} {'runner calls':>13} {'extra':>7} {'A/A':>5} {'runner self us':>15}  busiest"
    )
    for mode in modes:
        plain, ours, control, self_time, busiest = counted(mode, args.count_steps)
        top = ", ".join(f"{name} x{calls:g}" for name, calls in busiest[:3])
        print(
            f"{mode:<8} {plain:>12.1f} {ours:>13.1f} {ours - plain:>+7.1f} {control:>+5.1f} {self_time * 1e6:>15.1f}  {top}"
        )
    for width in (256, 8):
        print(f"\n2. Timed, width {width}: {args.rounds} rounds x {args.steps} steps")
        print(
            f"{'mode':<8} {'plain us/step':>14} {'runner us/step':>15} {'overhead us':>12} {'ratio':>7} {'A/A us':>8}"
        )
        for mode in modes:
            plain, ours, overhead, control = measure(mode, width, args.rounds, args.steps)
            ratio = (plain + overhead) / plain
            print(
                f"{mode:<8} {plain * 1e6:>14.1f} {ours * 1e6:>15.1f} {overhead * 1e6:>+12.1f} {ratio:>7.3f} {control * 1e6:>+8.1f}"
            )
    print(f"\n3. python -m runner's loop, default experiment: {args.rounds} rounds x {args.steps} steps")
    print(
        f"{'mode':<8} {'plain calls':>12} {'runner calls':>13} {'plain us/step':>14} {'runner us/step':>15} "
        f"{'overhead us':>12} {'ratio':>7} {'A/A us':>8}"
    )
    for mode in LOOP_MODES:
        run = runner_training(mode, args.rounds, args.steps)
        times = run.times
        plain, ours = statistics.median(times["plain"]), statistics.median(times["runner"])
        overhead, control = median_difference(times, "runner"), median_difference(times, "control")
        print(
            f"{mode:<8} {run.calls['plain']:>12.1f} {run.calls['runner']:>13.1f} {plain * 1e6:>14.1f} "
            f"{ours * 1e6:>15.1f} {overhead * 1e6:>+12.1f} {(plain + overhead) / plain:>7.3f} {control * 1e6:>+8.1f}"
        )


if __name__ == "__main__":
    main()
