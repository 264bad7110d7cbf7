"""Unit tests for logic that the end-to-end runs exercise only as a whole: the mesh's degrees, how blocks
split into pipeline stages and which pipelines are refused, the background checkpoint writer, and the
learning rate a resumed run keeps, the devices
a strategy accepts."""

from __future__ import annotations

import gc
import itertools
import math
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from runner.callbacks.watchdog import AUTO_FLOOR_S, FIRST_STEPS_S, Watchdog
from runner.checkpoint.files import CheckpointDiscarded, PendingWrite, save_torch
from runner.checkpoint.resume import keep_configured_lr
from runner.cli import leave_the_heap
from runner.errors import (
    ConfigError,
    RankFailedError,
    RendezvousError,
    TrainingDiverged,
    TrainingInterrupted,
    TrainingStopped,
    ending,
)
from runner.hardware.base import ParameterMap
from runner.hardware.mesh import ParallelDims
from runner.hardware.pipeline import check_pipeline, local_stage_indices, stage_blocks
from runner.hardware.single_device import SingleDevice
from runner.launchers.reports import lost_a_peer, repeated_failure, report_failure, reported_failure
from runner.models import GPT
from runner.schedulers import constant, cosine


# ------------------------------------------------------------------------------------------ ParallelDims
@pytest.mark.parametrize(
    ("dims", "world", "dp_shard"),
    [
        (ParallelDims(), 8, 8),
        (ParallelDims(tp=2), 8, 4),
        (ParallelDims(pp=2, tp=2), 8, 2),
        (ParallelDims(pp=2, dp_replicate=2, tp=2), 8, 1),
        (ParallelDims(dp_replicate=2, dp_shard=2), 4, 2),
    ],
)
def test_parallel_dims_fill_dp_shard_with_the_rest_of_the_world(dims, world, dp_shard):
    resolved = dims.resolved(world)
    assert resolved.dp_shard == dp_shard
    assert resolved.pp * resolved.dp * resolved.tp == world
    assert resolved.dp == resolved.dp_replicate * dp_shard


@pytest.mark.parametrize(
    ("dims", "world", "named"),
    [
        (ParallelDims(tp=3), 8, "hardware.tp_size=3"),
        (ParallelDims(dp_shard=2), 8, "hardware.dp_shard=2"),  # fixed degrees must use the whole world
        (
            ParallelDims(pp=2, tp=2, dp_shard=3),
            8,
            "hardware.pp_size=2, hardware.dp_shard=3, hardware.tp_size=2",
        ),
        (ParallelDims(tp=0), 4, "each degree must be >= 1"),
        (ParallelDims(dp_shard=0), 4, "each degree must be >= 1"),
        (ParallelDims(dp_shard=-2), 4, "each degree must be >= 1"),
    ],
)
def test_parallel_dims_that_do_not_fit_the_world_name_the_degrees(dims, world, named):
    with pytest.raises(ConfigError) as err:
        dims.resolved(world)
    assert named in str(err.value)


def test_parallel_dims_describe_each_ranks_coordinates():
    text = ParallelDims(pp=2, tp=2).resolved(8).describe(shown_ranks=3)
    assert text.startswith("pp 2 x dp_replicate 1 x dp_shard 2 x tp 2;")
    # rank 1 is the second tp rank of the first shard of the first stage; rank 2 the next shard
    assert "0:(0,0,0,0) 1:(0,0,0,1) 2:(0,0,1,0) ... (8 ranks)" in text


# ------------------------------------------------------------------------------------ pipeline stages
@pytest.mark.parametrize(
    ("blocks", "stages", "sizes"),
    [(4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (3, 3, [1, 1, 1]), (6, 4, [2, 2, 1, 1])],
)
def test_stage_blocks_split_consecutively_and_evenly(blocks, stages, sizes):
    ranges = stage_blocks(blocks, stages)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(blocks))  # every block once, in order


def test_interleaved_stages_loop_over_the_ranks():
    assert local_stage_indices(0, pp=2, virtual_stages=2) == [0, 2]
    assert local_stage_indices(1, pp=2, virtual_stages=3) == [1, 3, 5]


