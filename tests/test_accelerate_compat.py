"""A script written for Accelerate ports to runner by renaming the module on its import lines: the same
script (tests/accelerate_scripts/classifier.py) runs with `accelerate` and ported to `runner`, alone and
under `torchrun --nproc-per-node 2`; every rank's results must agree (loss curves within 1e-6, fp32) and
each feature must have done what it is for. A script whose every draw comes from torch's global RNG
(tests/accelerate_scripts/shuffled.py) gives bitwise Accelerate's numbers."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "accelerate_scripts" / "classifier.py"
IMPORT_LINE = re.compile(r"^(from|import) accelerate(?=[. ])", re.MULTILINE)
LAUNCHES = {
    "1 process": [sys.executable],
    "torchrun x2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
}


SHUFFLED = Path(__file__).parent / "accelerate_scripts" / "shuffled.py"
SHARDED = Path(__file__).parent / "accelerate_scripts" / "sharded.py"
CONTEXT_PARALLEL = Path(__file__).parent / "accelerate_scripts" / "context_parallel.py"


def ported(directory: Path, script: Path = SCRIPT) -> Path:
    """The script with `accelerate` replaced by `runner` on its import lines, and nowhere else."""
    text = script.read_text()
    port = IMPORT_LINE.sub(r"\1 runner", text)
    changed = [old for old, new in zip(text.splitlines(), port.splitlines(), strict=True) if old != new]
    assert changed and all(line.startswith(("from accelerate", "import accelerate")) for line in changed)
    path = directory / f"{script.stem}_runner.py"
    path.write_text(port)
    return path


# torch 2.13 with gloo: a rank of the 2-process scripts now and then aborts with this, under Accelerate
# (seen in CI, 2026-11-26) as under runner: a native fault outside both, so such a run is run once more.
NATIVE_ABORT = "terminate called without an active exception"


def run(launch: list[str], script: Path, out: Path, *args: str, results: str = "results") -> list[dict]:
    # Accelerate runs CPU ranks started by torchrun as a group only when told to use the CPU (else each
    # rank trains alone); runner's Accelerator honours the same variable.
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    out.mkdir(exist_ok=True)
    before = out.with_name(f"{out.name}.before")
    shutil.copytree(out, before, dirs_exist_ok=True)
    for attempt in range(2):
        if attempt:  # the rerun starts from what was there before the aborted run (its logs, checkpoints)
            shutil.rmtree(out)
            shutil.copytree(before, out)
        proc = subprocess.run(
            [*launch, str(script), str(out), *args], capture_output=True, text=True, timeout=300, env=env
        )
        if proc.returncode == 0 or NATIVE_ABORT not in proc.stderr or attempt:
            break
    shutil.rmtree(before)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob(f"{results}_*.json"))]


@pytest.mark.parametrize("launch", LAUNCHES, ids=list(LAUNCHES))
def test_a_ported_script_draws_bitwise_the_numbers_it_draws_under_accelerate(tmp_path, launch):
    """A shuffling loader without a generator, dropout, accumulation, an eval pass per epoch: every draw
    from torch's global RNG (shuffle seed, loader base seed, dropout masks) comes in Accelerate's order,
    so that losses, eval losses and weights are bitwise Accelerate's on every rank. Resumed from its
    mid-epoch checkpoint, the ported script then ends bitwise as its uninterrupted run (Accelerate's own
    does not: it draws a new shuffle for the resumed epoch). Each library's checkpoint resumes under the other."""
    reference = run(LAUNCHES[launch], SHUFFLED, tmp_path / "with_accelerate")
    script = ported(tmp_path, SHUFFLED)
    results = run(LAUNCHES[launch], script, tmp_path / "with_runner")
    assert len(results) == len(reference) == (2 if launch == "torchrun x2" else 1)
    assert results == reference  # losses, eval losses and the weights' digest, bitwise
    assert len({result["weights"] for result in results}) == 1  # the ranks' replicas agree
    resumed = run(LAUNCHES[launch], script, tmp_path / "with_runner", "resume", results="resumed")
    for whole, rest in zip(results, resumed, strict=True):
        assert rest["losses"] == whole["losses"][-len(rest["losses"]) :] and len(rest["losses"]) > 10
        assert rest["evals"] == whole["evals"][1:] and rest["weights"] == whole["weights"]

    # The checkpoints interchange: each resumes under the other exactly as under the library that wrote it
    # (model, optimizer, every process's RNG states; Accelerate records no position: both draw a new shuffle).
    accelerate_resumed = run(
        LAUNCHES[launch], SHUFFLED, tmp_path / "with_accelerate", "resume", results="resumed"
    )
    for writer, reader in (("with_runner", SHUFFLED), ("with_accelerate", script)):
        out = tmp_path / f"{reader.stem}_reads_{writer}"
        shutil.copytree(tmp_path / writer / "checkpoint", out / "checkpoint")
        assert run(LAUNCHES[launch], reader, out, "resume", results="resumed") == accelerate_resumed, out.name


