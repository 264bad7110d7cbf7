"""`trainer.async_checkpoint=true` (`save_state(blocking=False)`): the state is copied into host memory and
written by a background thread. What it writes is what a blocking save writes, however training goes on
meanwhile; a checkpoint becomes latest only once complete, so kill -9 at any moment leaves a loadable
latest; a stop signal writes its checkpoint after the pending one; a run resumed from them ends bitwise
like an uninterrupted one."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import rank_checks
from conftest import cli_env, runner_command

from runner.checkpoint.files import damage, latest_checkpoint, read_meta

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("hardware", "ranks"),
    [("cpu_forked", 1), ("multi_gpu", 2), ("fsdp", 2), ("megatron_tp2", 2), ("megatron_pp2_1f1b", 2)],
)
def test_a_background_save_holds_the_state_of_its_call_while_training_goes_on(tmp_path, hardware, ranks):
    losses = rank_checks.run_ranks(
        rank_checks.async_checkpoint_round_trip, hardware, str(tmp_path), num_processes=ranks
    )[0]
    assert losses["background"] == losses["first"] == losses["blocking"]


def run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        runner_command(run_dir, *overrides), env=cli_env(), capture_output=True, text=True, timeout=300
    )


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        runner_command(run_dir, *overrides),
        env=cli_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # kill -9 takes the whole job
    )


SHORT = [
    "trainer.max_steps=60",
    "trainer.checkpoint_every=20",
    "trainer.keep_checkpoints=null",
    "model.dropout=0.1",
]


@pytest.mark.parametrize(
    "hardware", [[], ["hardware=fsdp", "hardware.num_processes=2"]], ids=["cpu", "fsdp2"]
)
def test_background_checkpoints_are_the_blocking_ones_and_resume_bitwise(tmp_path, hardware):
    blocking = run(tmp_path / "blocking", *SHORT, *hardware)
    assert blocking.returncode == 0, blocking.stderr
    background = run(tmp_path / "background", *SHORT, *hardware, "trainer.async_checkpoint=true")
    assert background.returncode == 0, background.stderr
    for number in range(3):
        written = [
            tmp_path / run_name / "checkpoints" / f"checkpoint_{number}"
            for run_name in ("blocking", "background")
        ]
        # Every file, its size and CRC-32 (meta.json's record of them) alike; but DCP's `.metadata`, which
        # records the directory it was written to (these two differ).
        files = [
            {
                name: digest
                for name, digest in read_meta(path)["files"].items()
                if not name.endswith("/.metadata")
            }
            for path in written
        ]
        assert files[0] == files[1] and len(files[0]) >= 5
    final = (tmp_path / "background" / "model" / "model.safetensors").read_bytes()
    assert final == (tmp_path / "blocking" / "model" / "model.safetensors").read_bytes()
    resumed = run(
        tmp_path / "resumed",
        *SHORT,
        *hardware,
        f"trainer.resume={tmp_path / 'background' / 'checkpoints' / 'checkpoint_1'}",
    )
    assert resumed.returncode == 0, resumed.stderr
    assert (tmp_path / "resumed" / "model" / "model.safetensors").read_bytes() == final


# Big enough that a write takes a while (an MLP of ~4M parameters: ~50 MB with AdamW's states), a
# checkpoint every 2 steps: whenever the run is killed, a write is in progress or about to be.
KILLED = [
    "trainer.max_steps=200",  # 6 kills, each within 0.6 s of a new checkpoint, take 15-80 of them
    "trainer.checkpoint_every=2",
    "trainer.eval_every=0",
    "trainer.async_checkpoint=true",
    "model.hidden_size=1024",
    "model.dropout=0.1",
]


def wait_for_new_latest(run_dir: Path, proc: subprocess.Popen, before: Path | None) -> None:
    """Wait until the run marks a checkpoint other than `before` latest (it is training, and writing)."""
    deadline = time.monotonic() + 120
    while latest_checkpoint(run_dir / "checkpoints") in (None, before):
        assert proc.poll() is None and time.monotonic() < deadline, "no new checkpoint was written"
        time.sleep(0.02)


KILLS = 6  # each a run started again: a few random moments (seeded), not a sampling of every one


def test_kill_9_at_random_moments_of_background_writes_leaves_a_loadable_latest(tmp_path):
    # Uninterrupted and without checkpoints: saving changes nothing of training, and writes ~5 GB here.
    reference = run(tmp_path / "reference", *[o for o in KILLED if "checkpoint" not in o])
    assert reference.returncode == 0, reference.stderr
    rng = random.Random(0)
    kills = 0
    while kills < KILLS:
        before = latest_checkpoint(tmp_path / "run" / "checkpoints")
        proc = start(tmp_path / "run", *KILLED)
        wait_for_new_latest(tmp_path / "run", proc, before)
        time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:  # it finished first
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        kills += 1
        latest = latest_checkpoint(tmp_path / "run" / "checkpoints")
        assert latest is not None
        assert damage(latest, read_meta(latest)) == [], latest  # complete: every file's size and CRC-32
    assert kills == KILLS, f"the run finished after {kills} kills: give it more steps"
    finished = run(tmp_path / "run", *KILLED)
    assert finished.returncode == 0, finished.stderr
    assert "resumed from" in (tmp_path / "run" / "runner.log").read_text()
    final = (tmp_path / "run" / "model" / "model.safetensors").read_bytes()
    assert final == (tmp_path / "reference" / "model" / "model.safetensors").read_bytes()


# The signal comes after step 50's checkpoint, and the loop stops at its next logging step, before step 100's.
HELD = ["trainer.max_steps=1000", "trainer.checkpoint_every=50", "trainer.eval_every=0", "trainer.async_checkpoint=true"]


def test_a_stop_signal_writes_its_checkpoint_after_the_pending_one(tmp_path):
    """The first checkpoint's background write is held (a callback's state that waits in its pickling)
    when the signal arrives, and until 1 s after it: meanwhile the loop reaches its next logging step and
    the stop's checkpoint, which must wait for the pending one (or that one, committed last, would be
    marked latest in place of the stop's)."""
    gate, marker = tmp_path / "gate", tmp_path / "held"
    held = [
        "+callbacks.held._target_=probes.HoldFirstWrite", f"+callbacks.held.gate={gate}",
        f"+callbacks.held.marker={marker}",
    ]  # fmt: skip
    proc = subprocess.Popen(
        runner_command(tmp_path, *HELD, *held), env=cli_env(Path(__file__).parent), stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "no write was held"
    assert latest_checkpoint(tmp_path / "checkpoints") is None  # the held write is the first
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(1.0)
    gate.touch()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    numbered = sorted(
        (tmp_path / "checkpoints").glob("checkpoint_*"), key=lambda path: int(path.name.split("_")[1])
    )
    latest = latest_checkpoint(tmp_path / "checkpoints")
    assert latest == numbered[-1] and damage(latest, read_meta(latest)) == []
    steps = [json.loads((path / "meta.json").read_text())["step"] for path in numbered]
    assert steps[0] == 50 and steps == sorted(steps)  # the signal's checkpoint is the newest


def test_async_checkpoints_with_deepspeed_are_refused_before_launch(forked_cli):
    proc = forked_cli("hardware=deepspeed", "hardware.num_processes=1", "trainer.async_checkpoint=true")
    assert proc.returncode == 2, proc.stderr
    assert (
        "trainer.async_checkpoint=true: runner.hardware.deepspeed.DeepSpeed writes its checkpoints itself"
        in proc.stderr
    )
