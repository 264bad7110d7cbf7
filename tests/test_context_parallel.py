"""Context parallel (`hardware.cp_size`): each rank of a cp group trains on its share of every sequence.
The loss curves against one process (fsdp cp 2, HSDP 2 x cp 2, tp 2 x cp 2) are in
test_matrix.py; here: what each rank computes, the command line, and what is refused before launch."""

from __future__ import annotations

import re

import pytest
import rank_checks
import torch
import torch.distributed as dist
from conftest import metrics_of
from torch.testing._internal.distributed.fake_pg import FakeStore

from runner.errors import ConfigError
from runner.hardware.context_parallel import ContextParallel, chunks_of, positions_of
from runner.models.sequence_shares import share_model, share_problem


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_shares_cover_each_sequence_once_with_even_causal_work(size):
    length = 2 * size * 3
    shares = [positions_of(rank, size, length // size) for rank in range(size)]
    assert sorted(torch.cat(shares).tolist()) == list(range(length))
    # Under the causal mask the token at position p attends to p + 1 keys: each rank as many.
    work = {int((share + 1).sum()) for share in shares}
    assert len(work) == 1
    assert chunks_of(0, size) == (0, 2 * size - 1)  # the first chunk and the last


def test_samples_whose_sequences_a_share_cannot_take_are_refused():
    tokens = torch.arange(16)
    ContextParallel.check_sample({"inputs": tokens, "targets": tokens}, 2)  # 4 chunks of 4
    with pytest.raises(ConfigError, match="sequences of 16 tokens do not split into 2 x cp_size = 6"):
        ContextParallel.check_sample({"inputs": tokens, "targets": tokens}, 3)
    hugging_face = {"input_ids": tokens, "attention_mask": torch.ones(16), "labels": tokens}
    with pytest.raises(ConfigError, match="every share would lose its boundary token"):
        ContextParallel.check_sample(hugging_face, 2)


@pytest.fixture
def rank_0_of_2() -> ContextParallel:
    """Rank 0 of a cp group of 2, in this process (torch's fake process group: no collective runs)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield ContextParallel(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_buffers_are_cut_in_place_and_put_back_unless_kept(rank_0_of_2):
    """`maybe_context_parallel`'s buffers (torch's `context_parallel` semantics): each cut along its own
    sequence dimension to the rank's head-tail share for the body, then whole again, except those in
    `no_restore_buffers`; bad arguments are refused before any buffer changes."""
    cp = rank_0_of_2
    ids, labels = torch.arange(16).unsqueeze(0), torch.arange(32).view(2, 16).T.contiguous()
    with cp.cut_in_place([ids, labels], [1, 0], no_restore={ids}):
        assert ids.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] and labels.shape == (8, 2)
        assert labels[:, 0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert cp.positions(8, ids.device).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert cp.applies(training=False)  # evaluation inside the block runs on the share too
    assert ids.shape == (1, 8) and labels.equal(torch.arange(32).view(2, 16).T)
    assert cp.applies(training=True) and not cp.applies(training=False)  # outside: whole sequences
    whole = torch.arange(16).unsqueeze(0)
    with pytest.raises(ValueError, match="1 buffers but 2 buffer_seq_dims"), cp.cut_in_place([whole], [1, 1]):
        pass
    with (
        pytest.raises(ValueError, match="no_restore_buffers must be a subset of buffers"),
        cp.cut_in_place([whole], [1], no_restore={torch.zeros(1)}),
    ):
        pass
    with (
        pytest.raises(ValueError, match="sequences of 6 tokens do not split into 2 x cp_size = 4"),
        cp.cut_in_place([whole, torch.zeros(1, 6)], [1, 1]),
    ):
        pass
    assert whole.shape == (1, 16)  # untouched by the refusals
    with pytest.raises(RuntimeError, match="maybe_context_parallel"):
        cp.positions(16, whole.device)  # a model in training mode given whole sequences


def test_a_mask_over_tokens_before_kept_ones_is_refused_in_training(rank_0_of_2):
    """The gathered attention is causal over whole sequences and applies no padding mask (as Accelerate's
    context parallel drops it): right padding is harmless there, left padding or a gap is refused."""
    from runner.models.hf import causal_lm

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    model = causal_lm(vocab_size=32, config={"model_type": "llama", **sizes})
    share_model(model, rank_0_of_2)
    ids = torch.arange(16).unsqueeze(0)
    with rank_0_of_2.cut_in_place([ids], [1]):
        assert model(input_ids=ids, attention_mask=torch.tensor([[1] * 6 + [0] * 2])).logits.shape == (
            1,
            8,
            32,
        )
        with pytest.raises(ValueError, match="masks tokens that come before tokens it keeps"):
            model(input_ids=ids, attention_mask=torch.tensor([[0] * 2 + [1] * 6]))


def test_transformers_models_the_gathered_attention_cannot_serve_are_refused_saying_why():
    from runner.models.hf import causal_lm, sequence_classification

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1}
    assert share_problem(causal_lm(vocab_size=32, config={"model_type": "llama", **sizes})) is None
    mistral = causal_lm(vocab_size=32, config={"model_type": "mistral", **sizes})
    assert "attends within a sliding window (sliding_window=4096)" in share_problem(mistral)
    classifier = sequence_classification(vocab_size=32, num_labels=2, config={"model_type": "llama", **sizes})
    assert "is not a transformers causal language model" in share_problem(classifier)
    assert "does not declare context parallel" in share_problem(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="context parallel: Linear does not declare context parallel"):
        share_model(torch.nn.Linear(2, 2), None)  # as `prepare` under ParallelismConfig(cp_size=2) meets it


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_each_rank_trains_on_its_share_and_evaluates_whole_sequences(model_type):
    """runner's GPT (learned positions) and a transformers Llama (rotary positions, grouped-query
    attention through a registered attention implementation) alike."""
    results = rank_checks.run_ranks(
        rank_checks.context_parallel_shares, "fsdp_cp2_declared_units", model_type
    )
    expected = {0: [0, 1, 2, 3, 12, 13, 14, 15], 1: [4, 5, 6, 7, 8, 9, 10, 11]}
    for rank, result in results.items():
        assert result["train"] == {"length": 8, "positions": expected[rank]}
        assert result["eval"] == {"length": 16, "positions": list(range(16))}
        # The loss has the whole rows' value on every rank (its gradient is the rank's share's).
        assert result["loss"] == pytest.approx(result["reference"], abs=1e-6)
        assert result["eval_difference"] < 1e-5
        # Whole sequences in training mode (a loop that bypasses training_loss) are refused, not gathered.
        assert "got sequences of 16 tokens in training mode, not the share of 8" in result["uncut"]


@pytest.mark.slow
def test_checkpointed_and_compiled_blocks_recompute_their_share(tmp_path):
    """Activation checkpointing recomputes a block's forward during backward, outside `training_loss`: it
    must attend over the same share again (and the compiled blocks must keep the layout)."""
    reference = rank_checks.matrix_run("cpu", "no", str(tmp_path / "one"))
    result = rank_checks.run_ranks(
        rank_checks.matrix_run, "fsdp_cp2", "no", str(tmp_path / "cp"), "regional", "full"
    )[0]
    assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert result["after_load"] == result["continued"]


TRAIN = ("experiment=gpt_sonnets", "trainer.max_steps=12", "trainer.eval_every=6", "tracker=none")


@pytest.mark.slow
def test_context_parallel_from_the_command_line_trains_as_one_process(run_cli):
    single = run_cli(*TRAIN, "hardware.num_threads=1")
    assert single.returncode == 0, single.stderr
    cp = run_cli(*TRAIN, "hardware=fsdp", "hardware.num_processes=2", "hardware.cp_size=2")
    assert cp.returncode == 0, cp.stderr
    assert "layout: pp 1 x dp_replicate 1 x dp_shard 1 x cp 2 x tp 1" in cp.stderr
    for name, value in metrics_of(single).items():
        assert metrics_of(cp)[name] == pytest.approx(value, abs=1e-5), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["hardware.cp_size=2"],  # the default experiment's model
            "hardware.cp_size=2: MLP does not declare context parallel",
        ),
        (
            ["experiment=gpt_sonnets", "hardware.cp_size=2", "data.seq_len=30"],
            "hardware.cp_size=2: sequences of 30 tokens do not split into 2 x cp_size = 4 equal chunks",
        ),
        (
            ["experiment=gpt_sonnets", "hardware.cp_size=3"],
            "hardware.cp_size=3: the parallel degrees (pp_size x dp_replicate x dp_shard x cp_size x tp_size = 3 "
            "(dp_shard takes the rest of the ranks)) must multiply to the world size, 2 ranks",
        ),
        (["experiment=gpt_sonnets", "hardware.cp_size=0"], "hardware.cp_size=0: must be >= 1"),
        (
            [
                "experiment=gpt_sonnets",
                "hardware=tensor_parallel",
                "hardware.tp_size=1",
                "hardware.pp_size=2",
                "hardware.cp_size=2",
                "hardware.num_processes=4",
                "hardware.oversubscribe=true",
            ],
            "hardware.pp_size=2 with hardware.cp_size=2: context parallel is not built into the pipeline stages",
        ),
    ],
)
def test_what_context_parallel_cannot_do_is_refused_before_launch(forked_cli, overrides, message):
    proc = forked_cli("hardware=fsdp", "hardware.device=cpu", "hardware.num_processes=2", *overrides)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "starting" not in proc.stderr  # no rank was started


def test_the_plan_shows_the_cp_dimension_and_the_activations_it_splits(run_cli):
    plans = {
        cp: run_cli(
            "plan=true",
            "experiment=gpt_sonnets",
            "hardware=fsdp",
            "hardware.device=cpu",
            "hardware.num_processes=2",
            f"hardware.cp_size={cp}",
        )
        for cp in (1, 2)
    }
    for proc in plans.values():
        assert proc.returncode == 0, proc.stderr
    output = plans[2].stdout + plans[2].stderr
    assert (
        "pp 1 x dp_replicate 1 x dp_shard 1 x cp 2 x tp 1; rank:(pp,dp_replicate,dp_shard,cp,tp) "
        "0:(0,0,0,0,0) 1:(0,0,0,1,0)" in output
    )
    activations = {
        cp: float(re.search(r"activations +about ([0-9.]+) MB per device", proc.stdout + proc.stderr)[1])
        for cp, proc in plans.items()
    }
    assert activations[2] == pytest.approx(activations[1] / 2, rel=0.02)  # half of each sequence
