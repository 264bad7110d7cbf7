"""`python -m runner` interrupted (SIGTERM, kill -9) and run again ends exactly where an uninterrupted run
does: the final weights are bitwise identical, with 1 and with 2 processes."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rank_checks
import references as stored
import torch
from conftest import cli_env, metrics_of, runner_command, wait_for_checkpoint
from hydra import compose, initialize_config_dir
from safetensors.torch import load

from runner.cli import checks_before_launch, resume_last
from runner.config import CONF_DIR
from runner.errors import ConfigError
from runner.group_schemas import register_configs
from runner.run_dir import lock as dir_lock
from runner.telemetry.goodput import read_ledger, summarize
from runner.telemetry.history import read_history

pytestmark = pytest.mark.slow

# A dropout MLP for 300 steps: long enough to interrupt after a checkpoint or two, with every RNG in play.
TRAIN = [
    "trainer.max_steps=300",
    "trainer.eval_every=100",
    "trainer.checkpoint_every=25",
    "model.dropout=0.1",
]
RANKS = {1: [], 2: ["hardware=ddp", "hardware.num_processes=2"]}


def run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        runner_command(run_dir, *overrides), env=cli_env(), capture_output=True, text=True, timeout=300
    )


def refused(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`run` for a command that ends before it starts anything: forked (`rank_checks.command`, 0.3 s)."""
    return rank_checks.command(runner_command(run_dir, *overrides), Path.cwd(), env=cli_env())


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        runner_command(run_dir, *overrides), env=cli_env(), stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, tuple[Path, float]]:
    """The uninterrupted runs on 1 and 2 ranks: their dirs and the wall time of their commands."""
    made = {}
    cli_env()  # made once (it may start a server): not part of the commands' time
    for ranks, overrides in RANKS.items():
        run_dir = tmp_path_factory.mktemp(f"reference{ranks}")
        began = time.time()
        proc = run(run_dir, *TRAIN, *overrides)
        made[ranks] = (run_dir, time.time() - began)
        assert proc.returncode == 0, proc.stderr
    return made


@pytest.fixture(scope="module")
def uninterrupted(references) -> dict[int, bytes]:
    return {
        ranks: (run_dir / "model" / "model.safetensors").read_bytes()
        for ranks, (run_dir, _) in references.items()
    }


# What no ledger record can see: torch's own teardown after the command's last exit handler (~0.1 s on an
# idle machine; 0.8 s once in a CI run of the whole suite, for 2 ranks restarted in the job).
TEARDOWN_S = 1.0


def spent(run_dir: Path) -> dict:
    """The run's goodput.json, checked against its ledger: the phases add up to its wall time."""
    summary = json.loads((run_dir / "goodput.json").read_text())
    assert sum(summary["phases_s"].values()) == pytest.approx(summary["wall_s"], rel=1e-6)
    assert summary == summarize(read_ledger(run_dir))
    return summary


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_goodput_ledger_of_an_undisturbed_run_accounts_for_its_wall_time(references, ranks):
    run_dir, measured = references[ranks]
    summary = spent(run_dir)
    assert measured - TEARDOWN_S - 0.02 * measured <= summary["wall_s"] <= measured
    phases = summary["phases_s"]
    assert {
        "startup",
        "rendezvous",
        "data",
        "setup",
        "warmup",
        "train",
        "checkpoint",
        "eval",
        "finish",
    } <= set(phases)
    assert not {"lost", "restart", "stopped", "queued", "other"} & set(phases)
    assert (summary["attempts"], summary["restarts"], summary["lost_steps"]) == (1, 0, 0)
    assert summary["goodput"] == phases["train"] / summary["wall_s"]
    said = (run_dir / "runner.log").read_text()
    # The console's table, made as the job ended (goodput.json adds the command's last moments).
    assert re.search(
        rf"time spent \({run_dir / 'goodput.json'}\):\ngoodput [\d.]+% of [\d.]+ s\n  train ", said
    )
    history = [row for row in read_history(run_dir) if "goodput/goodput" in row]  # the tracker's too
    assert len(history) == 1 and history[0]["step"] == 300 and 0 < history[0]["goodput/goodput"] < 1


@pytest.mark.parametrize(
    ("ranks", "stop"),
    [
        (2, signal.SIGTERM),  # (1 process: test_async_checkpoint's stop signal)
        (1, signal.SIGUSR1),
        (2, signal.SIGUSR2),
        (1, signal.SIGINT),  # Ctrl-C: the same, not a KeyboardInterrupt traceback (2 ranks: the test below)
    ],
)
def test_a_stop_signal_checkpoints_exits_75_and_a_rerun_finishes_identically(
    tmp_path, uninterrupted, ranks, stop
):
    proc = start(tmp_path, *TRAIN, *RANKS[ranks])
    wait_for_checkpoint(tmp_path, proc)
    os.kill(proc.pid, stop)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    assert "Training interrupted" in stderr and "Traceback" not in stderr
    assert f"Run the same command with hydra.run.dir={tmp_path} to resume." in stderr  # the line to paste
    rerun = run(tmp_path, *TRAIN, *RANKS[ranks])
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed from" in (tmp_path / "runner.log").read_text()
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == uninterrupted[ranks]