def _gpt(layers: int) -> GPT:
    with torch.device("meta"):
        return GPT(vocab_size=16, max_seq_len=8, d_model=8, n_layers=layers, n_heads=2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, "zigzag", 2, 1), "hardware.pp_schedule='zigzag': expected one of"),
        ((2, "gpipe", 0, 1), "both must be >= 1"),
        ((2, "interleaved_1f1b", 2, 1), "set hardware.virtual_stages >= 2"),
        ((2, "gpipe", 2, 2), "only interleaved_1f1b runs several stages per rank"),
        ((4, "gpipe", 4, 1), "4 pipeline stages, but GPT has 2 block(s)"),
        ((2, "1f1b", 1, 1), "1F1B needs at least as many microbatches as stages (2)"),
    ],
)
def test_check_pipeline_refuses_what_cannot_run(args, message):
    with pytest.raises(ConfigError) as err:
        check_pipeline(_gpt(2), *args)
    assert message in str(err.value)


def test_check_pipeline_refuses_a_model_without_stages_and_accepts_one_that_fits():
    with pytest.raises(ConfigError, match="declares no pipeline stages"):
        check_pipeline(torch.nn.Linear(2, 2), 2, "gpipe", 2, 1)
    check_pipeline(_gpt(4), 2, "interleaved_1f1b", 4, 2)  # 4 stages over 4 blocks: fits
    with pytest.raises(ConfigError, match="must be a multiple of 2"):
        check_pipeline(_gpt(4), 2, "interleaved_1f1b", 5, 2)


# --------------------------------------------------------------------------------- the background write
def test_pending_write_commits_after_writing(tmp_path: Path):
    order: list[str] = []
    release = threading.Event()

    def write() -> None:
        release.wait(5)
        order.append("write")

    pending = PendingWrite(
        tmp_path / "checkpoint_0", write, lambda: order.append("commit"), lambda: order.append("discard")
    )
    assert pending.running  # the caller goes on while it writes
    release.set()
    pending.wait()
    assert not pending.running
    assert order == ["write", "commit"]


@pytest.mark.parametrize("fails_in", ["write", "commit"])
def test_pending_write_discards_and_reraises_a_failure(tmp_path: Path, fails_in: str):
    order: list[str] = []

    def step(name: str):
        def run() -> None:
            order.append(name)
            if name == fails_in:
                raise OSError(28, "No space left on device")

        return run

    pending = PendingWrite(
        tmp_path / "checkpoint_3", step("write"), step("commit"), lambda: order.append("discard")
    )
    with pytest.raises(
        RuntimeError, match=r"writing the checkpoint .*checkpoint_3 in the background failed"
    ) as err:
        pending.wait()
    assert isinstance(err.value.__cause__, OSError)
    assert order == (["write", "discard"] if fails_in == "write" else ["write", "commit", "discard"])


# ------------------------------------------------------------------------------------ keep_configured_lr
def _scheduler(lr: float, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.5, total_iters=10)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler


def test_keep_configured_lr_changes_nothing_when_the_config_did_not_change():
    scheduler = _scheduler(0.1, 4)
    before = [group["lr"] for group in scheduler.optimizer.param_groups]
    keep_configured_lr(scheduler, [0.1])
    assert [group["lr"] for group in scheduler.optimizer.param_groups] == before  # bitwise
    assert scheduler.base_lrs == [0.1]


def test_keep_configured_lr_rescales_the_schedule_to_the_configured_rate():
    resumed = _scheduler(0.1, 4)  # the checkpoint's rate: 0.1, 4 steps into the decay
    keep_configured_lr(resumed, [0.01])  # the resumed run's config: 10x lower
    fresh = _scheduler(0.01, 4)  # what a run configured so from the start would have now
    assert resumed.base_lrs == [0.01]
    assert resumed.get_last_lr() == pytest.approx(fresh.get_last_lr())
    for _ in range(3):  # and the schedule goes on from there alike
        resumed.optimizer.step()
        resumed.step()
        fresh.optimizer.step()
        fresh.step()
    assert resumed.get_last_lr() == pytest.approx(fresh.get_last_lr())


