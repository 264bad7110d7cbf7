"""`launcher=elastic`: nodes as network namespaces on this machine (each its own hostname and hosts file),
one rank each. The first node composes and serves the meeting point; the others run `runner join`. A node
killed mid-run leaves the job on the nodes left, a node that joins is taken in, and every step trains on
the global batch an uninterrupted run trains on, sample by sample."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rank_checks
from conftest import cli_env, runner_command
from netns import as_machine, bridged_namespaces
from probes import global_batches

from runner.telemetry.history import read_history

TESTS = Path(__file__).parent
NAME, SUBNET = "runner-el", "10.251.81"  # node i: namespace runner-el<i> at SUBNET.(10+i), named node<i>
TRAIN = [
    "hardware=ddp",
    "hardware.num_processes=1",
    "trainer.split_batches=true",
    "data.batch_size=12",
    "trainer.max_steps=60",
    "trainer.log_every=5",
    "trainer.checkpoint_every=10",
    "trainer.eval_every=0",
    "+callbacks.samples._target_=probes.SampleOrder",
]
ELASTIC = [
    "launcher=elastic",
    "launcher.min_nodes=2",
    "launcher.max_nodes=4",
    "launcher.restarts=2",
    "launcher.wait_s=2",
    "launcher.endpoint=node0:29400",
]


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(row["step"]): row["train/loss"] for row in read_history(run_dir) if "train/loss" in row}


def _worlds(record: Path) -> list[int]:
    """The world size of each step each rank recorded, in the order they were recorded."""
    lines = [
        line.split()
        for path in record.parent.glob(f"{record.name}.rank*.samples")
        for line in path.read_text().splitlines()
    ]
    return [int(world) for _, _, _, world, _ in sorted(lines)]


def _wait(condition, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the first node ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_lost_node_leaves_the_job_on_the_rest_and_a_new_one_is_taken_in_with_the_same_samples(tmp_path):
    """3 nodes (min 2, max 4); node 2 killed (-9) after the first checkpoint: the job goes on with 2, from
    that checkpoint; a 4th node joins: the job stops (checkpointed) and goes on with 3. Every step's global
    batch is the one-process run's, sample by sample, its loss within 1e-5; the ledger counts 2 resizes."""
    reference = subprocess.run(
        runner_command(tmp_path / "reference", *TRAIN, f"+callbacks.samples.record={tmp_path / 'ref'}"),
        cwd=tmp_path, env=cli_env(TESTS), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    run_dir, record = tmp_path / "run", tmp_path / "elastic"
    env = cli_env(TESTS)
    with bridged_namespaces(NAME, SUBNET, 4) as addresses:
        hosts = tmp_path / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} node{i}\n" for i, a in enumerate(addresses)))

        def node(i: int, command: list[str]) -> subprocess.Popen:
            log = open(tmp_path / f"node{i}.log", "w")  # noqa: SIM115 (the process's, closed at its end)
            return subprocess.Popen(
                [*as_machine(f"{NAME}{i}", f"node{i}", hosts), *command], cwd=tmp_path, env=env,
                stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip

        join = [sys.executable, "-m", "runner", "join", "node0:29400"]
        gate = tmp_path / "gate"  # on 2 nodes, the job stands at step 40 until the 4th node is there
        held = [
            "+callbacks.gate._target_=probes.GateAtStep",
            f"+callbacks.gate.gate={gate}",
            "+callbacks.gate.step=40",
            "+callbacks.gate.world=2",
        ]
        nodes = [
            node(0, runner_command(run_dir, *TRAIN, *ELASTIC, *held, f"+callbacks.samples.record={record}"))
        ]
        try:
            nodes += [node(1, join), node(2, join)]
            _wait(
                lambda: (run_dir / "checkpoints" / "checkpoint_0").is_dir() and 3 in _worlds(record),
                nodes[0],
                "checkpoint on 3 nodes",
            )
            os.killpg(nodes[2].pid, signal.SIGKILL)
            _wait(lambda: 2 in _worlds(record), nodes[0], "step on the 2 nodes left")
            nodes.append(node(3, join))
            _wait(
                lambda: "starting 1 ranks" in (tmp_path / "node3.log").read_text(),
                nodes[0],
                "4th node's agent",
            )
            time.sleep(1)  # its agent meets the others' (which see it waiting within 0.1 s)
            gate.touch()
            nodes[0].wait(timeout=240)
            first = (tmp_path / "node0.log").read_text()
            assert nodes[0].returncode == 0, first
            assert nodes[1].wait(timeout=60) == 0 and nodes[3].wait(timeout=60) == 0
        finally:
            for proc in nodes:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
    worlds = _worlds(record)
    assert worlds[0] == 3 and worlds[-1] == 3 and 2 in worlds, worlds
    logs = [(tmp_path / f"node{i}.log").read_text() for i in range(4)]
    # The node whose agent saw its rank fail first restarts it; the other may see it come back first.
    assert any("restart 1 of 2" in log for log in logs[:2]) and "the job's nodes change" in first
    assert first.count("the job's nodes met") == 3
    expected, trained = global_batches(tmp_path / "ref"), global_batches(record)
    assert sorted(trained) == list(range(1, 61))
    assert all(trained[step] == expected[step] for step in expected)  # each sample, in its place
    ours, theirs = _losses(run_dir), _losses(tmp_path / "reference")
    assert sorted(ours) == sorted(theirs) and all(abs(ours[s] - theirs[s]) <= 1e-5 for s in theirs), (
        ours,
        theirs,
    )
    summary = json.loads((run_dir / "goodput.json").read_text())
    assert summary["resizes"] == 2


RANGE = ["launcher=elastic", "launcher.min_nodes=2", "launcher.max_nodes=3", "hardware.num_processes=1"]
WHOLE = [*RANGE, "hardware=ddp", "trainer.split_batches=true", "data.batch_size=12", "launcher.restarts=1"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launcher=elastic", "launcher.min_nodes=3", "launcher.max_nodes=2"], "launcher.min_nodes=3 > launcher.max_nodes=2: the fewest nodes"),
        ([*RANGE, "hardware=ddp", "launcher.restarts=1"], "with a batch size per rank the global batch would change with the number of nodes"),
        ([*WHOLE, "data.batch_size=9"], "data.batch_size=9 with launcher.min_nodes=2 to max_nodes=3: the global batch must split evenly over the ranks at every size (2, 3 ranks), and 2 do not divide it. Use a multiple of 6."),
        ([*WHOLE, "hardware=deepspeed"], "this hardware's checkpoints ('deepspeed') load only on as many ranks as wrote them"),
        ([*WHOLE, "launcher.restarts=0"], "the job goes on without it only through a restart of the rank group"),
        ([*WHOLE, "launcher.endpoint=node0"], "launcher.endpoint='node0': expected host:port"),
        (["-m", *WHOLE, "trainer.seed=1,2"], "a sweep (-m) with launcher=elastic and launcher.max_nodes > 1: every other node's"),
    ],
    ids=["min-above-max", "batch-per-rank", "uneven-batch", "no-reshard", "no-restarts", "endpoint", "sweep"],
)  # fmt: skip
def test_what_a_change_of_size_would_break_is_refused_before_any_node_starts(tmp_path, overrides, message):
    proc = rank_checks.command(runner_command(tmp_path / "run", *overrides), tmp_path, env=cli_env())
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "meeting point" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


def test_runner_join_takes_one_endpoint(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "join"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert proc.returncode == 2 and "runner join takes one argument: the host:port" in proc.stderr, (
        proc.stderr
    )
