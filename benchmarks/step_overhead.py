"""Per-step overhead of runner's Accelerator against a plain PyTorch loop, measured in the same run.

A 4-layer, width-256 MLP, batch 64, AdamW and a LambdaLR schedule, data from a DataLoader; modes fp32,
bf16 (autocast) and gradient accumulation 4. Plain and runner loops alternate in interleaved rounds; each
round times the CPU time of `--steps` loop iterations (micro-batches), one
thread, garbage collection paused. Prints the median time per iteration of each, the
median of the per-round differences (the overhead, in microseconds), the ratio it gives, and the same
difference for a second plain loop (A/A): an overhead smaller than that is below what the method resolves. Not a test: nothing here gates CI.

    python benchmarks/step_overhead.py [--rounds 300] [--steps 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from runner import Accelerator
from runner.models import MLP

WIDTH, BATCH = 256, 64


def make_parts(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP(in_features=WIDTH, out_features=WIDTH, hidden_size=WIDTH, num_layers=4)
    data = TensorDataset(torch.randn(BATCH * 64, WIDTH), torch.randn(BATCH * 64, WIDTH))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, loader, optimizer, scheduler


def batches(loader) -> Iterator:
    while True:
        yield from loader


def plain_loop(mode: str) -> Callable[[int], None]:
    model, loader, optimizer, scheduler = make_parts()
    accumulation = 4 if mode == "accum4" else 1
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "bf16" else nullcontext
    stream = batches(loader)
    count = 0

    def run(steps: int) -> None:
        nonlocal count
        for _ in range(steps):
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


def runner_loop(mode: str) -> Callable[[int], None]:
    model, loader, optimizer, scheduler = make_parts()
    accelerator = Accelerator(
        cpu=True,
        mixed_precision="bf16" if mode == "bf16" else "no",
        gradient_accumulation_steps=4 if mode == "accum4" else 1,
    )
    model, loader, optimizer, scheduler = accelerator.prepare(model, loader, optimizer, scheduler)
    stream = batches(loader)

    def run(steps: int) -> None:
        for _ in range(steps):
            x, y = next(stream)
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    return run


def measure(mode: str, rounds: int, steps: int) -> tuple[float, float, float, float]:
    """Median seconds per step of plain and runner, the median of their per-round differences, and the
    same difference for a second, identical plain loop (the A/A control: what the method cannot resolve)."""
    loops = {"plain": plain_loop(mode), "runner": runner_loop(mode), "control": plain_loop(mode)}
    for run in loops.values():
        run(steps // 4)  # warm-up
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
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds x {args.steps} steps")
    print(
        f"{'mode':<8} {'plain us/step':>14} {'runner us/step':>15} {'overhead us':>12} {'ratio':>7} {'A/A us':>8}"
    )
    for mode in ("fp32", "bf16", "accum4"):
        plain, ours, overhead, control = measure(mode, args.rounds, args.steps)
        ratio = (plain + overhead) / plain
        print(
            f"{mode:<8} {plain * 1e6:>14.1f} {ours * 1e6:>15.1f} {overhead * 1e6:>+12.1f} {ratio:>7.3f} {control * 1e6:>+8.1f}"
        )


if __name__ == "__main__":
    main()
