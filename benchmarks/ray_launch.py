"""The launch overhead of `launcher=ray` against `launcher=local`, measured side by side in this run:

    bash .ci/ray.sh up        # the two-node cluster on this machine (as the tests use it)
    python benchmarks/ray_launch.py [--rounds 3]

The default experiment on 2 ranks (`hardware=ddp hardware.num_processes=2`), each command a fresh
process, in interleaved rounds: local, Ray (one worker per node, `launcher.placement=spread`), and local
again as an A/A control. For each: the time from the command's start to the end of its first optimizer step
(the goodput ledger's `warmup` record) and to its exit. All commands run inside the cluster's network
namespace. Ratios are of medians against the first local command. Nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAMESPACE = "/run/netns/runner-ray"
COMMON = ["hardware=ddp", "hardware.num_processes=2", "tracker=none", "trainer.plots=false"]
KINDS = {
    "local": [],
    "ray": ["launcher=ray", "launcher.address=127.0.0.1:6379", "launcher.placement=spread"],
    "local (A/A)": [],
}


def measure(run_dir: Path, overrides: list[str]) -> tuple[float, float]:
    """(start to the first step's end, start to exit) of one command, in seconds."""
    command = ["nsenter", f"--net={NAMESPACE}", sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}"]
    began = time.time()
    subprocess.run([*command, *COMMON, *overrides], check=True, capture_output=True)
    ended = time.time()
    records = [json.loads(line) for line in (run_dir / "goodput.jsonl").read_text().splitlines()]
    first_step = next(record["t1"] for record in records if record["phase"] == "warmup")
    return first_step - began, ended - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for index, (kind, overrides) in enumerate(KINDS.items()):
                times[kind].append(measure(Path(tmp) / f"round{round_}-command{index}", overrides))
                print(
                    f"round {round_} {kind}: first step {times[kind][-1][0]:.2f} s, exit {times[kind][-1][1]:.2f} s"
                )
    base_first = statistics.median(t[0] for t in times["local"])
    base_exit = statistics.median(t[1] for t in times["local"])
    print(f"\nmedians of {args.rounds} round(s), ratios against launcher=local:")
    print(f"{'':14} {'first step':>12} {'ratio':>7} {'exit':>9} {'ratio':>7}")
    for kind, measured in times.items():
        first = statistics.median(t[0] for t in measured)
        exit_ = statistics.median(t[1] for t in measured)
        print(
            f"{kind:14} {first:10.2f} s {first / base_first:6.2f}x {exit_:7.2f} s {exit_ / base_exit:6.2f}x"
        )


if __name__ == "__main__":
    main()
