"""The goodput of a 3-node job that loses a node, under each policy, measured side by side in this run:

    python benchmarks/elastic_goodput.py [--steps 400] [--step-s 0.05] [--replacement-s 15] [--rounds 1]

Three nodes on this machine (`launcher=elastic`, the others `runner join`, one rank each, on 127.0.0.1),
each step a fixed `--step-s` of simulated device time (a sleep: the CPU ranks' own compute is small beside
it) over the default experiment's data and model. Node 2 is killed (SIGKILL, with its rank) once the job
passed a quarter of its steps; a replacement node joins `--replacement-s` later (the time a scheduler takes
to give a new machine). The policies:

- uninterrupted: no node lost (twice: the second is the A/A control);
- same size: `min_nodes = max_nodes = 3`, the restart waits until the replacement is there (what a
  restart of the whole job at its size does, SLURM's requeue and the local agent's restart alike);
- elastic: `min_nodes=2`, the job goes on with 2 and takes the replacement in.

Printed: each policy's wall time (the first node's command), its ratio to the uninterrupted run, and the
goodput ledger's goodput, steps lost and resizes. Nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TASK = '''
import time
from runner.tasks.regression import Regression

class TimedRegression(Regression):
    """A step that takes `step_s` of (simulated) device time."""
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
    def training_step(self, model, batch):
        loss = super().training_step(model, batch)
        if loss.device.type != "meta":
            time.sleep(self.step_s)
        return loss
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def history_step(run_dir: Path) -> int:
    path = run_dir / "history.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.endswith("}")]
    return int(max(steps, default=0))


def start(command: list[str], workdir: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def scenario(policy: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """One run of the job under `policy`: its wall time and what its ledger says."""
    run_dir = workdir / f"{policy.replace(' ', '_')}-{time.time_ns()}"  # a fresh run every round
    policy = policy.removesuffix(" again")
    endpoint = f"127.0.0.1:{free_port()}"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(workdir), str(REPO)]), "PYTHONUNBUFFERED": "1"}
    min_nodes = 2 if policy == "elastic" else 3
    first = [
        sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", "tracker=none", "trainer.plots=false",
        "trainer.progress_bar=false", "hardware=ddp", "hardware.num_processes=1", "trainer.split_batches=true",
        "data.batch_size=12", f"trainer.max_steps={args.steps}", "trainer.checkpoint_every=50",
        "trainer.log_every=10", "trainer.eval_every=0", "task._target_=timed_task.TimedRegression",
        f"+task.step_s={args.step_s}", "launcher=elastic", f"launcher.min_nodes={min_nodes}", "launcher.max_nodes=3",
        "launcher.restarts=2", "launcher.wait_s=2", f"launcher.endpoint={endpoint}",
    ]  # fmt: skip
    join = [sys.executable, "-m", "runner", "join", endpoint]
    began = time.perf_counter()
    nodes = [start(first, workdir, env, run_dir.with_suffix(".node0.log"))]
    nodes += [start(join, workdir, env, run_dir.with_suffix(f".node{i}.log")) for i in (1, 2)]
    try:
        if policy != "uninterrupted":
            while history_step(run_dir) < args.steps // 4:
                assert nodes[0].poll() is None, run_dir.with_suffix(".node0.log").read_text()
                time.sleep(0.05)
            os.killpg(nodes[2].pid, signal.SIGKILL)
            time.sleep(args.replacement_s)
            nodes.append(start(join, workdir, env, run_dir.with_suffix(".node3.log")))
        assert nodes[0].wait(timeout=1800) == 0, run_dir.with_suffix(".node0.log").read_text()
        wall = time.perf_counter() - began
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads((run_dir / "goodput.json").read_text())
    return {
        "wall_s": wall,
        "goodput": summary["goodput"],
        "lost_steps": summary["lost_steps"],
        "resizes": summary.get("resizes", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-s", type=float, default=0.05, help="simulated device time of each step")
    parser.add_argument("--replacement-s", type=float, default=15.0, help="when the replacement node joins")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    policies = ["uninterrupted", "same size", "elastic", "uninterrupted again"]
    results: dict[str, list[dict[str, float]]] = {policy: [] for policy in policies}
    with tempfile.TemporaryDirectory(prefix="runner-elastic-") as tmp:
        workdir = Path(tmp)
        (workdir / "timed_task.py").write_text(TASK)
        for _ in range(args.rounds):
            for policy in policies:
                results[policy].append(scenario(policy, args, workdir))
    base = statistics.median(r["wall_s"] for r in results["uninterrupted"])
    print(
        f"{args.steps} steps of {args.step_s} s, node 2 lost at step {args.steps // 4}, replacement after {args.replacement_s} s; medians of {args.rounds} round(s)"
    )
    print(f"{'policy':<20} {'wall s':>8} {'ratio':>7} {'goodput':>8} {'lost steps':>11} {'resizes':>8}")
    for policy, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        goodput = statistics.median(r["goodput"] for r in runs)
        lost = statistics.median(r["lost_steps"] for r in runs)
        resized = statistics.median(r["resizes"] for r in runs)
        print(f"{policy:<20} {wall:8.1f} {wall / base:6.2f}x {goodput:8.1%} {lost:11.0f} {resized:8.0f}")


if __name__ == "__main__":
    main()