@pytest.mark.parametrize("launch", LAUNCHES, ids=list(LAUNCHES))
def test_stateful_loaders_draw_as_accelerates_and_their_positions_interchange(tmp_path, launch):
    """`use_stateful_dataloader=True` (torchdata's StatefulDataLoader under Accelerate, which makes each
    loader's first iterator when prepared, drawing its base seed then): the ported script draws bitwise
    Accelerate's numbers, and its resumed script skips no batch itself. Ported, it resumes from its own
    mid-epoch checkpoint bitwise as its uninterrupted run; from Accelerate's checkpoint (`dl_state_dict.bin`,
    the eval loader's pass finished) it resumes bitwise as Accelerate resumed does, and Accelerate resumes
    runner's checkpoint bitwise as its own (both draw a new shuffle for the resumed epoch)."""
    launch, script = LAUNCHES[launch], ported(tmp_path, SHUFFLED)  # (no dir named runner beside it)
    whole = run(launch, script, tmp_path / "ported", "stateful")
    assert whole == run(launch, SHUFFLED, tmp_path / "original", "stateful")
    per_epoch = len(whole[0]["losses"]) // 3
    rest = per_epoch - 6  # of the epoch the checkpoint was written in
    resumed = run(launch, script, tmp_path / "ported", "resume", "stateful", results="resumed")
    for ours, uninterrupted in zip(resumed, whole, strict=True):
        assert len(ours["losses"]) == rest + per_epoch  # without its position it would retrain 6 batches
        assert ours["losses"] == uninterrupted["losses"][-len(ours["losses"]) :]
        assert ours["weights"] == uninterrupted["weights"]

    theirs = run(launch, SHUFFLED, tmp_path / "original", "resume", "stateful", results="resumed")
    assert len(theirs[0]["losses"]) == rest + per_epoch and theirs[0]["losses"] != resumed[0]["losses"]
    for writer, reader in (("original", script), ("ported", SHUFFLED)):
        out = tmp_path / f"{reader.stem}_reads_{writer}"
        shutil.copytree(tmp_path / writer / "checkpoint", out / "checkpoint")
        assert run(launch, reader, out, "resume", "stateful", results="resumed") == theirs, out.name


