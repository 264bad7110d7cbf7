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

Not a test: nothing here gates CI.

    python benchmarks/step_overhead.py [--rounds 300] [--steps 20] [--count-steps 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import runner
from runner import Accelerator
from runner.models import MLP

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


def count_calls(run: Callable[[int], None], steps: int) -> int:
    """Python and C function calls made by `run(steps)` on this thread."""
    calls = 0

    def hook(frame, event, arg) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(hook)
    try:
        run(steps)
    finally:
        sys.setprofile(None)
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

    def median_difference(name: str) -> float:
        return statistics.median(a - b for a, b in zip(times[name], times["plain"], strict=True))

    plain, ours = statistics.median(times["plain"]), statistics.median(times["runner"])
    return plain, ours, median_difference("runner"), median_difference("control")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--steps", type=int, default=20)
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


if __name__ == "__main__":
    main()
