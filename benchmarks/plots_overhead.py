"""What drawing a run's curves costs the run (`trainer.plots`), measured in this run:

    python benchmarks/plots_overhead.py [--rounds 3] [--max-steps 10000] [--eval-every 100] [--threads N]

The default experiment (its MLP and data, `--max-steps` steps of about 3 ms here) evaluates every
`--eval-every` steps; with plots, the training starts `python -m runner.telemetry.plots --serve` in a process of
its own (running on idle CPU time only), which draws at an evaluation (at most every 30 s, and only where
torch's threads leave a core free: `--threads`, torch's intra-op threads, fewer than the cores), and the
end waits for a last drawing.
Interleaved rounds of three
fresh runs: without plots, with plots, and without plots again (the A/A control). For each: the training
loop's time (from the run's log: its "training ..." line to its last evaluation) and the whole command's
wall time (the end waits for the last drawing). Ratios are of medians against the first run without plots.
Nothing here gates CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path


def loop_seconds(log: Path) -> float:
    """From the run log's last "training ..." line (the log file is appended to) to the last line about a
    step after it."""
    stamps: list[datetime] = []
    for line in log.read_text().splitlines():
        if "] training " in line:
            stamps = []
        if "] training " in line or "][INFO] step " in line:
            stamps.append(datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f"))
    return (stamps[-1] - stamps[0]).total_seconds()


def run_once(
    workdir: Path, plots: bool, eval_every: int, max_steps: int, threads: int | None
) -> tuple[float, float]:
    """(training loop seconds, command seconds) of one fresh run."""
    run_dir = workdir / "run"
    command = [
        sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", "trainer.overwrite=true", "tracker=none",
        "trainer.progress_bar=false", f"trainer.eval_every={eval_every}", f"trainer.plots={str(plots).lower()}",
        f"trainer.max_steps={max_steps}", "trainer.log_every=100",
    ]  # fmt: skip
    start = time.perf_counter()
    env = os.environ | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    subprocess.run(command, cwd=workdir, env=env, check=True, capture_output=True)
    return loop_seconds(run_dir / "runner.log"), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=10000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch's threads in the runs (default: all)"
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="plots_overhead_"))
    names = {"no plots": False, "plots": True, "no plots (A/A)": False}
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name, plots in names.items():
            found[name].append(run_once(workdir, plots, args.eval_every, args.max_steps, args.threads))
    reference = [statistics.median(values) for values in zip(*found["no plots"], strict=True)]
    print(
        f"default experiment, {args.max_steps} steps, evaluation every {args.eval_every}, torch threads "
        f"{args.threads or 'all'} of {os.cpu_count()} cores; medians of {args.rounds} rounds"
    )
    print(f"{'':<16} {'loop s':>8} {'ratio':>7} {'command s':>10} {'ratio':>7}")
    for name, values in found.items():
        loop, command = (statistics.median(v) for v in zip(*values, strict=True))
        print(
            f"{name:<16} {loop:>8.2f} {loop / reference[0]:>7.3f} {command:>10.2f} {command / reference[1]:>7.3f}"
        )


if __name__ == "__main__":
    main()