@pytest.mark.parametrize("launch", LAUNCHES, ids=list(LAUNCHES))
def test_ported_script_matches_accelerate_and_each_feature_works(tmp_path, launch):
    reference = run(LAUNCHES[launch], SCRIPT, tmp_path / "with_accelerate")
    results = run(LAUNCHES[launch], ported(tmp_path), tmp_path / "with_runner")
    processes = 2 if launch == "torchrun x2" else 1
    assert len(results) == len(reference) == processes

    for ours, theirs in zip(results, reference, strict=True):
        assert set(ours) == set(theirs)
        for key, value in theirs.items():
            if key == "uneven_batches_seen":  # Accelerate joins uneven inputs on GPUs only (see below)
                continue
            if key.endswith("losses"):
                assert ours[key] == pytest.approx(value, abs=1e-6), key
            else:
                assert ours[key] == value, key

    for rank, result in enumerate(results):
        assert result["num_processes"] == processes
        assert result["distributed_type"] == (
            "DistributedType.MULTI_CPU" if processes > 1 else "DistributedType.NO"
        )
        # DistributedDataParallelKwargs(comm_hook=FP16) reached DDP (no DDP in a one-process job)
        assert result["comm_hook"] == ("fp16_compress_hook" if processes > 1 else None)
        # 64 samples in batches of 4 shared out, two epochs; resuming from the first epoch's checkpoint
        # replays the second exactly
        assert len(result["losses"]) == 2 * 16 // processes
        assert result["resumed_losses"] == result["second_epoch_losses"]
        quarter = len(result["losses"]) // 4
        assert sum(result["losses"][-quarter:]) < sum(result["losses"][:quarter])  # it learns
        assert result["eval_samples"] == 13  # gather_for_metrics dropped the padding of even batches
        assert result["stopped_at"] == 3  # the last process's trigger stopped every process
        assert result["batch_size"] == 15 and result["batch_sizes_tried"][:3] == [64, 57, 51]
        assert result["all_scores"] == [0, 10, 20, 30, 40]
        assert result["my_folds"] == ([0, 1, 2, 3, 4] if processes == 1 else [[0, 1, 2], [3, 4]][rank])
        assert result["sum_of_ranks"] == sum(range(1, processes + 1))
        assert (
            result["profiled_ops"]
            and (tmp_path / "with_runner" / "traces" / f"profile_{rank}.json").is_file()
        )
        # local SGD: replicas drift apart between averages (several processes), agree after each
        agree = [result[f"local_replicas_agree_after_step_{step}"] for step in range(3)]
        assert agree == ([False, True, False] if processes > 1 else [True, True, True])
        assert result["local_replicas_agree_at_exit"]
        # join_uneven_inputs(even_batches=False): 5 batches as 3 and 2 (Accelerate, on CPU ranks, warns
        # and keeps them even: 3 and 3)
        assert result["uneven_batches_seen"] == ([3, 2][rank] if processes > 1 else 5)
        assert result["grads_agree_after_trigger"]
        assert result["padded_length"] == processes and result["broadcast"] == 0.0
        assert result["rng_synchronized"]

    events = EventAccumulator(str(tmp_path / "with_runner" / "project" / "compat"))
    events.Reload()
    logged = [event.value for event in events.Scalars("train_loss")]
    assert logged == pytest.approx(results[0]["losses"], abs=1e-6)
    assert [event.value for event in events.Scalars("accuracy")] == pytest.approx([results[0]["accuracy"]])


def test_accelerates_fsdp_plugin_and_parallelism_config_run_as_runners_strategies(tmp_path):
    """Accelerate's FSDP plugin and `ParallelismConfig` on 2 processes: each layout trains as DDP does (the
    same arithmetic), sharding where it says so, with its settings in force (units of the named class, their
    activations recomputed: two forwards of a unit per step)."""
    script, out = ported(tmp_path, SHARDED), tmp_path / "out"
    layouts = ("ddp", "fsdp", "fsdp1_names", "replicas", "shards")
    run(LAUNCHES["torchrun x2"], script, out, *layouts)  # one launch, a fresh Accelerator per layout
    results = {
        layout: [json.loads(path.read_text()) for path in sorted(out.glob(f"{layout}_*.json"))]
        for layout in layouts
    }
    reference = results["ddp"][0]["losses"]
    for layout, ranks in results.items():
        assert len(ranks) == 2
        for rank in ranks:
            assert rank["losses"] == pytest.approx(reference, abs=1e-6), layout
    fsdp = results["fsdp"][0]
    assert fsdp["distributed_type"] == "DistributedType.FSDP" and fsdp["mesh"] == ["dp_shard"]
    assert fsdp["sharded"] == ["S(0)"] and fsdp["local_rows"] == 8  # 16 rows over 2 ranks
    assert fsdp["block_forwards_per_step"] == 2  # activation_checkpointing=True: recomputed in backward
    assert results["fsdp1_names"][0]["sharded"] == ["S(0)"]  # the root is the one unit: no_wrap
    assert results["fsdp1_names"][0]["block_forwards_per_step"] == 1
    assert results["shards"][0]["sharded"] == ["S(0)"]
    # Accelerate's data_parallel_rank is the replica's: 0 on both ranks of one sharded copy.
    assert [rank["data_parallel_rank"] for rank in results["shards"]] == [0, 0]
    assert [rank["data_parallel_rank"] for rank in results["replicas"]] == [0, 1]
    # Accelerate's flattened dimensions, as its nd_parallel example looks them up, one dimension alone too.
    for layout in ("fsdp", "shards"):
        assert results[layout][0]["flattened"] == {"dp": 2, "dp_shard_cp": 2, "dp_cp": 2}
    # The same plugin from an FSDP launch config: `accelerate launch --use_fsdp ...` sets FSDP_* variables.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes=2", "--num_machines=1",
              "--mixed_precision=no", "--dynamo_backend=no", "--use_fsdp", "--fsdp_version=2",
              "--fsdp_reshard_after_forward=false", "--fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP",
              "--fsdp_transformer_layer_cls_to_wrap=Block", "--fsdp_activation_checkpointing=true"]  # fmt: skip
    launched = run(launch, script, out, "launch_config", results="launch_config")
    assert launched == results["fsdp"]
    for layout in ("ddp", "replicas"):  # replicas only: DDP
        assert results[layout][0]["distributed_type"] == "DistributedType.MULTI_CPU"
        assert results[layout][0]["sharded"] == [] and results[layout][0]["mesh"] is None


