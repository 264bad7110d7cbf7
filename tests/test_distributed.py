"""The Accelerator in 2 real processes over gloo, started by torch's elastic launcher."""

from __future__ import annotations

import math

import pytest
import rank_checks
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = rank_checks.run_ranks(
        rank_checks.execution_and_collectives, str(tmp_path_factory.mktemp("ranks"))
    )
    return [results[0], results[1]]


def test_process_info_and_decorators(ranks):
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["num_processes"] == 2
    assert [r["on_main"] for r in ranks] == [0, None]
    assert [r["on_local_main"] for r in ranks] == [0, None]
    assert [r["on_process_1"] for r in ranks] == [None, 1]
    assert [r["on_local_process_1"] for r in ranks] == [None, 1]


def test_ranks_fork_from_a_forkserver_that_imported_torch_and_runner_already(ranks):
    """Else every rank of every launch in the suite imports them again (2 s a process here)."""
    assert [r["preloaded"] for r in ranks] == [True, True]


def test_main_process_first_runs_the_main_process_to_the_end_first(ranks):
    main_enter, main_exit = ranks[0]["main_first"]
    other_enter, _ = ranks[1]["main_first"]
    assert main_exit - main_enter >= 0.5 and other_enter >= main_exit
    assert ranks[1]["local_main_first"][0] >= ranks[0]["local_main_first"][1]


def test_trigger_set_on_one_rank_is_seen_by_all_then_cleared(ranks):
    assert [r["trigger"] for r in ranks] == [(True, False), (True, False)]


def test_collectives_over_nested_structures(ranks):
    for r in ranks:
        assert r["gather"]["a"].tolist() == [0, 0, 1, 1]
        assert r["gather"]["b"][0].tolist() == [[0.0], [1.0]]
        assert r["reduce_sum"].tolist() == [3.0]
        assert r["reduce_mean"]["x"].tolist() == [1.5]
        assert r["broadcast"]["t"].tolist() == [11]
        assert r["broadcast_object_list"] == ["from 0", {"r": 0}]
        assert r["gather_object"] == ["hello from 0", "hello from 1"]
        assert r["gather_object_scalar"] == [0, 1]
    assert ranks[0]["pad"].tolist() == [[1, 1], [-1, -1]]
    assert ranks[1]["pad"].tolist() == [[2, 2], [2, 2]]
    assert ranks[0]["pad_first"][0].tolist() == [[0, 0], [1, 1]]


def test_gather_for_metrics_returns_each_of_101_samples_once(ranks):
    for r in ranks:
        assert r["eval_len"] == r["eval_batches"] == 7  # ceil(13 batches / 2 ranks)
        assert r["eval_gathered"].tolist() == list(range(101))
        assert r["eval_gathered_objects"] == [f"s{i}" for i in range(101)]


def test_shuffled_shards_are_disjoint_complete_and_agree_across_ranks(ranks):
    for epoch in range(2):
        mine, theirs = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert set(mine).isdisjoint(theirs)  # different seeds, yet one permutation split in two
        assert sorted(mine + theirs) == list(range(64))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # a new shuffle each epoch
    assert ranks[0]["train_len"] == len(ranks[0]["epochs"][0]) // 4 == 8


def test_skip_first_batches(ranks):
    for r in ranks:
        length, batches = r["skip"]
        assert length == 5 and batches == r["skip_reference"][3:]


def test_iterable_dataset_is_sharded_and_evened_out(ranks):
    assert ranks[0]["stream"] == list(range(37))


def test_split_batches_gives_each_rank_a_slice_of_every_batch():
    results = rank_checks.run_ranks(rank_checks.split_batches_run)
    assert results[0]["batches"] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19], [24, 25, 26, 27]]
    assert results[1]["batches"][0] == [4, 5, 6, 7]
    assert results[0]["len"] == 4


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ddp_matches_one_process_on_the_concatenated_batches(accumulation):
    results = rank_checks.run_ranks(rank_checks.ddp_training, accumulation)
    reference = rank_checks.reference_training(accumulation)["params"]
    for r in (results[0], results[1]):
        assert torch.equal(r["all_params"][0], r["all_params"][1])  # replicas stay identical
        torch.testing.assert_close(r["params"], reference, atol=1e-6, rtol=0)
    grads = [results[0]["grads"], results[1]["grads"]]
    if accumulation == 2:  # accumulate() skips the all-reduce on the micro-step before the boundary
        assert not torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[0][accumulation - 1], grads[1][accumulation - 1])