# ---------------------------------------------------------------------------------------- ParameterMap
def test_parameter_map_follows_every_replacement_and_drops_what_this_rank_lost():
    old = torch.nn.Linear(2, 2)
    placed = {name: torch.nn.Parameter(p.detach().clone()) for name, p in old.named_parameters()}
    sharded = {
        "weight": torch.nn.Parameter(placed["weight"].detach().clone()),
        "bias": None,
    }  # bias: on another stage
    optimizer = torch.optim.SGD(old.parameters(), lr=0.1)
    parameters = ParameterMap()
    parameters.record(dict(old.named_parameters()), placed)  # e.g. device placement on XLA
    parameters.record(placed, sharded)  # then sharding, or this rank's pipeline stage
    parameters.follow(optimizer)
    assert optimizer.param_groups[0]["params"] == [sharded["weight"]]
    assert parameters.current(old.weight) is sharded["weight"] and parameters.current(old.bias) is None


def test_parameter_map_keeps_a_tied_weight_held_under_either_name():
    shared = torch.nn.Parameter(torch.zeros(2))
    kept = torch.nn.Parameter(torch.ones(2))
    parameters = ParameterMap()
    # The embedding (first name) is on another stage; the head (second name) holds it here.
    parameters.record(
        {"embed.weight": shared, "head.weight": shared}, {"embed.weight": None, "head.weight": kept}
    )
    assert parameters.current(shared) is kept
    parameters.record({"a": kept}, {"a": kept})  # unchanged: nothing to follow
    assert parameters.current(kept) is kept


# ------------------------------------------------------------------------------------------ rank reports
def _reported(error_dir: Path, rank: int, err: BaseException) -> None:
    try:
        raise err
    except BaseException as raised:
        report_failure(error_dir, rank, raised)


def test_a_ranks_error_comes_back_as_its_kind_the_first_cause_first(tmp_path: Path):
    _reported(tmp_path, 1, TrainingDiverged("train/loss=nan at step 5"))
    again = reported_failure(tmp_path)
    assert type(again) is TrainingStopped and str(again) == "train/loss=nan at step 5"  # the CLI's paragraph
    _reported(tmp_path, 0, RuntimeError("Connection closed by peer"))  # a consequence: reported last
    assert type(reported_failure(tmp_path)) is TrainingStopped
    (tmp_path / "rank1.json").unlink()
    lost = reported_failure(tmp_path)
    assert (
        isinstance(lost, RankFailedError) and "rank 0 raised" in str(lost) and "closed by peer" in str(lost)
    )
    assert reported_failure(tmp_path, causes_only=True) is None  # the rank that failed first was killed
    _reported(tmp_path, 2, ConfigError("hardware.tp_size=3: must divide the world"))
    assert type(reported_failure(tmp_path)) is ConfigError
    assert reported_failure(tmp_path / "none") is None
    # a refusal raised while Hydra built the rank's data source is a refusal (a restart would repeat it)
    try:
        instantiate({"_target_": "runner.data.table.TableFile", "path": str(tmp_path / "missing.csv"), "target": "y"})
    except InstantiationException as wrapped:
        report_failure(tmp_path / "built", 0, wrapped)
    assert repeated_failure(tmp_path / "built") == "ConfigError"
    assert str(reported_failure(tmp_path / "built")).startswith("data.path=")


