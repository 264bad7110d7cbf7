"""Per-step overhead of runner's Accelerator against a plain PyTorch loop, in CPU instructions: exact where
`step_overhead.py`'s times are not (a shared or busy machine moves a 1-2 ms step by tens of microseconds).

The loops are `step_overhead.py`'s (a 4-layer MLP of width 8, batch 64, AdamW + LambdaLR, batches from a
DataLoader; fp32, bf16 autocast, accumulation 4), each mode in one process under valgrind's callgrind with
instrumentation off until the loops are built and warmed up. Then each loop (plain, runner, a second plain
loop as the A/A control) runs `--steps` optimizer steps between a zeroing and a dump of callgrind's
counters (client requests from a small C library built here), garbage collection paused. Reported per
optimizer step: the instructions of each loop, the extra of runner's, the A/A difference (0 where the
method is exact), and the extra as microseconds at the plain loop's instructions per microsecond, timed
natively in this run (an estimate: Python's own instructions run at about the rate of the loop's).

Needs valgrind (with its headers, valgrind/callgrind.h) and a C compiler. Not a test: nothing here gates CI.

    python benchmarks/step_instructions.py [--steps 20]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from step_overhead import plain_loop, runner_loop

MODES = ("fp32", "bf16", "accum4")
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


def child(mode: str, steps: int, library: Path) -> None:
    """Under callgrind: `steps` optimizer steps of each loop counted alone, dumped under its name."""
    torch.set_num_threads(1)
    requests = ctypes.CDLL(str(library))
    requests.dump.argtypes = [ctypes.c_char_p]
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
    subprocess.run(
        [
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
    torch.set_num_threads(1)
    run = plain_loop(mode, 8)
    run(3)
    times = []
    for _ in range(20):
        start = time.thread_time()
        run(steps)
        times.append((time.thread_time() - start) / steps)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--library", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.library)
        return
    print(f"torch {torch.__version__}; instructions per optimizer step (accum4: 4 micro-batches), width 8")
    print(
        f"{'mode':<8} {'plain':>12} {'runner':>12} {'extra':>10} {'ratio':>7} {'A/A':>7} "
        f"{'plain us':>9} {'extra us (est.)':>16}"
    )
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        directory = Path(tmp)
        library = build_requests(directory)
        runs = {mode: pool.submit(counted, mode, args.steps, library, directory) for mode in MODES}
        counts_of = {mode: run.result() for mode, run in runs.items()}
        for mode, counts in counts_of.items():
            plain, ours = counts["plain"], counts["runner"]
            seconds = plain_rate(mode, args.steps)  # once the counting processes are done
            print(
                f"{mode:<8} {plain:>12.0f} {ours:>12.0f} {ours - plain:>+10.0f} {ours / plain:>7.4f} "
                f"{counts['control'] - plain:>+7.0f} {seconds * 1e6:>9.1f} "
                f"{(ours - plain) / plain * seconds * 1e6:>+16.1f}"
            )


if __name__ == "__main__":
    main()
