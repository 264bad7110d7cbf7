"""How long the command takes to refuse a bad config, against `python -c "import torch"` in the same run:

    python benchmarks/refusal_time.py [--rounds 5]

Each command starts in a fresh process, in interleaved rounds (the reference twice per round, the second
time as an A/A control); the time is from launch to exit, and each refusal's exit status (2) and its first
line are checked. Each is refused by the composition, which imports no torch (`runner.compose.compose_command`):
a misspelt key, a wrong type and an unknown option against the schemas, a missing data file against the
paths the data option's class declares (`runner.config.Exists`). Ratios are of medians; nothing here gates CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNER = [sys.executable, "-m", "runner", "tracker=none"]
REFERENCE = 'python -c "import torch"'
COMMANDS = {
    REFERENCE: ([sys.executable, "-c", "import torch"], 0, ""),
    f"{REFERENCE} again (A/A)": ([sys.executable, "-c", "import torch"], 0, ""),
    "a misspelt key: trainer.max_step=5": ([*RUNNER, "trainer.max_step=5"], 2, "Did you mean trainer.max_steps?"),
    "a wrong type: hardware.num_processes=two": (
        [*RUNNER, "hardware=ddp", "hardware.num_processes=two"],
        2,
        "could not be converted to Integer",
    ),
    "an unknown option: hardware=fdsp": ([*RUNNER, "hardware=fdsp"], 2, "there is no option 'fdsp'"),
    "a missing file: data=tokens data.path=missing": (
        [*RUNNER, "data=tokens", "data.path=missing"],
        2,
        "no token shards there",
    ),
}


def timed(command: list[str], status: int, says: str, workdir: Path) -> float:
    """Seconds from launch to exit of `command` in `workdir`, which must exit with `status` saying `says`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONDONTWRITEBYTECODE")}
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != status or says not in proc.stderr:
        raise RuntimeError(f"{' '.join(command)}: exit {proc.returncode}, expected {status} saying {says!r}:\n{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory() as tmp:
        for command in COMMANDS.values():  # warm the file cache and the bytecode
            timed(*command, Path(tmp))
        for _ in range(args.rounds):
            for name, command in COMMANDS.items():
                times[name].append(timed(*command, Path(tmp)))
    reference = statistics.median(times[REFERENCE])
    print(f"{os.cpu_count()} cores; {args.rounds} rounds; median seconds from launch to exit")
    print(f"{'command':<48} {'s':>6} {'ratio':>6} {'spread':>7}")
    for name, values in times.items():
        median = statistics.median(values)
        spread = (max(values) - min(values)) / median
        print(f"{name:<48} {median:6.2f} {median / reference:5.2f}x {spread:6.0%}")


if __name__ == "__main__":
    main()
