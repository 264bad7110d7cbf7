"""Pipeline parallel (`hardware=tensor_parallel hardware.pp_size=N`): each schedule runs its own order of
microbatches over the stages, a run from the command line trains as one process does and ends with the
full weights, and what cannot run is refused before launch. The loss curves against one process (pp 2 with
each schedule, pp 2 x dp 2, tp 2 x pp 2) and resharding to and from a pipeline are in test_matrix.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import rank_checks
from conftest import metrics_of
from omegaconf import OmegaConf

from runner import load_checkpoint_in_model
from runner.checkpoint.weights import read_weights
from runner.models import GPT

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent  # faulty_tasks


def in_flight(events: list[str]) -> int:
    """The most microbatches that had run forward and not yet backward at once."""
    most = count = 0
    for event in events:
        count += 1 if event[0] == "F" else -1
        most = max(most, count)
    return most


@pytest.mark.parametrize(
    ("schedule", "microbatches", "virtual_stages"),
    [("gpipe", 4, 1), ("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 4, 2)],
)
def test_each_schedule_runs_its_order_of_microbatches(schedule, microbatches, virtual_stages):
    ranks = rank_checks.run_ranks(rank_checks.pipeline_order, schedule, microbatches, virtual_stages)
    assert ranks[0]["loss"] == ranks[1]["loss"]  # the mean over microbatches, on every rank
    first = ranks[0]
    stages = sorted(first["blocks"])
    # 4 blocks over 2 x virtual_stages stages, looped: rank 0 runs stages 0 (and 2).
    assert stages == [0, 2][:virtual_stages]
    assert first["blocks"] == {0: ["0", "1"]} if virtual_stages == 1 else {0: ["0"], 2: ["2"]}
    for stage in stages:  # each stage runs forward and backward once per microbatch
        assert first["events"].count(f"F{stage}") == microbatches
        assert first["events"].count(f"B{stage}") == microbatches
    events = first["events"]
    if schedule == "gpipe":  # every forward, then every backward
        assert events == ["F0"] * microbatches + ["B0"] * microbatches
    elif schedule == "1f1b":  # at most one microbatch per stage in flight on the first stage
        assert in_flight(events) == 2 < microbatches
        assert events.index("B0") < len(events) - microbatches
    else:  # the second stage of rank 0 starts before its first is done with every microbatch
        assert events.index("F2") < max(i for i, e in enumerate(events) if e == "F0")


TRAIN = ("experiment=gpt_sonnets", "trainer.max_steps=12", "trainer.eval_every=6", "tracker=none")
PIPELINE = ("hardware=tensor_parallel", "hardware.num_processes=2", "hardware.tp_size=1", "hardware.pp_size=2")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_run_trains_as_one_process_and_ends_with_the_full_weights(run_cli, schedule):
    single = run_cli(*TRAIN, "hardware.num_threads=1")
    assert single.returncode == 0, single.stderr
    pipeline = run_cli(*TRAIN, *PIPELINE, f"hardware.pp_schedule={schedule}", "trainer.checkpoint_every=6")
    assert pipeline.returncode == 0, pipeline.stderr
    for name, value in metrics_of(single).items():  # the training and evaluation losses alike
        assert metrics_of(pipeline)[name] == pytest.approx(value, abs=1e-5), name
    assert (pipeline.run_dir / "checkpoints" / "checkpoint_1" / "model_0" / ".metadata").exists()  # DCP
    settings = OmegaConf.load(pipeline.run_dir / "resolved_config.yaml").model
    weights = read_weights(pipeline.run_dir / "model")
    model = GPT(
        **{k: v for k, v in settings.items() if k != "_target_"}
        | {"vocab_size": weights["tok_emb.weight"].shape[0]}
    )
    load_checkpoint_in_model(model, pipeline.run_dir / "model", strict=True)  # both stages' weights


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["hardware.pp_size=3"],
            "hardware.pp_size=3: the parallel degrees (pp_size x dp_replicate x dp_shard x tp_size = 3",
        ),
        (
            ["hardware.pp_schedule=interleaved_1f1b", "hardware.virtual_stages=2"],
            "= 4 pipeline stages, but GPT has 2 block(s)",
        ),
        (["hardware.microbatches=3"], "hardware.microbatches=3: a batch of 32 rows"),
        (["hardware.pp_schedule=interleaved_1f1b"], "set hardware.virtual_stages >= 2"),
        (["hardware.pp_schedule=zigzag"], "hardware.pp_schedule='zigzag': expected one of"),
        (["hardware.microbatches=1"], "1F1B needs at least as many microbatches as stages (2)"),
        (
            ["task._target_=faulty_tasks.OwnTrainingStep"],
            "the task OwnTrainingStep has its own training_step",
        ),
    ],
)
def test_a_pipeline_that_cannot_run_is_refused_before_launch(forked_cli, overrides, message):
    proc = forked_cli(*PIPELINE, "experiment=gpt_sonnets", *overrides)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "starting" not in proc.stderr  # no rank was started


def test_a_model_without_stages_is_refused_before_launch(forked_cli):
    proc = forked_cli(*PIPELINE, "experiment=mlp_digits")
    assert proc.returncode == 2, proc.stderr
    assert "MLP declares no pipeline stages" in proc.stderr and "Traceback" not in proc.stderr


def activations_mb(proc) -> float:
    return float(re.search(r"about ([\d.]+) MB per device", proc.stdout + proc.stderr).group(1))


def test_the_plan_shows_the_pipeline(run_cli):
    proc = run_cli(*PIPELINE, "experiment=gpt_sonnets", "plan=true")
    assert proc.returncode == 0, proc.stderr
    single = run_cli("experiment=gpt_sonnets", "plan=true")
    # A stage holds 1 of 2 blocks' activations for 2 of 4 microbatches in flight: 2 / 8 of one process's.
    assert activations_mb(proc) == pytest.approx(activations_mb(single) * 2 / 8, abs=0.1)
    assert "pp 2 x dp_replicate 1 x dp_shard 1 x tp 1" in proc.stdout + proc.stderr
    assert "2 pipeline stages (1 per pp rank), 1f1b over 4 microbatches" in proc.stdout + proc.stderr
    stages = "0 (pp rank 0): blocks 0-0 + tok_emb, pos_emb, drop; 1 (pp rank 1): blocks 1-1 + ln_f, lm_head"
    assert stages in proc.stdout + proc.stderr
    assert (
        "Up to 2 of 4 microbatches' activations in flight on the first stage (1f1b)"
        in proc.stdout + proc.stderr
    )