def test_accelerates_context_parallel_trains_as_one_process(tmp_path):
    """Accelerate's context parallel as its example uses it (`ParallelismConfig(cp_size=2)`, an FSDP2 plugin,
    `maybe_context_parallel` around each step, the loss averaged over `torch_device_mesh["dp_cp"]`), ported:
    on 2 processes each rank trains on its head-tail share of every sequence (8 of 16 tokens, positions
    [0-3, 12-15] and [4-11]) and the run is one process's within 1e-5 (losses, weights, eval on whole
    sequences and, inside the context, on the shares). The same from
    `accelerate launch --use_parallelism_config --parallelism_config_cp_size=2`."""
    script, out = ported(tmp_path, CONTEXT_PARALLEL), tmp_path / "out"
    single = run(LAUNCHES["1 process"], script, out, "single", results="single")[0]
    ranks = run(LAUNCHES["torchrun x2"], script, out, "cp", results="cp")
    assert single["seen"] == [16] and single["positions"] == list(range(16))
    assert [rank["positions"] for rank in ranks] == [[0, 1, 2, 3, 12, 13, 14, 15], list(range(4, 12))]
    assert [rank["cp_rank"] for rank in ranks] == [0, 1]
    for rank in ranks:
        assert rank["seen"] == [8, 16]  # training on shares, evaluation on whole sequences
        assert rank["mesh"] == ["dp_shard", "cp"]
        assert rank["losses"] == pytest.approx(single["losses"], abs=1e-5)
        assert rank["eval_loss"] == pytest.approx(single["eval_loss"], abs=1e-5)
        assert rank["shared_eval_loss"] == pytest.approx(single["eval_loss"], abs=1e-5)  # eval on shares
        assert rank["restored"]["inside"] == 8 and rank["restored"]["after"] == list(range(16))
        assert rank["restored"]["kept"] == rank["positions"]  # in no_restore_buffers: left cut
    whole, shared = (torch.load(out / f"{layout}_weights.pt") for layout in ("single", "cp"))
    assert whole.keys() == shared.keys()
    # Weights within 1e-4 (about 1e-3 of their size): Adam divides each gradient by its own running scale,
    # which for a gradient near zero turns the last bits of another summation order (the shares' gradients
    # reduced over 2 ranks) into differences of 1e-5 and more after these steps, by CPU kernel.
    for name, weight in whole.items():
        torch.testing.assert_close(shared[name], weight, atol=1e-4, rtol=0, msg=name)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes=2", "--num_machines=1",
              "--mixed_precision=no", "--dynamo_backend=no", "--use_fsdp", "--fsdp_version=2",
              "--fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP",
              "--fsdp_transformer_layer_cls_to_wrap=LlamaDecoderLayer", "--use_parallelism_config",
              "--parallelism_config_cp_size=2"]  # fmt: skip
    launched = run(launch, script, out, "launch_config", results="launch_config")
    assert [rank["losses"] for rank in launched] == [rank["losses"] for rank in ranks]
    assert [rank["positions"] for rank in launched] == [rank["positions"] for rank in ranks]
