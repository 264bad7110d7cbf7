"""Per-step overhead of runner's Accelerator against a plain PyTorch loop, in CPU instructions: exact where
`step_overhead.py`'s times are not (a shared or busy machine moves a 1-2 ms step by tens of microseconds).

The loops are `step_overhead.py`'s (a 4-layer MLP of width 8, batch 64, AdamW + LambdaLR, batches from a
DataLoader; fp32, bf16 autocast, accumulation 4), each mode in one process under valgrind's callgrind with
instrumentation off until the loops are built and warmed up. Then each loop (plain, runner, a second plain
loop as the A/A control) runs `--steps` optimizer steps between a zeroing and a dump of callgrind's
counters (client requests from a small C library built here), garbage collection paused. Reported per
optimizer step: the instructions of each loop, the extra of runner's, the A/A difference (0 where the
method is exact), and the extra as microseconds at the plain loop's instructions per microsecond, timed
natively in this run (an estimate: Python's own instructions run at about the rate of the loop's; the
Trainer's bf16 row at its fp32 row's rate, `RATE_OF`).

Then `python -m runner`'s loop the same way (`step_overhead.py`'s section 3: the Trainer on the default
experiment in fp32 and bf16, against the same training written plainly): a callback of the run
counts `--steps` of the Trainer's optimizer steps after a warm-up, then as many of the plain training and
of its A/A copy, each between a zeroing and a dump; natively, the same callback times the plain training.
Its goodput ledger's writes, which come every 5 s (every ~1,800 steps natively, every ~40 under callgrind),
are left out of the count.

Needs valgrind (with its headers, valgrind/callgrind.h) and a C compiler. Not a test: nothing here gates CI.

    python benchmarks/step_instructions.py [--steps 20]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from step_overhead import LOG_EVERY, plain_loop, plain_training, runner_loop, trainer_with

from runner.callbacks import Callback, Run
from runner.telemetry import goodput

MODES = ("fp32", "bf16", "accum4")
# `python -m runner`'s loop, not with accumulation: its epoch (58 batches) ends on a shorter step, which the
# plain training, one stream of batches, does not take
TRAINER_MODES = ("loop-fp32", "loop-bf16")
# The loop's bf16 matmuls (width 256) take another path under valgrind: 9x the fp32 loop's instructions where
# they take 1.2x its time natively. Its extra is converted to time at the fp32 loop's rate instead.
RATE_OF = {"loop-bf16": "loop-fp32"}
LOOPS = ("plain", "runner", "control")
REQUESTS = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; }
void zero(void) { CALLGRIND_ZERO_STATS; }
void dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def build_requests(directory: Path) -> Path:
    """callgrind's client requests (start, zero, dump) as a C library built into `directory`."""
    source, library = directory / "requests.c", directory / "requests.so"
    source.write_text(REQUESTS)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


class Counted(Callback):
    """In `python -m runner`'s loop (`step_overhead.trainer_with`): after `warmup` optimizer steps, `steps`
    of the Trainer's, then as many of the plain training and of its A/A copy, each between a zeroing and a
    dump of callgrind's counters (the client requests of `library`); then it stops the run. Without a
    `library` (natively) it times the plain training instead: `seconds`, per optimizer step."""

    def __init__(
        self, mode: str, steps: int, log: str, library: str = "", warmup: int = 2 * LOG_EVERY
    ) -> None:
        self.mode, self.steps, self.log, self.warmup = mode, steps, Path(log), warmup
        self.requests = requests_of(Path(library)) if library else None
        self.loops: dict[str, Callable[[int], None]] = {}
        self.seconds = 0.0

    def on_fit_start(self, run: Run) -> None:
        torch.set_num_threads(1)
        accumulation = run.settings.gradient_accumulation_steps
        self.loops = {
            name: plain_training(run, accumulation, self.mode == "bf16", self.log)
            for name in ("plain", "control")
        }
        for train in self.loops.values():
            train(self.warmup)

    def on_step_end(self, run: Run) -> None:
        if run.step == self.warmup and self.requests is not None:
            gc.collect()
            gc.disable()
            self.requests.start()
            self.requests.zero()
        if run.step < self.warmup + self.steps:
            return
        if self.requests is None:
            self.seconds = statistics.median(timed(self.loops["plain"], self.steps) for _ in range(20))
        else:
            self.requests.dump(b"runner")
            for name, train in self.loops.items():
                gc.collect()
                self.requests.zero()
                train(self.steps)
                self.requests.dump(name.encode())
            gc.enable()
        run.stop("counted")


def requests_of(library: Path) -> ctypes.CDLL:
    """The client requests (start, zero, dump) of the library `build_requests` made."""
    requests = ctypes.CDLL(str(library))
    requests.dump.argtypes = [ctypes.c_char_p]
    return requests


