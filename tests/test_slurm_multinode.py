"""`launcher=slurm` across two hosts: the nodes `rnode1` and `rnode2` of partition `multinode` that
`bash .ci/slurm.sh up --nodes 2` starts, each slurmd (and the tasks it starts) in its own network namespace
and hostname, reached over a bridge. Without them these tests skip, saying so."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import cli_env, metrics_of, runner_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NODES = ("rnode1", "rnode2")
TWO_NODES = ["launcher=slurm", "launcher.partition=multinode", "launcher.nodes=2"]
ONE_RANK_EACH = [*TWO_NODES, "hardware=ddp", "hardware.num_processes=1"]  # DDP, a rank per node
RENDEZVOUS = re.compile(r"rendezvous at (\S+):\d+ \((\S+)\): (\d+) rank\(s\) on (\d+) host\(s\): (.*)")


@pytest.fixture(scope="module")
def two_nodes() -> None:
    """Skip unless both nodes of partition `multinode` answer."""
    proc = subprocess.run(
        ["sinfo", "--noheader", "--Node", "--partition=multinode", "--format=%N %T"],
        capture_output=True,
        text=True,
    )
    up = [line.split()[0] for line in proc.stdout.splitlines() if not line.split()[-1].endswith("*")]
    if proc.returncode != 0 or sorted(up) != list(NODES):
        pytest.skip(
            f"no two-node SLURM partition here ({proc.stderr.strip() or proc.stdout.strip() or 'none'}): "
            "`bash .ci/slurm.sh up --nodes 2` (as root) starts one"
        )


def run(run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        runner_command(run_dir, *overrides), env=cli_env(), cwd=run_dir.parent,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        runner_command(run_dir, *overrides),
        env=cli_env(),
        cwd=run_dir.parent,
        stderr=subprocess.PIPE,
        text=True,
    )


def hosts_of(run_dir: Path) -> dict[int, str]:
    """Each task's host, as submitit's own log of the task says."""
    hosts = {}
    for log in (run_dir / "slurm").glob("*_log.out"):
        found = re.search(r"hostname=(\S+), .*global_rank=(\d+)\(", log.read_text())
        if found:
            hosts[int(found.group(2))] = found.group(1)
    return hosts


def node_processes(node: str, pattern: str) -> list[int]:
    """The processes in `node`'s network namespace whose command line contains `pattern`."""
    pids = subprocess.run(
        ["ip", "netns", "pids", f"runner-{node}"], capture_output=True, text=True
    ).stdout.split()
    found = []
    for pid in pids:
        try:
            if pattern in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(pid))
        except OSError:
            pass
    return found


def wait_for(condition, what: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.02)


def assert_same_training(
    slurm: subprocess.CompletedProcess, local: subprocess.CompletedProcess, tmp_path: Path
) -> None:
    """The same final metrics and, to the bit, the same final weights (in tmp_path/slurm and /local)."""
    assert local.returncode == 0, local.stderr
    assert metrics_of(slurm) == metrics_of(local)
    weights = [tmp_path / name / "model" / "model.safetensors" for name in ("slurm", "local")]
    assert weights[0].read_bytes() == weights[1].read_bytes()