def test_a_ctrl_c_in_a_terminal_counts_once_in_every_rank(tmp_path):
    """A terminal's Ctrl-C reaches the launcher and every rank (one process group). Sent here to the ranks
    first and to the launcher a moment later (the worst case of that race), it still checkpoints: the
    launcher must not pass on a second SIGINT, which a rank takes as "stop at once"."""
    proc = start(tmp_path, "trainer.max_steps=1000", "trainer.log_every=100", *RANKS[2])
    for line in proc.stderr:  # type: ignore[union-attr]
        if line.startswith("step 100/"):  # the next logging step, where a stop checkpoints, is 100 steps away
            break
    for rank in subprocess.check_output(["pgrep", "-P", str(proc.pid)], text=True).split():
        os.kill(int(rank), signal.SIGINT)
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    message = stderr.strip().splitlines()[-1]
    # The launcher's words or, when the ranks stopped before its SIGINT came, theirs: Ctrl-C either way.
    assert message.startswith("Training interrupted: stopped by Ctrl-C") and "; checkpoint " in message, (
        stderr
    )
    assert (tmp_path / "checkpoints" / "checkpoint_0").is_dir()


def test_a_run_resumed_from_a_resumed_runs_checkpoint_finishes_identically(tmp_path):
    """A resumed run's loader skips the batches done in its first epoch; a checkpoint it writes in that
    epoch holds the pass's position (the skipped batches included), so a run resumed from it (a job
    requeued twice) goes on right."""
    every = [
        "trainer.max_steps=30",
        "trainer.checkpoint_every=2",
        "trainer.keep_checkpoints=null",
        "model.dropout=0.1",
    ]
    first = run(tmp_path / "first", *every)
    assert first.returncode == 0, first.stderr
    second = run(
        tmp_path / "second", *every, f"trainer.resume={tmp_path / 'first' / 'checkpoints' / 'checkpoint_1'}"
    )
    assert second.returncode == 0, second.stderr
    # Written at step 8 by the run that resumed at step 4, in the same epoch.
    third = run(
        tmp_path / "third", *every, f"trainer.resume={tmp_path / 'second' / 'checkpoints' / 'checkpoint_3'}"
    )
    assert third.returncode == 0, third.stderr
    assert "at step 8 (epoch 0, batch 8)" in (tmp_path / "third" / "runner.log").read_text()
    final = (tmp_path / "third" / "model" / "model.safetensors").read_bytes()
    assert final == (tmp_path / "first" / "model" / "model.safetensors").read_bytes()


def test_a_checkpoint_an_earlier_commit_wrote_resumes_mid_epoch_to_its_stored_curve(
    tmp_path, references, uninterrupted
):
    """The 1-rank reference's checkpoint at step 275 (epoch 4, batch 43: the loaders' positions, every RNG,
    the scheduler), kept in tests/assets: today's code resumes it and logs the losses the run that wrote
    it logged, and ends with today's uninterrupted weights."""
    asset = stored.checkpoint("trainer-mlp-dropout-step275")
    if asset is None:
        written = references[1][0] / "checkpoints" / "checkpoint_10"
        assert json.loads((written / "meta.json").read_text())["step"] == 275
        stored.store_checkpoint("trainer-mlp-dropout-step275", written)
        rows = read_history(references[1][0])
    else:
        copy = shutil.copytree(asset, tmp_path / "stored")
        resumed = run(tmp_path / "run", *TRAIN, f"trainer.resume={copy}")
        assert resumed.returncode == 0, resumed.stderr
        assert "at step 275 (epoch 4, batch 43)" in (tmp_path / "run" / "runner.log").read_text()
        # To float rounding: the asset was written on another CPU, whose kernels may round otherwise (a
        # machine with AVX-512 ends 4e-7 away from one without); on one machine resuming is exact (above).
        resumed_weights = load((tmp_path / "run" / "model" / "model.safetensors").read_bytes())
        for name, tensor in load(uninterrupted[1]).items():
            torch.testing.assert_close(resumed_weights[name], tensor, rtol=1e-5, atol=1e-6)
        rows = read_history(tmp_path / "run")
    losses = [row[name] for row in rows if row["step"] > 275 for name in ("train/loss", "eval/loss") if name in row]
    assert len(losses) == 4  # steps 280, 290, 300 and the evaluation at 300
    stored.curve("trainer-mlp-dropout-resumed-at-275", losses, 1e-5)