def timed(run: Callable[[int], None], steps: int) -> float:
    """Seconds of this thread's CPU time per step of `run(steps)`, collection paused."""
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        run(steps)
        return (time.thread_time() - start) / steps
    finally:
        gc.enable()


def trainer_counted(mode: str, steps: int, library: Path | None) -> Counted:
    """`python -m runner`'s loop in `mode` (`loop-fp32`, ...) with `Counted` in it."""
    arguments: dict[str, object] = {"steps": steps, "warmup": 2 * LOG_EVERY}
    if library is not None:
        arguments["library"] = library
    loop_mode = mode.removeprefix("loop-")
    return trainer_with(loop_mode, "step_instructions.Counted", 2 * LOG_EVERY + steps + 1, arguments)  # type: ignore[return-value]


def child(mode: str, steps: int, library: Path) -> None:
    """Under callgrind: `steps` optimizer steps of each loop counted alone, dumped under its name."""
    if mode in TRAINER_MODES:
        # The goodput ledger writes the steps it coalesced every FLUSH_S seconds: every ~1,800 steps
        # natively, every ~40 at callgrind's pace, which would count ~70k instructions per step that a
        # native run spends under 200 on. Counted without those writes (the per-step record is counted).
        goodput.FLUSH_S = math.inf
        trainer_counted(mode, steps, library)
        return
    torch.set_num_threads(1)
    requests = requests_of(library)
    loops = {"plain": plain_loop(mode, 8), "runner": runner_loop(mode, 8), "control": plain_loop(mode, 8)}
    for run in loops.values():
        run(3)  # warm-up: first-call paths are not per step
    requests.start()  # instrumented from here on (callgrind runs ~50x slower so)
    for name, run in loops.items():
        gc.collect()
        gc.disable()
        requests.zero()
        run(steps)
        requests.dump(name.encode())
        gc.enable()


def counted(mode: str, steps: int, library: Path, directory: Path) -> dict[str, float]:
    """Instructions per optimizer step of each loop in `mode`."""
    out = directory / f"callgrind.{mode}"
    # Without address-space randomization where `setarch` can turn it off: where allocations land moves
    # the count of two identical runs of the Trainer's loop by up to 40k instructions a step.
    fixed_layout = ["setarch", platform.machine(), "-R"] if shutil.which("setarch") else []
    subprocess.run(
        [
            *fixed_layout,
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}.%p",
            sys.executable,
            __file__,
            "--child",
            mode,
            "--steps",
            str(steps),
            "--library",
            str(library),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    counts: dict[str, float] = {}
    for dump in directory.glob(f"callgrind.{mode}.*"):
        text = dump.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: Client Request: (\w+)", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if trigger and total and trigger.group(1) in LOOPS:
            counts[trigger.group(1)] = int(total.group(1)) / steps
    missing = set(LOOPS) - set(counts)
    if missing:
        raise RuntimeError(f"callgrind wrote no counts for {sorted(missing)} in {directory}")
    return counts


def plain_rate(mode: str, steps: int) -> float:
    """The plain loop's seconds per optimizer step, natively (a median over rounds)."""
    if mode in TRAINER_MODES:
        return trainer_counted(mode, steps, None).seconds
    torch.set_num_threads(1)
    run = plain_loop(mode, 8)
    run(3)
    return statistics.median(timed(run, steps) for _ in range(20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", choices=MODES + TRAINER_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--library", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.library)
        return
    print(
        f"torch {torch.__version__}; instructions per optimizer step (accum4: 4 micro-batches); the Accelerator's "
        "loops at width 8, `python -m runner`'s (loop-*) on the default experiment"
    )
    print(
        f"{'mode':<8} {'plain':>12} {'runner':>12} {'extra':>10} {'ratio':>7} {'A/A':>7} "
        f"{'plain us':>9} {'extra us (est.)':>16}"  # plain us: of the loop whose rate converts
    )
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        directory = Path(tmp)
        library = build_requests(directory)
        runs = {
            mode: pool.submit(counted, mode, args.steps, library, directory) for mode in MODES + TRAINER_MODES
        }
        counts_of = {mode: run.result() for mode, run in runs.items()}
        seconds_of: dict[str, float] = {}  # timed once the counting processes are done
        for mode, counts in counts_of.items():
            plain, ours = counts["plain"], counts["runner"]
            rate = RATE_OF.get(mode, mode)
            if rate not in seconds_of:
                seconds_of[rate] = plain_rate(rate, args.steps)
            per_instruction = seconds_of[rate] / counts_of[rate]["plain"]
            print(
                f"{mode:<8} {plain:>12.0f} {ours:>12.0f} {ours - plain:>+10.0f} {ours / plain:>7.4f} "
                f"{counts['control'] - plain:>+7.0f} {seconds_of[rate] * 1e6:>9.1f} "
                f"{(ours - plain) * per_instruction * 1e6:>+16.1f}"
            )


if __name__ == "__main__":
    main()
