"""`launcher=ray` on a real two-node Ray cluster on this machine (a head and a second raylet in a
loopback-only network namespace, `.ci/ray.sh`), which the first test that needs it starts and the last
stops. Where it cannot start (not root, no Ray) these tests skip, saying so. The commands run inside that
namespace (`nsenter --net`), where the cluster is 127.0.0.1:6379."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cli_env, metrics_of, runner_command

from runner.errors import ConfigError, RankFailedError
from runner.launchers.ray.cluster import ANSWER_S, Node, connect, placement
from runner.launchers.ray.launcher import REPORTS, outcome
from runner.launchers.ray.workers import ERRORS, WORKERS
from runner.launchers.reports import report_failure
from runner.telemetry.goodput import read_ledger

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
ROOT = TESTS.parent
NAMESPACE = Path("/run/netns/runner-ray")
ADDRESS = "127.0.0.1:6379"
RAY = ["launcher=ray", f"launcher.address={ADDRESS}"]
TWO_NODES = ["hardware.num_processes=2", "launcher.placement=spread"]
TRAIN = [
    "trainer.max_steps=300",
    "trainer.eval_every=100",
    "trainer.checkpoint_every=25",
    "model.dropout=0.1",
]
HARDWARE = {"ddp": "hardware=ddp", "fsdp": "hardware=fsdp"}


def in_cluster(command: list[str]) -> list[str]:
    return ["nsenter", f"--net={NAMESPACE}", *command]


def cluster_answers() -> bool:
    status = subprocess.run(
        in_cluster([sys.executable, "-m", "ray.scripts.scripts", "status", "--address", ADDRESS]),
        capture_output=True,
        text=True,
    )
    return status.returncode == 0 and len(re.findall(r"^ 1 node_", status.stdout, re.M)) >= 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """The cluster of `.ci/ray.sh`, started for this file's tests and stopped after them when it was not up
    before (an idle Ray cluster's processes slowed the rest of the suite on 2 cores by a third); skip where
    it cannot start (not root, no Ray), saying so."""
    started = False
    if not (NAMESPACE.exists() and cluster_answers()):
        up = subprocess.run(
            ["bash", str(ROOT / ".ci" / "ray.sh"), "up"], capture_output=True, text=True, timeout=300
        )
        if up.returncode != 0 or not NAMESPACE.exists():
            pytest.skip(
                f"no Ray cluster on this machine: `bash .ci/ray.sh up` says {up.stdout.strip()[-300:]}"
            )
        started = True
    if not cluster_answers():
        pytest.skip("the Ray cluster does not answer with 2 nodes: `bash .ci/ray.sh up`")
    yield
    if started:
        subprocess.run(["bash", str(ROOT / ".ci" / "ray.sh"), "down"], capture_output=True, timeout=120)


def run(run_dir: Path, *overrides: str, namespace: bool = True) -> subprocess.CompletedProcess:
    command = runner_command(run_dir, *overrides)
    return subprocess.run(
        in_cluster(command) if namespace else command,
        env=cli_env(TESTS),
        cwd=run_dir.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        in_cluster(runner_command(run_dir, *overrides)),
        env=cli_env(TESTS),
        cwd=run_dir.parent,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict[str, bytes]:
    """The final weights of the same runs on 2 local ranks (`launcher=local`), by hardware."""
    weights = {}
    for name, hardware in HARDWARE.items():
        run_dir = tmp_path_factory.mktemp(f"local-{name}") / "run"
        proc = run(run_dir, hardware, "hardware.num_processes=2", *TRAIN, namespace=False)
        assert proc.returncode == 0, proc.stderr
        weights[name] = (run_dir / "model" / "model.safetensors").read_bytes()
    return weights


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} was written:\n{proc.stderr.read()}"  # type: ignore[union-attr]
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.1)


def workers(run_dir: Path) -> dict[int, dict]:
    """Where each rank of the launch's current worker group runs (what the ranks report)."""
    return {
        int(path.stem.removeprefix("rank")): json.loads(path.read_text())
        for path in (run_dir / "ray" / "workers").glob("rank*.json")
    }


def gated(gate: Path, step: int) -> list[str]:
    """The ranks wait at their `step`-th step until `gate` exists."""
    return ["task._target_=faulty_tasks.WaitAtStep", f"+task.gate={gate}", f"+task.step={step}"]


def test_a_worker_killed_mid_run_is_restarted_by_ray_and_the_run_ends_bitwise_as_on_local_ranks(
    cluster, local, tmp_path
):
    """DDP on one worker per node (spread); rank 1's process killed (-9) after a checkpoint:
    launcher.restarts=1 lets Ray start the worker group again, which resumes from the latest checkpoint
    and ends with exactly the weights of the uninterrupted local 2-rank run."""
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    proc = start(
        run_dir, *RAY, HARDWARE["ddp"], *TWO_NODES, *TRAIN, "launcher.restarts=1", *gated(gate, 60)
    )
    wait_for(run_dir / "checkpoints" / "latest", proc)
    wait_for(run_dir / "ray" / "workers" / "rank1.json", proc)
    first = workers(run_dir)
    assert first[0]["node_id"] != first[1]["node_id"]  # one worker per node
    os.kill(first[1]["pid"], signal.SIGKILL)
    gate.touch()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "resumed from" in stderr
    assert (run_dir / "model" / "model.safetensors").read_bytes() == local["ddp"]
    assert {record["attempt"] for record in workers(run_dir).values()} == {2}
    summary = json.loads((run_dir / "goodput.json").read_text())
    assert (summary["attempts"], summary["restarts"]) == (2, 1) and summary["phases_s"]["restart"] > 0
    assert any(r.get("before") == "restart" for r in read_ledger(run_dir))


def test_with_no_restarts_a_killed_worker_fails_the_job_within_a_minute_naming_rank_node_and_cause(
    cluster, tmp_path
):
    run_dir = tmp_path / "run"
    proc = start(run_dir, *RAY, HARDWARE["ddp"], *TWO_NODES, *gated(tmp_path / "never", 5))
    wait_for(run_dir / "ray" / "workers" / "rank1.json", proc)
    killed = workers(run_dir)[1]
    os.kill(killed["pid"], signal.SIGKILL)
    began = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - began < 60
    assert proc.returncode == 1, stderr
    assert f"rank 1 on node 127.0.0.1 ({killed['node_id'][:8]}, host " in stderr
    assert re.search(
        rf"pid {killed['pid']}: [^\n]*The actor is dead because its worker process has died\.", stderr
    )
    assert not (run_dir / "metrics.json").exists()


def test_sigterm_to_the_command_checkpoints_the_ranks_exits_75_and_the_run_resumes_bitwise(
    cluster, local, tmp_path
):
    """FSDP on two nodes: SIGTERM to the command reaches the ranks (in Ray's worker threads, through the
    run dir), which checkpoint and stop; the same command resumes and ends as the local 2-rank run."""
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    overrides = [*RAY, HARDWARE["fsdp"], *TWO_NODES, *TRAIN, *gated(gate, 60)]
    proc = start(run_dir, *overrides)
    wait_for(run_dir / "checkpoints" / "latest", proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(run_dir / "ray" / "stop", proc, timeout=30)
    gate.touch()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    assert "Training interrupted: stopped by SIGTERM; checkpoint" in stderr
    assert "to resume" in stderr
    resumed = run(run_dir, *overrides)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert (run_dir / "model" / "model.safetensors").read_bytes() == local["fsdp"]


def test_a_sweep_runs_its_jobs_at_once_on_the_cluster_and_a_second_run_skips_the_finished(cluster, tmp_path):
    """Two jobs, each its own worker group, run concurrently (the cluster holds both); each trains exactly
    as its own local run; the same command again runs nothing. `launcher.runtime_env` reaches the
    workers: its variable, not the command's, names the file where their models count themselves."""
    sweep_dir, counted = tmp_path / "sweep", tmp_path / "counted"
    command = [
        sys.executable, "-m", "runner", "-m", *RAY, "tracker=none", "trainer.plots=false",
        "trainer.progress_bar=false", f"hydra.sweep.dir={sweep_dir}", "trainer.max_steps=50",
        "optimizer.lr=1e-3,3e-3", "model._target_=probes.CountedMLP",
        f"+launcher.runtime_env.env_vars.PROBE_MODELS={counted / 'workers'}",
    ]  # fmt: skip
    counted.mkdir()
    env = cli_env(TESTS) | {"PROBE_MODELS": str(counted / "command")}
    proc = subprocess.run(in_cluster(command), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr

    def devices(name: str) -> list[str]:  # of each model built: meta for the checks, cpu to train
        return [line.split(":")[1] for line in (counted / name).read_text().split()]

    assert devices("workers").count("cpu") == 2 and "cpu" not in devices("command")  # one per job's worker
    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and len({row["eval/loss"] for row in rows}) == 2
    spans = []
    for job in range(2):
        records = read_ledger(sweep_dir / str(job))
        spans.append((min(r["t0"] for r in records), max(r["t1"] for r in records)))
    overlapping = sum(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1 :])
    assert overlapping >= 1, spans
    alone = run(tmp_path / "alone", "trainer.max_steps=50", "optimizer.lr=3e-3", namespace=False)
    assert alone.returncode == 0, alone.stderr
    job = next(row["job"] for row in rows if float(row["optimizer.lr"]) == 3e-3)
    assert (sweep_dir / job / "model" / "model.safetensors").read_bytes() == (
        tmp_path / "alone" / "model" / "model.safetensors"
    ).read_bytes()
    again = subprocess.run(in_cluster(command), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "job(s) 0, 1 finished before and are not run again" in again.stdout + again.stderr


def test_what_the_cluster_cannot_run_is_refused_before_anything_is_submitted(cluster, tmp_path):
    """One paragraph each, exit 2, no Ray Train run made: more workers than the placement can put on its
    nodes; a run dir the nodes do not share with the command. `plan=true` shows where the workers would
    go."""
    cases = {
        "too-many": ([*RAY, HARDWARE["ddp"], "hardware.num_processes=3", "launcher.placement=strict_spread"],
                     "3 worker(s) of launcher.cpus_per_worker=1 and launcher.gpus_per_worker=0 with "
                     "launcher.placement=strict_spread: the cluster has 2 node(s), 4 CPU(s) and 0 GPU(s) in all, "
                     "and one worker per node needs as many nodes that each hold one worker; Ray would wait"),
    }  # fmt: skip
    for name, (overrides, message) in cases.items():
        proc = run(tmp_path / name, *overrides)
        assert proc.returncode == 2, proc.stderr
        assert f"Configuration error: {message}" in proc.stderr
        assert not (tmp_path / name / "ray").exists()
    # The command sees its own filesystem at the run dir (a mount the nodes do not have).
    private = tmp_path / "private"
    private.mkdir()
    command = " ".join(runner_command(private / "run", *RAY))
    proc = subprocess.run(
        in_cluster(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none {private} && {command}"]),
        env=cli_env(TESTS),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"the run dir {private / 'run'} is not storage every node of the Ray cluster writes" in proc.stderr
    assert "cannot write there (No such file or directory)" in proc.stderr
    plan = run(tmp_path / "plan", *RAY, HARDWARE["ddp"], *TWO_NODES, "plan=true")
    assert plan.returncode == 0, plan.stderr
    assert re.search(
        r"RayLauncher: 2 worker\(s\) x 1 CPU\(s\), 0 GPU\(s\) on the Ray cluster at 127.0.0.1:6379 \(2 node\(s\), "
        r"4 CPU\(s\), 0 GPU\(s\)\); placement spread, workers per node: 127.0.0.1 \(\w{8}\): 1, 127.0.0.1 \(\w{8}\): 1",
        plan.stdout,
    )


def test_the_ranks_run_in_the_commands_dir_where_a_projects_relative_paths_hold(cluster, tmp_path):
    """`runner init`'s project (its data.path relative: data/points.csv) on the cluster: the workers work in
    the command's dir, not in Ray's own, so the file is found and its model trains."""
    init = subprocess.run(
        [sys.executable, "-m", "runner", "init", "moons"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True
    )
    assert init.returncode == 0, init.stderr
    project = tmp_path / "moons"
    command = [sys.executable, "-m", "runner", "--config-dir", "conf", "experiment=example", "tracker=none",
               "trainer.progress_bar=false", "trainer.plots=false", f"hydra.run.dir={tmp_path / 'run'}", *RAY]  # fmt: skip
    proc = subprocess.run(in_cluster(command), cwd=project, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics_of(proc)["eval/accuracy"] > 0.8


def test_placement_fills_nodes_as_ray_places_each_strategy():
    nodes = [Node("a" * 8, "10.0.0.1", cpus=4, gpus=2), Node("b" * 8, "10.0.0.2", cpus=4, gpus=2)]
    a, b = (node.name for node in nodes)
    assert placement(nodes, 3, 1, 0, "pack") == {a: 3}
    assert placement(nodes, 3, 1, 0, "spread") == {a: 2, b: 1}
    assert placement(nodes, 2, 1, 0, "strict_spread") == {a: 1, b: 1}
    assert placement(nodes, 3, 1, 1, "pack") == {a: 2, b: 1}  # two GPUs per node
    with pytest.raises(ConfigError, match="all of them on one node needs a node that holds them all"):
        placement(nodes, 3, 1, 1, "strict_pack")
    with pytest.raises(ConfigError, match="one worker per node needs as many nodes"):
        placement(nodes, 3, 1, 0, "strict_spread")
    with pytest.raises(ConfigError, match=r"1 worker\(s\) of launcher.cpus_per_worker=5 .* they do not fit"):
        placement(nodes, 1, 5, 0, "pack")


def test_a_worker_that_died_is_named_as_the_cause_over_what_another_rank_raised_after_it(tmp_path):
    """Ray reports rank 1's worker dead (no report of its own: it was killed); rank 0, which had not yet met
    it in a collective, raised an error of its own meanwhile (under load: its process group's connection
    refused). The dead worker is the cause, as a killed rank is under the local launcher."""
    WorkerGroupError = pytest.importorskip("ray.train").WorkerGroupError
    reports = tmp_path / REPORTS
    (reports / WORKERS).mkdir(parents=True)
    where = {
        "rank": 1,
        "node_id": "0123456789abcdef",
        "host": "vm",
        "ip": "127.0.0.1",
        "pid": 4242,
        "attempt": 1,
    }
    (reports / WORKERS / "rank1.json").write_text(json.dumps(where))
    try:
        raise RuntimeError("[gloo] connect to 127.0.0.1:29500 failed: Connection refused")
    except RuntimeError as err:
        report_failure(reports / ERRORS, 0, err)
    died = RuntimeError(
        "A worker health check failed. The actor is dead because its worker process has died."
    )
    with pytest.raises(RankFailedError) as raised:
        outcome(tmp_path, 0.0, [], WorkerGroupError("rank 1 died", {1: died}), 0)
    assert str(raised.value).startswith(
        "rank 1 on node 127.0.0.1 (01234567, host vm), pid 4242: A worker health"
    )


def test_a_head_that_does_not_answer_is_refused_at_once():
    pytest.importorskip("ray")
    began = time.monotonic()
    with pytest.raises(
        ConfigError, match=r"launcher.address=127.0.0.1:1: no Ray cluster answers there \(127.0.0.1:1: "
    ):
        connect("127.0.0.1:1", {})
    assert time.monotonic() - began < 10


def test_an_address_that_is_not_one_or_a_head_that_never_answers_is_refused_naming_it():
    """`notahost` is no address (Ray's own error was a ValueError traceback); something that accepts TCP
    connections and never answers (Ray's client retried past 200 s) is refused within the stated time."""
    pytest.importorskip("ray")
    with pytest.raises(ConfigError, match=r"launcher.address='notahost': expected auto .*, or the head's <host>:<port>"):
        connect("notahost", {})
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts (the kernel completes the handshake) and never reads nor writes
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    began = time.monotonic()
    try:
        with pytest.raises(ConfigError) as refused:
            connect(address, {})
    finally:
        silent.close()
    assert time.monotonic() - began < ANSWER_S + 5
    assert str(refused.value).startswith(
        f"launcher.address={address}: no Ray cluster answers there ({address}: it accepted a connection but gave "
        f"no answer within {ANSWER_S:.0f} s, as a Ray head does at once)."
    )


def test_without_ray_the_launcher_is_refused_with_the_install_line(monkeypatch):
    from runner.launchers.ray import RayLauncher

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.train", None)
    with pytest.raises(
        ConfigError,
        match=r"launcher=ray needs Ray Train, which is not installed. Install it with `pip install '[\w-]+\[ray\]'`",
    ):
        RayLauncher()