def test_a_checkpoint_records_the_optimizer_step_with_accumulation_and_across_epochs(tmp_path):
    """With 4 micro-batches a step (15 optimizer steps an epoch), each checkpoint records the optimizer step it
    was written at, the step `trainer.max_steps` counts (not the micro-batches, which the engine counts from 0
    again each epoch): the check against a shorter run uses it, and a run resumed in the second epoch goes on
    with its accumulation where it was and ends as the uninterrupted run."""
    every = [
        "trainer.gradient_accumulation_steps=4",
        "trainer.checkpoint_every=10",
        "trainer.keep_checkpoints=null",
    ]
    whole = tmp_path / "whole"
    first = run(whole, *every, "trainer.max_steps=30")
    assert first.returncode == 0, first.stderr
    checkpoints = [whole / "checkpoints" / f"checkpoint_{i}" for i in range(3)]
    assert [json.loads((c / "meta.json").read_text())["step"] for c in checkpoints] == [10, 20, 30]
    shorter = refused(tmp_path / "shorter", *every, "trainer.max_steps=15", f"trainer.resume={checkpoints[0]}", "plan=true")
    assert shorter.returncode == 0, shorter.stderr
    past = refused(tmp_path / "past", *every, "trainer.max_steps=25", f"trainer.resume={checkpoints[2]}")
    assert past.returncode == 2 and "was written at step 30, past it" in past.stderr, past.stderr
    resumed = run(tmp_path / "resumed", *every, "trainer.max_steps=30", f"trainer.resume={checkpoints[1]}")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 20 (epoch 1, batch 20)" in (tmp_path / "resumed" / "runner.log").read_text()
    final = (tmp_path / "resumed" / "model" / "model.safetensors").read_bytes()
    assert final == (whole / "model" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("ranks", [1, 2])
def test_kill_9_after_a_checkpoint_then_rerun_finishes_identically(tmp_path, uninterrupted, ranks):
    proc = start(tmp_path, *TRAIN, *RANKS[ranks], "tracker=mlflow")
    wait_for_checkpoint(tmp_path, proc)
    if ranks == 1:
        os.kill(proc.pid, signal.SIGKILL)
    else:  # kill a rank: the job fails, and its dir keeps the last complete checkpoint
        rank = int(subprocess.check_output(["pgrep", "-P", str(proc.pid), "-n"], text=True).split()[0])
        os.kill(rank, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    killed = read_ledger(tmp_path)  # what the killed run recorded, on disk
    rerun = run(tmp_path, *TRAIN, *RANKS[ranks], "tracker=mlflow")
    assert rerun.returncode == 0, rerun.stderr
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == uninterrupted[ranks]
    # The rerun continued the killed run's ledger: two attempts, the steps past its checkpoint lost.
    records = read_ledger(tmp_path)
    assert records[: len(killed)] == killed and len(records) > len(killed)
    summary = spent(tmp_path)
    resumed_at = next(r["resumed_at"] for r in records[len(killed) :] if "resumed_at" in r)
    trained = max((r["step"] for r in killed if r["phase"] in ("warmup", "train")), default=0)
    assert summary["attempts"] == 2 and summary["lost_steps"] == max(0, trained - resumed_at)
    assert summary["phases_s"]["stopped"] > 0  # from the kill to the rerun's start
    # The steps after the checkpoint, logged by the killed run and again by the rerun, are in its MLflow
    # run once (in the store when the rerun exits).
    assert_each_step_logged_once(tmp_path, "train/loss", list(range(10, 301, 10)))
    # Each window's samples per second times its seconds per step is its samples per step (64 a rank; an
    # epoch's last batch is 38): the rerun counts its first window's steps from the step it resumed at.
    # With 2 ranks both are means over the ranks, whose windows are offset by how late each reaches the log
    # step: mean(1/t) * mean(t) >= 1, by 2% for windows 1.33x apart (seen under a loaded CI).
    windows = [row for row in read_history(tmp_path) if "perf/samples_per_s" in row]
    upper = 64.5 if ranks == 1 else 64 * 1.25
    assert windows and all(
        50 <= row["perf/samples_per_s"] * row["perf/step_time_s"] <= upper for row in windows
    ), windows


def test_a_rank_killed_mid_run_is_restarted_in_the_job_and_finishes_identically(tmp_path, uninterrupted):
    """launcher.restarts=1: rank 1 killed (-9) after a checkpoint, the rank group starts again in the
    same job, resumes from the latest checkpoint and ends bitwise as the uninterrupted run."""
    cli_env()
    began = time.time()
    proc = start(tmp_path, *TRAIN, *RANKS[2], "launcher.restarts=1")
    wait_for_checkpoint(tmp_path, proc)
    rank = int(subprocess.check_output(["pgrep", "-P", str(proc.pid), "-n"], text=True).split()[0])
    os.kill(rank, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    measured = time.time() - began
    assert proc.returncode == 0, stderr
    assert (
        "was killed by SIGKILL: restart 1 of 1, the ranks resume from the run's latest checkpoint" in stderr
    )
    assert "resumed from" in stderr
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == uninterrupted[2]
    # The ledger: one restart, and the steps the first attempt trained past the checkpoint resumed from lost.
    summary = spent(tmp_path)
    records = read_ledger(tmp_path)
    resumed_at = [r["resumed_at"] for r in records if "resumed_at" in r]
    assert resumed_at[0] == 0 and resumed_at[1] > 0
    trained = max(
        r["step"]
        for r in records[: records.index(next(r for r in records if r.get("before") == "restart"))]
        if r["phase"] == "train"
    )
    assert (summary["attempts"], summary["restarts"]) == (2, 1)
    assert summary["lost_steps"] == trained - resumed_at[1] and summary["phases_s"]["restart"] > 0
    assert measured - TEARDOWN_S - 0.02 * measured <= summary["wall_s"] <= measured
    assert f"1 restart(s), {trained - resumed_at[1]} step(s) lost" in stderr


def assert_each_step_logged_once(run_dir: Path, metric: str, steps: list[int]) -> None:
    from mlflow import MlflowClient

    run_id = json.loads((run_dir / "tracking" / "delivered.json").read_text())["run_id"]
    history = MlflowClient(cli_env()["MLFLOW_TRACKING_URI"]).get_metric_history(run_id, metric)
    assert sorted(m.step for m in history) == steps


def test_a_checkpoint_that_does_not_fit_is_refused_before_training(tmp_path):
    """Each misfit is refused by the checks before launch (run in this process: the CLI runs them first),
    naming it; through `python -m runner` as one paragraph with exit status 2, before the job's dir is
    touched."""
    first = run(
        tmp_path,
        "trainer.max_steps=20",
        "trainer.checkpoint_every=10",
        "model.hidden_size=64",
        "tracker=none",
    )
    assert first.returncode == 0, first.stderr
    # Its dir as a run killed right after its checkpoint of step 20 leaves it: not finished (a finished
    # run's dir refuses other settings before any checkpoint is looked at).
    (tmp_path / "finished.json").unlink()
    (tmp_path / "metrics.json").unlink()
    checkpoint = tmp_path / "checkpoints" / "checkpoint_1"
    cases = {
        ("model.hidden_size=128",): "holds the state of another model than this run's MLP (another shape: "
        "net.0.weight (64, 16) there, (128, 16) here;",
        # DDP loads a whole-model checkpoint on any number of ranks, but each rank's data position changes.
        ("hardware=ddp", "hardware.num_processes=2"): "was written by 1 data-parallel rank(s) and this run has 2",
        (f"trainer.resume={tmp_path / 'missing'}",): "no such directory",
        (
            "optimizer=sgd",
        ): "holds the state of optimizer(s) torch.optim.adamw.AdamW and this run has torch.optim.sgd.SGD",
        (f"trainer.resume={tmp_path / 'model'}",): "not a checkpoint",
        ("data.batch_size=32",): "read other data (data.batch_size=64 there, 32 here)",
        ("data.num_samples=1000",): "read other data (data.num_samples=4096 there, 1000 here)",
        ("trainer.max_steps=15",): "trainer.max_steps=15: "
        + str(checkpoint)
        + " was written at step 20, past it",
    }
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for overrides, expected in cases.items():
            cfg = compose(
                "config",
                overrides=["trainer.max_steps=30", "model.hidden_size=64", "tracker=none", *overrides],
            )
            with pytest.raises(ConfigError) as error:
                checks_before_launch(cfg, tmp_path, env=None)
            assert expected in str(error.value), str(error.value)
    # Through the CLI (DeepSpeed's strategy built in a process of its own): the job's .hydra/ (written at
    # launch) is untouched.
    launched = (tmp_path / ".hydra" / "config.yaml").stat().st_mtime_ns
    cli_cases = {
        ("model.hidden_size=128",): "holds the state of another model",
        ("optimizer=sgd",): "holds the state of optimizer(s)",
        ("trainer.max_steps=15",): "was written at step 20, past it",
        (
            "hardware=deepspeed",
            "hardware.num_processes=1",
        ): "holds 'full' model state and this run's hardware reads 'deepspeed'",
    }
    for overrides, expected in cli_cases.items():
        proc = refused(tmp_path, "trainer.max_steps=30", "model.hidden_size=64", "tracker=none", *overrides)
        message = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2, proc.stderr
        assert message.startswith("Configuration error: ") and expected in message, message
        assert "starting 2 ranks" not in proc.stderr and "step 30" not in proc.stderr
    assert (tmp_path / ".hydra" / "config.yaml").stat().st_mtime_ns == launched
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == checkpoint.name  # nothing was lost


def wait_for_checkpoints(run_dir: Path, proc: subprocess.Popen, count: int) -> None:
    while len(list((run_dir / "checkpoints").glob("checkpoint_*"))) < count:
        assert proc.poll() is None, "the run ended before writing its checkpoints"
        wait_for_checkpoint(run_dir, proc)


def test_a_damaged_latest_is_moved_aside_and_auto_resumes_from_the_one_before(tmp_path, uninterrupted):
    """A checkpoint cut short after it was written (a bad copy, a full disk) is never read as if whole."""
    proc = start(tmp_path, *TRAIN)
    wait_for_checkpoints(tmp_path, proc, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75
    latest = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
    weights = latest / "model_0.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    rerun = run(tmp_path, *TRAIN)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{latest} cannot be resumed (model_0.safetensors has" in rerun.stderr
    assert latest.with_name(latest.name + ".damaged").is_dir() and not latest.exists()  # kept, aside
    log = (tmp_path / "runner.log").read_text()
    assert "resumed from" in log and f"resumed from {latest}" not in log
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == uninterrupted[1]


def test_damaged_checkpoints_and_weights_are_refused_before_launch(tmp_path):
    first = run(tmp_path, "trainer.max_steps=20", "trainer.checkpoint_every=10")
    assert first.returncode == 0, first.stderr
    checkpoints = tmp_path / "checkpoints"
    flipped, cut, bad_meta = (checkpoints / "flipped"), (checkpoints / "cut"), (checkpoints / "bad_meta")
    for copy in (flipped, cut, bad_meta):
        shutil.copytree(checkpoints / "checkpoint_1", copy)
    data = bytearray((flipped / "model_0.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one bit pattern of one weight: same size, other content
    (flipped / "model_0.safetensors").write_bytes(bytes(data))
    os.truncate(cut / "optimizer_0.pt", 100)
    (bad_meta / "meta.json").write_text('{"num_processes": 1, "step"')
    half = tmp_path / "half.safetensors"
    half.write_bytes((tmp_path / "model" / "model.safetensors").read_bytes()[:3000])
    cases = {
        f"trainer.resume={flipped}": "model_0.safetensors does not have the content that was written",
        f"trainer.resume={cut}": "optimizer_0.pt has 100 bytes",
        f"trainer.resume={bad_meta}": "its meta.json is damaged",
        f"checkpoint={half}": f"{half} is not a whole safetensors file",
    }
    for override, expected in cases.items():
        run_dir = tmp_path / "refused"
        proc = refused(run_dir, "trainer.max_steps=30", override)
        message = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2, proc.stderr
        assert message.startswith("Configuration error: ") and expected in message, message
        assert "Traceback" not in proc.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == ["runner.log"], override  # nothing else written
        shutil.rmtree(run_dir)


@pytest.mark.parametrize(
    ("ranks", "stop", "code"),
    [
        (1, signal.SIGINT, 130),  # as the shell reports a Ctrl-C; 75 says "resume"
        (2, signal.SIGINT, 130),
        (1, signal.SIGTERM, 143),  # not a silent 143: the same message
    ],
)
def test_an_interrupt_before_any_checkpoint_does_not_promise_a_resume(tmp_path, ranks, stop, code):
    marker = tmp_path / "loading"
    env = cli_env(Path(__file__).parent) | {"SLOW_DATA_MARKER": str(marker)}
    command = runner_command(tmp_path / "run", "data._target_=faulty_tasks.SlowToLoad", *RANKS[ranks])
    proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the data never started loading"
        time.sleep(0.05)
    proc.send_signal(stop)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("Training interrupted: stopped by "), stderr
    assert "before any checkpoint was written: there is nothing to resume from" in message
    assert "Traceback" not in stderr


def test_a_second_run_into_a_busy_dir_is_refused_and_a_dead_runs_dir_is_free(tmp_path):
    """The first run reads with loader workers: forked, they share its lock on the dir, and one busy on a
    sample when the run is killed lives on until it is done (an idle one looks for its parent every 5 s).
    Here they stop at a sample after the first checkpoint until the rerun says it waits for them: the
    rerun waits for them instead of refusing the dir as busy, then runs."""
    hold = tmp_path.parent / f"{tmp_path.name}.hold"
    hold.touch()
    command = runner_command(
        tmp_path,
        "trainer.max_steps=100000",
        "trainer.checkpoint_every=50",
        "+data.num_workers=2",
        "data._target_=faulty_tasks.HeldOnceMarked",
    )
    marker = tmp_path / "checkpoints" / "latest"
    env = cli_env(Path(__file__).parent) | {
        "SLOW_SAMPLES_MARKER": str(marker),
        "SLOW_SAMPLES_HOLD": str(hold),
    }
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_checkpoint(tmp_path, first)
        recorded = (tmp_path / ".hydra" / "overrides.yaml").read_text()
        second = refused(tmp_path, "trainer.max_steps=20", "optimizer.lr=0.5")
        message = second.stderr.strip().splitlines()[-1]
        assert second.returncode == 2, second.stderr
        assert message.startswith(
            f"Configuration error: hydra.run.dir={tmp_path} is in use by another run (pid "
        )
        assert f"(pid {first.pid})" in message and "Traceback" not in second.stderr
        assert (
            tmp_path / ".hydra" / "overrides.yaml"
        ).read_text() == recorded  # nothing of the first was touched
        first.kill()  # kill -9: no cleanup ran, yet nothing stale is left behind
        first.wait(timeout=60)
        # its checkpoints are past 20 steps: a run of 20 starts over (resuming them would train nothing)
        third = subprocess.Popen(
            runner_command(tmp_path, "trainer.max_steps=20", "trainer.resume=null"),
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        said = []
        for line in third.stderr:  # to the end, should it not wait
            said.append(line)
            if "hydra.run.dir" in line and "is gone; waiting" in line:  # its pid where /proc/locks has it
                break
        hold.unlink()  # the workers go on, see their parent gone and exit
        said.append(third.communicate(timeout=300)[1])
        assert third.returncode == 0 and "is gone; waiting" in said[-2], "".join(said)
    finally:
        hold.unlink(missing_ok=True)
        first.kill()


def test_runs_started_in_the_same_second_each_get_their_own_run_dir(tmp_path):
    """A time-stamped run dir (the default's `${now:...}`) names a new run: those that runs started in the
    same second (here: year) have, `<dir>` and `<dir>_1`, are left alone, and the new run takes `<dir>_2`."""
    year = time.strftime("%Y")
    for taken in (tmp_path / year, tmp_path / f"{year}_1"):
        taken.mkdir()
        (taken / "runner.log").write_text("another run's log\n")
    proc = refused(tmp_path / "${now:%Y}", "trainer.max_steps=-5")  # refused once its checks began
    assert "trainer.max_steps=-5: must be >= 1" in proc.stderr, proc.stderr
    assert "trainer.max_steps=-5" in (tmp_path / f"{year}_2" / "runner.log").read_text()
    for taken in (tmp_path / year, tmp_path / f"{year}_1"):
        assert [p.name for p in taken.iterdir()] == ["runner.log"]
        assert (taken / "runner.log").read_text() == "another run's log\n"
    # a command that Hydra runs its own way (`--config-path`) claims its dir too
    own_way = refused(tmp_path / "${now:%Y}", "--config-path", str(CONF_DIR), "trainer.max_steps=-5")
    assert "trainer.max_steps=-5: must be >= 1" in own_way.stderr, own_way.stderr
    assert "trainer.max_steps=-5" in (tmp_path / f"{year}_3" / "runner.log").read_text()


# Takes the lock on argv[1], forks a child that keeps it for argv[2] s, prints the child's pid and exits.
HOLD_THEN_EXIT = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
child = os.fork()
if child:
    print(child, flush=True)
    os._exit(0)
for stream in (1, 2):  # let go of the output pipes: the caller reads them to their end
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream)
time.sleep(float(sys.argv[2]))
"""


def test_a_dir_held_by_what_a_dead_run_left_is_waited_for_then_refused_naming_the_holders(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(dir_lock, "LEFTOVER_WAIT_S", 1.0)

    def left_holding(seconds: float) -> int:
        command = [sys.executable, "-c", HOLD_THEN_EXIT, str(tmp_path), str(seconds)]
        return int(subprocess.run(command, capture_output=True, text=True, check=True).stdout)

    child = left_holding(60)
    try:
        with (
            pytest.raises(
                ConfigError, match=rf"still held, 1 s on, .* pid {child}\). Stop them \(kill {child}\)"
            ),
            dir_lock.run_dir_lock(tmp_path),
        ):
            pass
    finally:
        os.kill(child, signal.SIGKILL)
    monkeypatch.setattr(dir_lock, "LEFTOVER_WAIT_S", 10.0)
    child = left_holding(1.5)  # gone within the wait (and not before it began): the dir is this run's
    with caplog.at_level("INFO", logger="runner.run_dir.lock"), dir_lock.run_dir_lock(tmp_path):
        pass
    assert (
        f"is gone; waiting up to 10 s for the processes it started that still hold it to exit (pid {child})"
        in (caplog.text)
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a small tmpfs in a mount namespace needs root",
)
@pytest.mark.parametrize(
    ("ranks", "size"),
    [
        (1, "700k"),  # the model (800 KB) does not fit: safetensors names the OS error
        (2, "700k"),
        (1, "1500k"),  # the model fits, the optimizer does not: torch.save says only "unexpected pos"
        (1, "4k"),  # not even the job's config and log fit
    ],
)
def test_a_full_disk_stops_the_run_in_one_paragraph_and_leaves_no_partial_checkpoint(tmp_path, ranks, size):
    """The run dir is on a small file system: the first checkpoint cannot fit."""
    mount = tmp_path / "small"
    mount.mkdir()
    command = shlex.join(runner_command(mount / "run", "trainer.checkpoint_every=50", *RANKS[ranks]))
    script = f"mount -t tmpfs -o size={size} tmpfs {mount} && {command}; code=$?; ls -A {mount}/run/checkpoints; exit $code"
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], env=cli_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr
    stopped = [line for line in proc.stderr.splitlines() if line.startswith("Training stopped: ")]
    assert stopped, proc.stderr
    assert stopped[0].startswith(
        f"Training stopped: the run could not write to {mount / 'run'}: the disk is full"
    )
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr
    assert proc.stdout.strip() == ""  # checkpoints/ holds nothing: the partial one was removed


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a read-only bind mount in a mount namespace needs root",
)
def test_a_read_only_run_dir_is_refused_in_one_paragraph(tmp_path):
    """Root ignores file permissions: a read-only file system is what stops it writing."""
    locked = tmp_path / "locked"
    locked.mkdir()
    command = shlex.join(runner_command(locked / "run", "trainer.max_steps=5"))
    script = f"mount --bind -o ro {locked} {locked} && {command}"
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], env=cli_env(), capture_output=True, text=True, timeout=300
    )
    message = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr
    assert message.startswith(f"Configuration error: the run's dir cannot be made at {locked / 'run'}")
    assert "Read-only file system" in message and "Traceback" not in proc.stderr


def test_evaluating_more_often_does_not_change_training(tmp_path):
    """Starting an evaluation draws nothing from torch's global RNG: dropout masks stay the same."""
    weights = []
    for eval_every in (0, 4):
        run_dir = tmp_path / f"eval{eval_every}"
        proc = run(run_dir, "trainer.max_steps=12", f"trainer.eval_every={eval_every}", "model.dropout=0.1")
        assert proc.returncode == 0, proc.stderr
        weights.append((run_dir / "model" / "model.safetensors").read_bytes())
    assert weights[0] == weights[1]


def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks_with_a_global_batch(tmp_path):
    fsdp = [
        "hardware=fsdp",
        "hardware.device=cpu",
        "tracker=none",
        "trainer.eval_every=0",
        "trainer.log_every=10",
    ]
    steps = ["trainer.max_steps=30", "trainer.checkpoint_every=10"]
    whole = run(tmp_path / "whole", *fsdp, *steps, "hardware.num_processes=2", "trainer.split_batches=true")
    assert whole.returncode == 0, whole.stderr
    checkpoint = tmp_path / "whole" / "checkpoints" / "checkpoint_1"  # after step 20
    resumed = run(
        tmp_path / "resumed", *fsdp, *steps, "hardware.num_processes=1", "trainer.split_batches=true",
        f"trainer.resume={checkpoint}",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "at step 20" in resumed.stderr
    ours, theirs = metrics_of(resumed), metrics_of(whole)
    assert abs(ours["train/loss"] - theirs["train/loss"]) <= 1e-5, (ours, theirs)
    # With a batch size per rank, the global batch (and so the data position) would change: refused.
    proc = refused(
        tmp_path / "refused", *fsdp, *steps, "hardware.num_processes=1", f"trainer.resume={checkpoint}"
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs trainer.split_batches=true" in proc.stderr and "starting" not in proc.stderr


def results_of(metrics_file: Path) -> dict[str, float]:
    """The final metrics but the `perf/*` measurements (which differ from run to run)."""
    return {k: v for k, v in json.loads(metrics_file.read_text()).items() if not k.startswith("perf/")}


def test_a_finished_runs_results_are_replaced_only_by_a_run_that_continues_it(tmp_path):
    """Run again into a finished run's dir: the same settings train nothing; other settings are refused
    before anything runs (its files untouched), unless trainer.overwrite=true, which moves them into
    replaced-<time>/ first."""
    quick = ["tracker=none", "trainer.max_steps=20", "trainer.eval_every=0"]
    first = run(tmp_path, *quick)
    assert first.returncode == 0, first.stderr
    results = {name: (tmp_path / name).read_bytes() for name in ("metrics.json", "model/model.safetensors")}
    first_metrics = tmp_path.parent / "first_metrics.json"
    first_metrics.write_bytes(results["metrics.json"])
    changed = refused(tmp_path, *quick, "optimizer.lr=0.01")
    assert changed.returncode == 2, changed.stderr
    assert (
        "holds a run that finished" in changed.stderr
        and "optimizer.lr=0.001 there, 0.01 here" in changed.stderr
    )
    assert "trainer.overwrite=true" in changed.stderr and "Traceback" not in changed.stderr
    assert {name: (tmp_path / name).read_bytes() for name in results} == results
    # another hardware option: its class first, then the values both have, then those only one has
    other = refused(tmp_path, *quick, "hardware=ddp", "hardware.num_processes=2", "optimizer.lr=0.01")
    listed = other.stderr.split("holds a run that finished", 1)[1]
    assert (
        "(hardware._target_=runner.hardware.single_device.SingleDevice there, runner.hardware.ddp.DDP here; hardware.device=cpu "
        "there, None here; optimizer.lr=0.001 there, 0.01 here; hardware.backend=<unset> there, None here;" in listed
    ), listed
    same = run(tmp_path, *quick, "trainer.progress_bar=false")  # not a setting of the results
    assert same.returncode == 0, same.stderr
    assert "nothing to train" in same.stderr
    assert {name: (tmp_path / name).read_bytes() for name in results} == results
    replaced = run(tmp_path, *quick, "optimizer.lr=0.01", "trainer.overwrite=true")
    assert replaced.returncode == 0, replaced.stderr
    (aside,) = tmp_path.glob("replaced-*")
    assert (aside / "model" / "model.safetensors").read_bytes() == results["model/model.safetensors"]
    assert results_of(aside / "metrics.json") == results_of(first_metrics)
    assert results_of(tmp_path / "metrics.json") != results_of(first_metrics)


def test_a_run_interrupted_resumed_and_finished_is_never_rewound(tmp_path):
    """Stopped at a logging step (checkpoint written), resumed to its end without a final checkpoint
    (trainer.checkpoint_every=0), the run records that it finished: the same command again trains
    nothing and exits 0, a changed setting is refused naming it (the old checkpoint never resumes), the
    finished results stay byte-identical, and the MLflow run holds each logged step once."""
    steps = ["trainer.max_steps=300", "trainer.log_every=10", "trainer.eval_every=0", "tracker=mlflow"]
    proc = start(tmp_path, *steps)
    for line in proc.stderr:  # type: ignore[union-attr]
        if line.startswith("step 100/"):
            break
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    finished = run(tmp_path, *steps)
    assert finished.returncode == 0, finished.stderr
    results = {name: (tmp_path / name).read_bytes() for name in ("metrics.json", "model/model.safetensors")}
    record = json.loads((tmp_path / "finished.json").read_text())
    assert record["step"] == 300 and len(record["settings_digest"]) == 64
    log_before = (tmp_path / "runner.log").read_text()

    again = run(tmp_path, *steps, "trainer.progress_bar=false")
    assert again.returncode == 0, again.stderr
    assert "finished at step 300" in again.stderr and "nothing to train" in again.stderr
    assert "final metrics" in again.stderr and "resumed from" not in again.stderr
    assert "resumed from" not in (tmp_path / "runner.log").read_text()[len(log_before) :]

    changed = refused(tmp_path, *steps, "optimizer.lr=0.01")
    assert changed.returncode == 2, changed.stderr
    assert (
        "finished at step 300" in changed.stderr and "optimizer.lr=0.001 there, 0.01 here" in changed.stderr
    )
    assert "trainer.overwrite=true" in changed.stderr and "Traceback" not in changed.stderr
    # Longer: its only checkpoint (step 110) is older than its end, so it cannot be continued in place.
    longer = refused(tmp_path, "trainer.max_steps=400", *steps[1:])
    assert longer.returncode == 2, longer.stderr
    assert (
        "trainer.max_steps=300 there, 400 here" in longer.stderr and "is older than its end" in longer.stderr
    )
    assert {name: (tmp_path / name).read_bytes() for name in results} == results

    assert_each_step_logged_once(tmp_path, "train/loss", list(range(10, 301, 10)))


def test_resume_last_continues_the_newest_run_of_the_same_experiment_in_its_dir(tmp_path):
    """`trainer.resume=last` finds the newest run of the same experiment in outputs/runs and continues it
    there (here, a finished run trained longer from its checkpoint of its last step)."""

    def runner(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "runner", "trainer.progress_bar=false", "trainer.plots=false", "tracker=none", *overrides],
            cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    first = runner("trainer.max_steps=20", "trainer.checkpoint_every=10")
    assert first.returncode == 0, first.stderr
    (run_dir,) = (tmp_path / "outputs" / "runs").iterdir()
    results = {name: (run_dir / name).read_bytes() for name in ("metrics.json", "model/model.safetensors")}
    longer = runner("trainer.max_steps=30", "trainer.checkpoint_every=10", "trainer.resume=last")
    assert longer.returncode == 0, longer.stderr
    assert f"trainer.resume=last: resuming outputs/runs/{run_dir.name}" in longer.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'checkpoint_1'} at step 20" in longer.stderr
    assert json.loads((run_dir / "finished.json").read_text())["step"] == 30
    # The shorter run's results are kept, moved aside and named on the console with the schedule's change.
    (aside,) = run_dir.glob("replaced-*")
    assert {name: (aside / name).read_bytes() for name in results} == results
    assert json.loads((aside / "finished.json").read_text())["step"] == 20
    assert f"its results (metrics.json, model/, finished.json) moved to {aside}" in longer.stderr
    assert "the learning-rate schedule is recomputed for 30 steps" in longer.stderr
    assert len(list((tmp_path / "outputs" / "runs").iterdir())) == 1  # no new run dir
    other = runner("experiment=gpt_sonnets", "trainer.resume=last")
    assert other.returncode == 2 and "holds no run of experiment=gpt_sonnets to resume" in other.stderr


def _run_dir(runs: Path, name: str, written: float, checkpoint_written: float | None = None) -> Path:
    """A run dir of the default experiment whose log was last written at `written` (and, given, whose
    latest checkpoint at `checkpoint_written`)."""
    run = runs / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- trainer.max_steps=20\n")
    (run / "runner.log").write_text("...\n")
    os.utime(run / "runner.log", (written, written))
    if checkpoint_written is not None:
        meta = run / "checkpoints" / "checkpoint_0" / "meta.json"
        meta.parent.mkdir(parents=True)
        meta.write_text("{}")
        os.utime(meta, (checkpoint_written, checkpoint_written))
    return run


def test_resume_last_takes_the_run_written_last_not_the_last_name_and_refuses_a_tie(tmp_path, monkeypatch, capsys):
    """`trainer.resume=last` goes by when a run last wrote (its log, its newest checkpoint), not by its dir's
    name: a dir named `baseline` sorts after every dated one. It names the run it chose and why; two runs last
    written at the same moment are refused, naming both."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "outputs" / "runs"
    now = time.time()
    _run_dir(runs, "baseline", now - 3600, checkpoint_written=now - 3700)
    _run_dir(runs, "2026-12-01_10-00-00", now - 60)  # the newest: its log
    _run_dir(runs, "2026-11-30_10-00-00", now - 7200, checkpoint_written=now - 120)
    arguments = resume_last(["trainer.resume=last"])
    assert arguments[-1] == "hydra.run.dir=outputs/runs/2026-12-01_10-00-00"
    said = capsys.readouterr().err
    assert "trainer.resume=last: resuming outputs/runs/2026-12-01_10-00-00 (the run of the default experiment " in said
    assert "outputs/runs/2026-11-30_10-00-00" in said  # the next newest, named
    _run_dir(runs, "copy", now - 60)  # written at the same moment as the newest
    with pytest.raises(ConfigError, match=r"2026-12-01_10-00-00 and .*copy|copy and .*2026-12-01_10-00-00"):
        resume_last(["trainer.resume=last"])