# ----------------------------------------------------------------------------------------- present_device
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("gpu", "hardware.device='gpu': not a torch device"),
        ("cuda", "hardware.device=cuda: this machine has 0 cuda device(s)"),
        ("cuda:1", "hardware.device=cuda:1: this machine has 0 cuda device(s)"),
        ("mps", "hardware.device=mps: this machine has 0 mps device(s)"),
    ],
)
@pytest.mark.skipif(torch.cuda.is_available(), reason="names devices this CPU machine lacks")
def test_a_device_this_machine_lacks_is_refused_naming_what_it_has(name, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SingleDevice(name)
    assert SingleDevice("cpu").device == torch.device("cpu")


def test_a_part_written_into_a_discarded_checkpoint_is_reported_after_the_cause(tmp_path, monkeypatch):
    """Rank 1 writes its part while rank 0, whose own write failed (a full disk), removes the staging dir:
    rank 1's error is a consequence, so rank 0's report is the one raised."""
    monkeypatch.setattr("runner.launchers.reports.LOST_PEER_GRACE_S", 0.0)
    with pytest.raises(CheckpointDiscarded) as discarded:
        save_torch({"x": torch.ones(1)}, tmp_path / "gone" / "random_states_1.pt")
    assert lost_a_peer(discarded.value)
    errors = tmp_path / "errors"
    report_failure(errors, 1, discarded.value)  # the consequence, reported first
    report_failure(errors, 0, TrainingStopped("the disk is full"))
    assert str(reported_failure(errors)) == "the disk is full"


def test_ranks_that_stopped_on_a_signal_are_reported_in_their_own_words(tmp_path):
    """The launcher repeats what the ranks said (the signal, the step, the checkpoint) and keeps the
    signal, which a SLURM job's requeue reads."""
    said = "stopped by SIGUSR1 at step 720/1000; checkpoint ckpt/checkpoint_0. Run the same command to resume."
    for rank in (0, 1):
        report_failure(tmp_path, rank, TrainingInterrupted(said, signum=signal.SIGUSR1))
    reported = reported_failure(tmp_path)
    assert type(reported) is TrainingInterrupted and str(reported) == said
    assert reported.signum == signal.SIGUSR1


def test_the_command_leaves_the_heap_to_exit_after_finalising_its_garbage(tmp_path):
    """At exit the command exempts the heap from the shutdown's collections (0.5 s of every exit), but
    first collects what the run left in reference cycles: their finalisers run (a writer closing its
    file, say), as the shutdown's collections would have run them."""

    class Writer:
        def __del__(self) -> None:
            (tmp_path / "closed").write_text("finalised")

    writer = Writer()
    writer.self = writer  # a reference cycle: only the garbage collector frees it
    del writer
    try:
        leave_the_heap()
        assert gc.get_freeze_count() > 0
        assert (tmp_path / "closed").read_text() == "finalised"
    finally:
        gc.unfreeze()


def test_every_way_a_command_ends_has_one_heading_and_exit_status():
    """One table (runner.errors.ENDINGS) for the job and the command around it: 2 where nothing ran, 75
    where a rerun resumes, 1 for a failure, whatever raised it."""
    assert ending(ConfigError("x")) == ("Configuration error", 2)
    assert ending(TrainingInterrupted("x")) == ("Training interrupted", 75)
    assert ending(RankFailedError("x")) == ("Training failed", 1)
    assert ending(TrainingDiverged("x")) == ending(RendezvousError("x")) == ("Training stopped", 1)
    assert ending(RuntimeError("x")) == ("Training failed", 1)


def test_the_cosine_schedule_warms_up_then_decays_to_min_lr_ratio():
    """scheduler=cosine: the rate rises linearly over warmup_ratio of the steps, then falls along a cosine
    to min_lr_ratio x the peak after the last step (as Hugging Face's schedule reaches 0 there)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    schedule = cosine(optimizer, num_training_steps=100, warmup_ratio=0.1, min_lr_ratio=0.2)
    rates = []
    for _ in range(100):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] == pytest.approx(0.5 / 11) and rates[10] == pytest.approx(0.5)
    assert all(a < b for a, b in itertools.pairwise(rates[:11]))
    assert rates[-1] == pytest.approx(0.5 * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 89 / 90))))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # after the last step: 0.2 x 0.5


def test_the_schedules_absolute_settings_replace_the_shares_in_optimizer_steps():
    """warmup_steps, decay_steps and min_lr count optimizer steps (2 scheduler steps each here, as on 2
    processes) and replace warmup_ratio and min_lr_ratio: the rate peaks after 10 updates, reaches min_lr
    in every group at update 50 of 100 and stays there; constant warms up over warmup_steps too."""
    def groups() -> list[dict]:
        return [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (0.5, 0.1)]

    optimizer = torch.optim.SGD(groups(), lr=0.5)
    schedule = cosine(
        optimizer, 200, warmup_ratio=0.3, min_lr_ratio=0.5, warmup_steps=10, decay_steps=50, min_lr=0.05,
        steps_per_update=2,
    )  # fmt: skip
    rates = []
    for _ in range(200):
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        schedule.step()
    updates = rates[::2]  # the rate of each optimizer step
    assert rates[1::2] == updates and updates[0] == pytest.approx([0.5 / 11, 0.1 / 11])
    assert updates[9] == pytest.approx([0.5 * 10 / 11, 0.1 * 10 / 11]) and updates[10] == pytest.approx([0.5, 0.1])
    assert all(a[0] > b[0] for a, b in itertools.pairwise(updates[10:51]))
    assert updates[50] == updates[99] == pytest.approx([0.05, 0.05])
    assert updates[30][0] == pytest.approx(0.05 + 0.45 * 0.5 * (1 + math.cos(math.pi * 20 / 40)))
    flat = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    warming = constant(flat, 100, warmup_steps=4, steps_per_update=2)
    seen = []
    for _ in range(10):
        seen.append(flat.param_groups[0]["lr"])
        flat.step()
        warming.step()
    assert seen[6:8] == pytest.approx([4 / 5, 4 / 5]) and seen[8:] == [1.0, 1.0]
    with pytest.raises(ConfigError, match=r"scheduler.min_lr=0.2: above the learning rate 0.1"):
        cosine(torch.optim.SGD(groups(), lr=0.5), 100, min_lr=0.2)
    with pytest.raises(ConfigError, match=r"the warm-up \(60 optimizer steps\) leaves nothing of the 50"):
        cosine(torch.optim.SGD(groups(), lr=0.5), 100, warmup_steps=60, decay_steps=50)


def test_the_watchdogs_limit_follows_the_steps_once_measured(tmp_path):
    """trainer.hang_timeout_s=null: the first steps' generous limit, then 20x the median step (at least
    600 s); a number is the limit; 0 starts no thread."""
    auto = Watchdog(None, tmp_path, 0)
    assert auto.limit_s == FIRST_STEPS_S
    for step in range(1, 11):
        auto.progress("training", step)
    assert auto.limit_s == AUTO_FLOOR_S  # steps of microseconds: the floor
    auto.steps.extend([100.0] * 20)  # steps of 100 s
    assert auto.limit_s == 2000.0
    auto.progress("evaluating", 10)  # an eval batch is progress, not a step
    assert len(auto.steps) == 30 and auto.phase == "evaluating"
    auto.progress("training", 10)  # back to training after the evaluation: its time is no step's
    assert len(auto.steps) == 30 and auto.phase == "training"
    auto.progress("training", 11)
    assert len(auto.steps) == 31
    assert Watchdog(7.5, tmp_path, 0).limit_s == 7.5
    off = Watchdog(0, tmp_path, 0).start()
    assert off._thread is None


def test_the_watchdog_ends_a_rank_at_its_limit_not_at_its_next_poll(tmp_path):
    """Ranks that stop together (in one collective) reach their limits together: each watchdog fires when
    its limit has passed, not up to a poll later, so that a rank whose poll came first does not end the
    others' collective with a lost peer before their own watchdogs report. Here progress comes 0.1 s
    after the start: the limit passes at 1.1 s, the polls come at 1 s and 2 s."""
    fired, fired_at = threading.Event(), []
    watchdog = Watchdog(1.0, tmp_path, 0, poll_s=1.0)

    def end(waited: float) -> None:  # in place of writing the report and exiting
        fired_at.append(time.monotonic())
        fired.set()
        watchdog.stop()

    watchdog._end = end  # type: ignore[method-assign]
    watchdog.start()
    time.sleep(0.1)
    watchdog.progress("training", 1)
    assert fired.wait(5)
    late = fired_at[0] - (watchdog.last + 1.0)
    assert 0 <= late < 0.5, late  # at the next poll: 0.9 s late
