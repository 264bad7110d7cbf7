"""`trainer.on_nonfinite`: a step whose gradients are not finite stops the run as diverged (stop, the
default) or is left out and counted (skip), alike on every rank, until too many in a row stop it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import metrics_of
from safetensors.torch import load_file

TESTS = Path(__file__).parent
POISON = ("task._target_=faulty_tasks.NonFiniteAtSteps", "trainer.log_every=2")


def _states_by_step(checkpoints: Path) -> dict[int, tuple[dict, dict]]:
    """Each numbered checkpoint's (weights, optimizer state) by the step it was written at."""
    found = {}
    for directory in checkpoints.glob("checkpoint_*"):
        step = torch.load(directory / "custom_checkpoint_0.pt", weights_only=False)["step"]
        optimizer = torch.load(directory / "optimizer.bin", weights_only=False)["state"]
        found[step] = (load_file(directory / "model_0.safetensors"), optimizer)
    return found


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_with_nonfinite_gradients_on_one_rank_is_left_out_on_both_and_counted(run_cli):
    proc = run_cli(
        "hardware=ddp",
        "hardware.num_processes=2",
        *POISON,
        "+task.at=5",
        "+task.rank=1",
        "trainer.on_nonfinite=skip",
        "trainer.max_steps=8",
        "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=null",
        pythonpath=TESTS,
    )
    assert proc.returncode == 0, proc.stderr
    assert "step 5: the gradients were not finite; its optimizer step was left out (1 in a row, 1 in all)" in (
        proc.stderr
    )
    metrics = metrics_of(proc)
    assert metrics["train/skipped_steps"] == 1.0
    states = _states_by_step(proc.run_dir / "checkpoints")
    assert sorted(states) == list(range(1, 9))
    (weights4, adam4), (weights5, adam5), (weights6, adam6) = states[4], states[5], states[6]
    assert _same(weights4, weights5)  # step 5 changed nothing: not the weights,
    assert adam5[0]["step"] == adam4[0]["step"] == 4 and adam6[0]["step"] == 5  # nor Adam's count of steps
    assert not _same(weights5, weights6)  # step 6 trained on
    history = [json.loads(line) for line in (proc.run_dir / "history.jsonl").read_text().splitlines()]
    losses = [row["train/loss"] for row in history if "train/loss" in row]
    assert len(losses) == 4 and all(isinstance(v, float) for v in losses)  # step 5's NaN left out of its window
    assert [row["step"] for row in history if "train/skipped_steps" in row] == [5]
    ledger = [json.loads(line) for line in (proc.run_dir / "goodput.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger if r["phase"] == "skipped"] == [5]  # not productive time
    assert json.loads((proc.run_dir / "goodput.json").read_text())["phases_s"]["skipped"] > 0


def test_skipped_steps_in_a_row_stop_the_run_and_stop_is_the_default(run_cli, tmp_path):
    proc = run_cli(
        *POISON, "+task.at=3", "+task.until=100", "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=3",
        pythonpath=TESTS,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("Training stopped: the gradients of 3 optimizer steps in a row were NaN or infinite "
                              "(steps 3-5; trainer.on_nonfinite=skip left each out"), message  # fmt: skip
    assert "Traceback" not in proc.stderr and not (proc.run_dir / "metrics.json").exists()

    taken = run_cli(*POISON, "+task.at=3", f"hydra.run.dir={tmp_path / 'stop'}", pythonpath=TESTS)
    assert taken.returncode == 1, taken.stderr
    assert taken.stderr.strip().splitlines()[-1].startswith("Training stopped: train/loss=nan at step 4 ")


def test_skip_on_a_backend_that_takes_every_step_itself_is_refused_before_launch(forked_cli):
    proc = forked_cli("hardware=deepspeed", "trainer.on_nonfinite=skip")
    assert proc.returncode == 2, proc.stderr
    assert "trainer.on_nonfinite=skip: DeepSpeed takes every optimizer step itself" in proc.stderr
    assert "starting" not in proc.stderr
