"""`trainer.spike`: a step whose loss jumps past the robust z-score threshold is warned, counted and recorded
(`log`), or undone (`rollback`): back to the checkpoint before it, the batches since left out, alike on
every rank, and a resume of the rolled-back run ends bitwise where the run did."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import metrics_of
from safetensors.torch import load_file

from runner.telemetry.goodput import summarize

TESTS = Path(__file__).parent
# One training sample's target 1000x too large: the batch that holds it makes the loss spike (at step 38
# for this seed and order; the test reads the step from the record, not from here).
POISONED = (
    "data._target_=faulty_tasks.PoisonedRegression",
    "+data.poisoned=[100]",
    "trainer.max_steps=60",
    "trainer.log_every=5",
    "trainer.eval_every=0",
    "tracker=none",
    "trainer.plots=false",
)
WATCH = ("trainer.spike.window=16",)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "spikes.jsonl").read_text().splitlines()]


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for path in sorted((run_dir / "model").glob("*.safetensors")) for k, v in load_file(path).items()}


def test_a_spike_is_logged_and_the_run_trains_as_without_the_watch(run_cli, tmp_path):
    watched = run_cli(*POISONED, *WATCH, "trainer.spike.metrics=[loss,grad_norm]", pythonpath=TESTS)
    assert watched.returncode == 0, watched.stderr
    (record,) = _records(watched.run_dir)
    step, spike = record["step"], record["spike"]["train/loss"]
    assert record["action"] == "log" and spike["z"] > 6 and spike["value"] > 1000 * spike["median"]
    assert record["spike"]["train/grad_norm"]["z"] > 6  # the gradients of the poisoned batch jump too
    assert f"step {step}: a spike: train/loss {spike['value']:.4g} is " in watched.stderr
    assert metrics_of(watched)["train/spikes"] == 1.0
    history = [json.loads(line) for line in (watched.run_dir / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history if "train/spikes" in row] == [step]

    above = run_cli(*POISONED, *WATCH, f"trainer.spike.threshold={spike['z'] * 2}", f"hydra.run.dir={tmp_path / 'above'}", pythonpath=TESTS)  # fmt: skip
    assert above.returncode == 0 and "train/spikes" not in metrics_of(above), above.stderr
    plain = run_cli(*POISONED, f"hydra.run.dir={tmp_path / 'plain'}", pythonpath=TESTS)
    assert plain.returncode == 0, plain.stderr
    assert not (tmp_path / "plain" / "spikes.jsonl").exists()
    ours, theirs = _model(watched.run_dir), _model(tmp_path / "plain")  # the watch changed nothing
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_rollback_leaves_the_spike_s_batches_out_on_every_rank_and_resumes_bitwise(run_cli, tmp_path):
    rollback = (
        *POISONED, *WATCH, "hardware=ddp", "hardware.num_processes=2", "trainer.spike.action=rollback",
        "trainer.spike.rollback_steps=4", "trainer.checkpoint_every=5", "trainer.keep_checkpoints=null",
    )  # fmt: skip
    proc = run_cli(*rollback, pythonpath=TESTS)
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.run_dir)
    # An epoch is 28 steps of 2 x 64 samples: the poisoned one comes again in each, and once only (its batch
    # rolled back past was not seen again).
    assert [r["left_out"]["to"]["epoch"] for r in records] == [0, 1, 2]
    for record in records:
        spiked, back = record["step"], record["to_step"]
        assert record["action"] == "rollback" and back == (spiked - 4) // 5 * 5  # the newest >= 4 steps before
        assert f"rolled back from step {spiked} to {record['checkpoint']} (step {back})" in proc.stderr
    first = records[0]  # each rank's micro-batches between the checkpoint and the spike
    assert first["left_out"] == {"from": {"epoch": 0, "batch": first["to_step"]}, "to": {"epoch": 0, "batch": first["step"]}}
    metrics = metrics_of(proc)
    assert (metrics["train/spikes"], metrics["train/rollbacks"]) == (3.0, 3.0)
    assert metrics["train/loss"] < 1 and metrics["eval/loss"] < 1  # trained on as if the batches never were
    summary = summarize([json.loads(line) for line in (proc.run_dir / "goodput.jsonl").read_text().splitlines()])
    lost = sum(r["step"] - r["to_step"] for r in records)
    assert (summary["rollbacks"], summary["attempts"], summary["lost_steps"]) == (3, 1, lost)
    steps = sorted(
        json.loads((c / "meta.json").read_text())["step"]
        for c in (proc.run_dir / "checkpoints").glob("checkpoint_*")
    )
    assert steps == list(range(5, 61, 5))  # those written past the rollback's checkpoint were deleted, and again

    after = next(
        c for c in (proc.run_dir / "checkpoints").glob("checkpoint_*")
        if json.loads((c / "meta.json").read_text())["step"] == first["to_step"] + 10
    )  # fmt: skip
    resumed = run_cli(*rollback, f"trainer.resume={after}", f"hydra.run.dir={tmp_path / 'resumed'}", pythonpath=TESTS)
    assert resumed.returncode == 0, resumed.stderr
    assert metrics_of(resumed)["train/rollbacks"] == 3.0  # the count went on from the checkpoint's 1
    ours, theirs = _model(proc.run_dir), _model(tmp_path / "resumed")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_spike_settings_that_cannot_work_are_refused_before_launch(forked_cli):
    proc = forked_cli("trainer.spike.window=16", "trainer.spike.action=rollback")
    assert proc.returncode == 2, proc.stderr
    assert "trainer.spike.action=rollback returns to a checkpoint written before the spike, and " in proc.stderr
    assert "trainer.checkpoint_every=0 writes none by steps" in proc.stderr

    proc = forked_cli(
        "trainer.spike.window=16", "trainer.spike.action=rollback", "trainer.checkpoint_every=10",
        "trainer.spike.rollback_steps=30",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "trainer.spike.rollback_steps=30: a rollback returns to the newest checkpoint" in proc.stderr
    assert "the oldest one kept may be only 11 step(s) back. Keep more (trainer.keep_checkpoints=4" in proc.stderr

    proc = forked_cli("trainer.spike.window=4")
    assert proc.returncode == 2 and "trainer.spike.window=4: must be >= 8, or 0 (off)" in proc.stderr
    proc = forked_cli("trainer.spike.window=16", "trainer.spike.metrics=[]")
    assert proc.returncode == 2 and "trainer.spike.metrics=[]: nothing to watch" in proc.stderr
