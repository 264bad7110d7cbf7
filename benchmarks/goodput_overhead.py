"""What the goodput ledger costs a run, against the code before it, measured side by side in this run:

    python benchmarks/goodput_overhead.py [--baseline b10a19f] [--rounds 5] [--max-steps 2000]

The baseline revision (the last one without the ledger) is checked out into a temporary git worktree
and run from there (its conf/ and tasks/ linked in as the install's runner.conf and runner.tasks); this
tree runs as it is. Interleaved rounds of three fresh runs of the default
experiment: the baseline, this tree, and the baseline again (the A/A control). Two workloads: the
default experiment as it is (200 steps: the whole command's wall time, start-up included) and one of
`--max-steps` steps (the training loop's time, from the run log's "training ..." line to its last step
line). Ratios are of medians against the first baseline. Nothing here gates CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def loop_seconds(log: Path) -> float:
    """From the run log's "training ..." line to its last line about a step."""
    stamps = [
        datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")
        for line in log.read_text().splitlines()
        if "] training " in line or "][INFO] step " in line
    ]
    return (stamps[-1] - stamps[0]).total_seconds()


def run_once(tree: Path, workdir: Path, max_steps: int) -> tuple[float, float]:
    """(command seconds, training loop seconds) of a fresh run of the default experiment from `tree`."""
    run_dir = workdir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", "tracker=none", "trainer.plots=false",
        "trainer.progress_bar=false", f"trainer.max_steps={max_steps}",
    ]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(tree)}
    start = time.perf_counter()
    subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True)
    return time.perf_counter() - start, loop_seconds(run_dir / "runner.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="b10a19f", help="the revision without the ledger")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=2000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="goodput_overhead_"))
    baseline = workdir / "baseline"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "-f", "-q", str(baseline), args.baseline], check=True
    )
    for package, folder in (("conf", "conf"), ("tasks", "tasks")):  # installed as runner.conf, runner.tasks
        (baseline / "runner" / package).symlink_to(Path("..") / folder)
    try:
        trees = {"baseline": baseline, "ledger": REPO, "baseline (A/A)": baseline}
        found: dict[str, dict[str, list[float]]] = {name: {"command": [], "loop": []} for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                found[name]["command"].append(run_once(tree, workdir, 200)[0])
                found[name]["loop"].append(run_once(tree, workdir, args.max_steps)[1])
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=True)
    reference = {kind: statistics.median(values) for kind, values in found["baseline"].items()}
    print(
        f"default experiment, {os.cpu_count()} cores; medians of {args.rounds} rounds; baseline {args.baseline}"
    )
    print(f"{'':<16} {'command s':>10} {'ratio':>7} {f'loop s ({args.max_steps} steps)':>22} {'ratio':>7}")
    for name, values in found.items():
        command, loop = statistics.median(values["command"]), statistics.median(values["loop"])
        print(
            f"{name:<16} {command:>10.2f} {command / reference['command']:>7.3f} {loop:>22.2f} "
            f"{loop / reference['loop']:>7.3f}"
        )


if __name__ == "__main__":
    main()