def test_a_two_node_ddp_job_meets_at_the_first_node_and_trains_exactly_as_two_local_ranks(
    two_nodes, tmp_path
):
    proc = run(
        tmp_path / "slurm",
        *ONE_RANK_EACH,
        "trainer.max_steps=30",
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 node(s) x 1 task(s)" in proc.stderr
    address, ip, ranks, hosts, layout = RENDEZVOUS.search(proc.stderr).groups()
    assert (address, ranks, hosts, layout) == ("rnode1", "2", "2", "rnode1 [0], rnode2 [1]")
    assert ip == "10.251.77.11"  # the first node's own interface, never 127.0.0.1
    assert hosts_of(tmp_path / "slurm") == {0: "rnode1", 1: "rnode2"}
    local = run(tmp_path / "local", "hardware=ddp", "hardware.num_processes=2", "trainer.max_steps=30")
    assert_same_training(proc, local, tmp_path)


def test_a_two_node_fsdp_job_with_two_tasks_each_trains_exactly_as_four_local_ranks(two_nodes, tmp_path):
    train = ["hardware=fsdp", "trainer.max_steps=20", "data.batch_size=8"]
    proc = run(tmp_path / "slurm", *TWO_NODES, *train, "hardware.num_processes=2")
    assert proc.returncode == 0, proc.stderr
    assert RENDEZVOUS.search(proc.stderr).group(5) == "rnode1 [0-1], rnode2 [2-3]"
    assert hosts_of(tmp_path / "slurm") == {0: "rnode1", 1: "rnode1", 2: "rnode2", 3: "rnode2"}
    local = run(tmp_path / "local", *train, "hardware.num_processes=4", "hardware.oversubscribe=true")
    assert_same_training(proc, local, tmp_path)


def test_a_preempted_two_node_job_requeues_and_ends_bitwise_equal(two_nodes, tmp_path):
    train = [
        "trainer.max_steps=600",
        "trainer.eval_every=200",
        "trainer.checkpoint_every=50",
        "model.dropout=0.1",
    ]
    reference = run(tmp_path / "reference", "hardware=ddp", "hardware.num_processes=2", *train)
    assert reference.returncode == 0, reference.stderr
    run_dir = tmp_path / "run"
    proc = start(run_dir, *ONE_RANK_EACH, *train)
    try:
        wait_for(lambda: list((run_dir / "slurm").glob("*_submitted.pkl")), "the submission", proc)
        job = next((run_dir / "slurm").glob("*_submitted.pkl")).name.split("_")[0]
        wait_for((run_dir / "checkpoints" / "latest").exists, "a checkpoint", proc)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert f"requeueing SLURM job {job}" in stderr
    assert "Restarts=1" in subprocess.check_output(["scontrol", "show", "job", job], text=True)
    assert "resumed from" in (run_dir / "runner.log").read_text()
    assert RENDEZVOUS.search(stderr).group(5) == "rnode1 [0], rnode2 [1]"
    weights = [d / "model" / "model.safetensors" for d in (run_dir, tmp_path / "reference")]
    assert weights[0].read_bytes() == weights[1].read_bytes()


def test_a_job_told_other_tasks_than_it_asked_for_is_refused_naming_both(two_nodes, tmp_path):
    proc = run(
        tmp_path / "run",
        *ONE_RANK_EACH,
        'launcher.srun_args=["--ntasks=1"]',
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "launcher.nodes=2 x 1 task(s) per node asks for 2 rank(s) on 2 node(s), but SLURM started this task as one "
        "of 1 rank(s) on 1 node(s)" in proc.stderr
    )


def test_a_rank_that_never_joins_fails_the_job_naming_its_host(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, *ONE_RANK_EACH, "hardware.timeout_s=15")
    try:
        # rank 1 hangs before it reaches the rendezvous (as on a node whose filesystem hangs)
        wait_for(lambda: node_processes("rnode2", "submitit.core._submit"), "rank 1's start", proc)
        stopped = time.monotonic()
        for pid in node_processes("rnode2", "submitit.core._submit"):
            subprocess.run(["kill", "-STOP", str(pid)], check=True)
        _, stderr = proc.communicate(timeout=120)
        waited = time.monotonic() - stopped
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert (
        "1 of 2 rank(s) did not join the rendezvous at rnode1:" in stderr
        and "within hardware.timeout_s=15: rank(s) 1, which SLURM started on rnode2" in stderr
    )
    assert 15 <= waited < 60


@pytest.fixture
def restored_nodes(two_nodes):
    """Bring back the nodes a test killed."""
    yield
    subprocess.run(
        ["bash", str(ROOT / ".ci" / "slurm.sh"), "up", "--nodes", "2"], check=True, capture_output=True
    )


def test_a_node_that_dies_fails_the_job_within_a_minute_naming_it(restored_nodes, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, *ONE_RANK_EACH, "trainer.max_steps=1000000")
    try:
        wait_for(lambda: "step " in (run_dir / "runner.log").read_text(errors="replace")
                 if (run_dir / "runner.log").exists() else False, "training", proc)  # fmt: skip
        for pid in node_processes("rnode2", ""):  # the node goes: its slurmd, the step's daemon, the rank
            subprocess.run(["kill", "-KILL", str(pid)], check=False)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        waited = time.monotonic() - killed
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert waited < 60
    assert re.search(
        r"Training failed: SLURM job \d+ lost node\(s\) rnode2 \(down\*: Not responding\)", stderr
    )
    job = re.search(r"SLURM job (\d+) lost", stderr).group(1)
    assert "requeued it" in stderr
    # Not left to start again once the node is back: gone from the queue once SLURM has finished
    # completing it (a loaded controller may list it as completing, CG, for a few seconds).
    deadline = time.monotonic() + 30
    while (queued := squeue_line(job)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not queued, queued


def squeue_line(job: str) -> str:
    return subprocess.run(["squeue", "--noheader", "--jobs", job], capture_output=True, text=True).stdout.strip()


def test_a_job_waiting_for_a_drained_node_says_why_and_runs_once_it_is_back(restored_nodes, tmp_path):
    subprocess.run(["scontrol", "update", "nodename=rnode2", "state=drain", "reason=maintenance"], check=True)
    run_dir = tmp_path / "run"
    proc = start(run_dir, *ONE_RANK_EACH, "trainer.max_steps=10")
    deadline = threading.Timer(180, proc.kill)  # a launcher that never says so ends the test, not CI
    deadline.start()
    try:
        lines: list[str] = []
        while not any("is pending: " in line for line in lines):
            line = proc.stderr.readline()
            assert line, f"the run ended without saying why its job waits: {''.join(lines)}"
            lines.append(line)
        subprocess.run(["scontrol", "update", "nodename=rnode2", "state=resume"], check=True)
        _, stderr = proc.communicate(timeout=180)
    finally:
        deadline.cancel()
        proc.kill()
    assert proc.returncode == 0, "".join(lines) + stderr
    pending = next(line for line in lines if "is pending: " in line)
    assert "DOWN, DRAINED or reserved" in pending or "ReqNodeNotAvail" in pending, pending
    assert RENDEZVOUS.search(stderr).group(5) == "rnode1 [0], rnode2 [1]"