@pytest.mark.parametrize(
    ("zero_stage", "accumulation", "max_grad_norm", "offload"),
    [
        (1, 1, None, False),
        (2, 2, 0.05, False),
        (3, 1, None, False),
        (3, 2, 0.05, False),
        (2, 1, None, True),
        (3, 2, 0.05, True),
    ],
)
def test_deepspeed_matches_one_process(zero_stage, accumulation, max_grad_norm, offload):
    """Accumulation, clipping only when asked, a schedule stepped by the loop and CPU offload (of the
    optimizer; of the parameters too at stage 3), through the engine."""
    results = rank_checks.run_ranks(
        rank_checks.deepspeed_training, zero_stage, accumulation, max_grad_norm, offload
    )
    reference = rank_checks.reference_training(
        accumulation, max_grad_norm=max_grad_norm or math.inf, schedule=True
    )
    for r in (results[0], results[1]):
        torch.testing.assert_close(r["params"], reference["params"], atol=1e-6, rtol=0)
    if max_grad_norm is None:  # DeepSpeed's own default (clip at 1.0) would have changed these steps
        assert max(reference["norms"]) > 1.0
    else:  # the engine clipped, and clip_grad_norm_ returns the norm it measured
        assert max(reference["norms"]) > max_grad_norm
        torch.testing.assert_close(results[0]["norms"], reference["norms"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("plugin", "accumulation", "max_grad_norm"),
    [
        ({"zero_stage": 3, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05}, 2, 0.05),
        ({}, 1, 1.0),  # Accelerate's defaults: ZeRO-2, the Accelerator's accumulation, clipping at 1.0
    ],
)
def test_accelerates_deepspeed_plugin_trains_as_the_engine_it_describes(plugin, accumulation, max_grad_norm):
    """`Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))`: its stage, accumulation and clipping reach the
    engine, and training matches one process doing the same (which each setting changes)."""
    result = rank_checks.run_ranks(rank_checks.deepspeed_training, 0, 1, max_grad_norm, False, plugin)[0]
    reference = rank_checks.reference_training(accumulation, max_grad_norm=max_grad_norm, schedule=True)
    assert result["engine"] == {
        "stage": plugin.get("zero_stage", 2),
        "accumulation": accumulation,
        "clipping": max_grad_norm,
        "plugin": True,
    }
    assert max(reference["norms"]) > max_grad_norm  # clipping changed these steps
    torch.testing.assert_close(result["params"], reference["params"], atol=1e-6, rtol=0)
    torch.testing.assert_close(result["norms"], reference["norms"], atol=1e-5, rtol=1e-5)


def test_dummy_optim_and_scheduler_train_with_what_the_deepspeed_config_declares(tmp_path):
    """The engine builds the config's SGD ("auto" lr 0.1 from DummyOptim) and the callable's halving
    schedule, and steps that schedule once per optimizer step (the prepared scheduler does not step it
    again); a run resumed from a checkpoint of step 3 ends where the uninterrupted one does."""
    checkpoint = str(tmp_path / "step3")
    result = rank_checks.run_ranks(rank_checks.deepspeed_declared_training, checkpoint)[0]
    reference = rank_checks.reference_training(1, schedule=True)
    assert result["optimizer"] == "SGD"
    assert result["lr_in_config"] == "auto"  # the user's dict is left as it was
    assert result["lrs"] == [0.1 * 0.5 ** (i + 1) for i in range(len(result["lrs"]))]
    torch.testing.assert_close(result["params"], reference["params"], atol=1e-6, rtol=0)
    resumed = rank_checks.run_ranks(rank_checks.deepspeed_declared_training, checkpoint, True)[0]
    assert resumed["lrs"] == result["lrs"][3:]  # the schedule's state came back with the checkpoint
    torch.testing.assert_close(resumed["params"], result["params"], atol=0, rtol=0)


def test_deepspeed_config_is_generated_from_the_run():
    result = rank_checks.run_ranks(rank_checks.deepspeed_generated_config)[0]
    config = result["config"]
    assert config["train_micro_batch_size_per_gpu"] == 4  # the dataloader's per-rank batch
    assert config["gradient_accumulation_steps"] == 2  # "auto": the Accelerator's
    assert config["bf16"] == {
        "enabled": True
    }  # the Accelerator's precision (the merge: test_deepspeed_config.py)
    assert "in the same call" in result["optimizer_alone"]


def test_torchs_context_parallel_cannot_run_on_cpu_ranks_yet():
    """Why runner's context parallel (`hardware.cp_size`, and Accelerate's `ParallelismConfig(cp_size=N)` with
    `maybe_context_parallel` mapped onto it) is its own and not torch's ring attention, which Accelerate
    swaps in: torch's has no sharding rule for the CPU attention kernel, and the math kernel mixes Tensor
    and DTensor. runner's gathers the keys and values instead. When this fails, torch runs it on CPU
    ranks: compare the two here."""
    outcomes = rank_checks.run_ranks(rank_checks.torch_context_parallel_on_cpu)[0]
    assert "_scaled_dot_product_flash_attention_for_cpu" in outcomes["None"]
    assert "mixed torch.Tensor and DTensor" in outcomes["SDPBackend.MATH"]
