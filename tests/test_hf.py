"""Hugging Face models (the `hf` extra): a tiny transformers causal LM built from its config trains on every
hardware group that runs on CPU to the loss of one process; saved, it is dispatched over CPU memory and
disk and generates the tokens the in-memory model does."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_to_end
from transformers import AutoConfig, AutoModelForCausalLM

from runner.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
from runner.build import value_free_attention
from runner.errors import ConfigError
from runner.hardware.parallelize import declared_tp_plan, sharding_units
from runner.hardware.tensor_parallel import TensorParallel
from runner.models.decoder_stages import DecoderStage, is_decoder_lm
from runner.models.hf import causal_lm, sequence_classification
from runner.task import batch_targets, model_outputs
from runner.tasks import Classification, LanguageModeling

TINY = [
    "data=sonnets",
    "data.seq_len=32",
    "data.batch_size=8",
    "task=language_modeling",
    "model=hf_causal_lm",
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "optimizer.lr=1e-2",
    "trainer.max_steps=12",
    "scheduler=constant",
    "trainer.eval_every=0",
    "trainer.split_batches=true",  # the same global batches on 1 and 2 processes
    "trainer.progress_bar=false",
    "tracker=none",
]
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
HARDWARE = {
    "multi_gpu": ["hardware=ddp", "hardware.num_processes=2"],
    "fsdp": ["hardware=fsdp", "hardware.num_processes=2"],  # units: the model's LlamaDecoderLayer
    "deepspeed_zero3": ["hardware=deepspeed", "hardware.num_processes=2", "hardware.zero_stage=3"],
    "megatron_tp2": ["hardware=tensor_parallel", "hardware.num_processes=2", "hardware.tp_size=2"],  # its _tp_plan
    "fsdp_cp2": [  # each rank a share of every sequence: its attention over the gathered keys and values
        "hardware=fsdp",
        "hardware.num_processes=2",
        "hardware.cp_size=2",
    ],
    "megatron_pp2": [  # its decoder layers split into 2 stages (DecoderStage)
        "hardware=tensor_parallel",
        "hardware.num_processes=2",
        "hardware.tp_size=1",
        "hardware.pp_size=2",
    ],
}


def _train(run_dir: Path, *overrides: str) -> dict[str, float]:
    run_to_end(run_dir, *TINY, *overrides)
    return learned(run_dir)


def learned(run_dir: Path) -> dict[str, float]:
    """The run's metrics.json, but the `perf/*` measurements (timings differ from run to run)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {name: value for name, value in metrics.items() if not name.startswith("perf/")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process: the run the others must match; its saved model dir."""
    run_dir = tmp_path_factory.mktemp("hf") / "cpu"
    proc = run_to_end(run_dir, *TINY)
    (run_dir.parent / "console.txt").write_text(proc.stderr)
    return run_dir


@pytest.mark.slow
def test_the_console_shows_runners_lines_and_the_log_file_the_libraries_warnings(reference):
    """transformers imports torchao, which warns about kernels it cannot load, and torch about enums
    that torchao registers: those lines are the log file's, not the console's."""
    console = (reference.parent / "console.txt").read_text()
    library_warnings = re.findall(
        r"^\[[^]]*\]\[((?:torch|torchao|transformers|datasets)(?:\.[\w.]+)?)\]\[WARNING\] (.*)$",
        (reference / "runner.log").read_text(),
        flags=re.MULTILINE,
    )
    if not library_warnings:
        pytest.skip("no library warned in this environment (torchao is not installed or loads its kernels)")
    shown = [(name, message) for name, message in library_warnings if message[:60] in console]
    assert not shown, shown
    assert "training LlamaForCausalLM" in console  # runner's own lines are there


@pytest.mark.slow
@pytest.mark.parametrize("hardware", list(HARDWARE))
def test_a_transformers_model_trains_on_every_cpu_group_as_on_one_process(reference, tmp_path, hardware):
    expected = learned(reference)
    metrics = _train(tmp_path / hardware, *HARDWARE[hardware])
    assert expected["eval/loss"] < math.log(256) - 1  # it learned the sonnets' bytes
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-5, rel=1e-5), name  # loss, lr, perplexity


@pytest.mark.slow
def test_a_saved_transformers_model_dispatched_over_cpu_and_disk_generates_the_same_tokens(
    reference, tmp_path
):
    saved = reference / "model"
    assert (
        json.loads((saved / "config.json").read_text())["model_type"] == "llama"
    )  # from_pretrained loads it
    in_memory = AutoModelForCausalLM.from_pretrained(saved).eval()
    sharded = tmp_path / "sharded"
    in_memory.save_pretrained(sharded, max_shard_size="60KB")  # several files and an index, as on the Hub
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = torch.tensor([list(b"Shall I compare thee")])
    expected = in_memory.generate(prompt, max_new_tokens=12, do_sample=False)

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sharded))
    dispatched = load_checkpoint_and_dispatch(
        empty, sharded, device_map="auto", max_memory={"cpu": "100KB"}, offload_folder=tmp_path / "offload"
    )
    assert "disk" in dispatched.hf_device_map.values()  # part of it is read from disk as it runs
    assert torch.equal(dispatched.generate(prompt, max_new_tokens=12, do_sample=False), expected)

    # The same through the CLI: hardware=big_model on the sharded dir, greedy, streamed.
    proc = run_to_end(
        tmp_path / "generate",
        "data=sonnets",
        "task=generate",
        "task.temperature=0",
        "task.max_new_tokens=12",
        "task.prompt=Shall I compare thee",
        "model=hf_causal_lm",
        f"model.pretrained={sharded}",
        "model.load_weights=false",
        "hardware=big_model",
        "hardware.max_memory.cpu=100KB",
        f"checkpoint={sharded}",
        "tracker=none",
        "trainer.objective=null",
    )
    assert bytes(expected[0].tolist()).decode("utf-8", "replace") in proc.stdout
    assert "disk" in proc.stderr  # the placement it logged


@pytest.mark.slow
def test_training_goes_on_from_a_saved_models_dir(reference, tmp_path):
    trained = json.loads((reference / "metrics.json").read_text())["eval/loss"]
    metrics = _train(
        tmp_path / "more",
        f"model.pretrained={reference / 'model'}",
        "trainer.max_steps=1",
        "optimizer.lr=1e-5",
    )
    assert metrics["eval/loss"] == pytest.approx(trained, abs=0.05)  # from scratch it would be ~ln(256)


# transformers deprecates `past_key_values` of create_causal_mask (gone in 5.40): the stages use its new name
@pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")
def test_a_decoder_lm_splits_into_pipeline_stages_that_compute_its_logits():
    """Its stages, chained, give the model's logits; a padding mask is refused."""
    model = causal_lm(config=LLAMA | {"num_hidden_layers": 3}, vocab_size=50).eval()
    assert is_decoder_lm(model)
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    first, last = DecoderStage(model, range(0, 2), True, False), DecoderStage(model, range(2, 3), False, True)
    assert sorted(dict(last.named_parameters()))[:2] == [
        "lm_head.weight",
        "model.layers.2.input_layernorm.weight",
    ]
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), model(tokens).logits, rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="batches with padding"):
            first(
                input_ids=tokens, attention_mask=torch.ones_like(tokens).index_fill(1, torch.tensor([0]), 0)
            )


def test_the_model_declares_its_sharding_units_and_tensor_parallel_plan():
    model = causal_lm(vocab_size=50, config=LLAMA)
    assert sharding_units(model, None) == ["LlamaDecoderLayer"] and sharding_units(model, []) == []
    plan = declared_tp_plan(model, tp_size=2)
    assert {type(style).__name__ for style in plan.values()} == {"ColwiseParallel", "RowwiseParallel"}
    assert "model.layers.*.self_attn.o_proj" in plan
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        declared_tp_plan(model, tp_size=3)
    with pytest.raises(ConfigError, match=r"hardware\.tp_size: tp_size=3 does not divide"):
        TensorParallel(tp_size=3).check_model(model, world_size=3)
    with pytest.raises(ConfigError, match="sequence_parallel=true: LlamaForCausalLM's tensor-parallel plan"):
        TensorParallel(tp_size=2, sequence_parallel=True).check_model(model, world_size=2)
    gpt2 = causal_lm(vocab_size=50, config={"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4})
    with pytest.raises(ConfigError, match="GPT2LMHeadModel declares no tensor-parallel plan"):
        TensorParallel(tp_size=2).check_model(gpt2, world_size=2)


def test_transformers_batches_and_outputs_reach_the_tasks():
    torch.manual_seed(0)
    lm = causal_lm(vocab_size=50, config=LLAMA)
    ids = torch.randint(0, 50, (2, 10))
    hf_batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss = LanguageModeling().training_step(lm, hf_batch).item()
    assert loss == pytest.approx(lm(input_ids=ids, labels=ids).loss.item(), rel=1e-6)  # transformers' own
    classifier = sequence_classification(vocab_size=50, num_labels=3, config=LLAMA | {"pad_token_id": 0})
    labelled = {"input_ids": ids, "labels": torch.tensor([0, 2])}
    assert model_outputs(classifier, labelled).shape == (2, 3)
    assert Classification().evaluation_step(classifier, labelled)["accuracy"].shape == (2,)
    mlp = torch.nn.Linear(4, 3)
    pair = (torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))  # a tuple batch
    assert torch.equal(batch_targets(pair), pair[1])
    assert Classification().training_step(mlp, pair).ndim == 0


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"config": LLAMA | {"hiden_size": 32}},
            "model.config.hiden_size: not a setting of LlamaConfig; did you mean model.config.hidden_size",
        ),
        (
            {"config": LLAMA, "attention_dropot": 0.1},
            "model.attention_dropot: not a setting of LlamaConfig; did you mean model.attention_dropout",
        ),
        (
            {"config": {"model_type": "lama"}},
            "model.config.model_type='lama': not a transformers model type; did you mean",
        ),
        ({"config": None}, "model.config.model_type"),
        (
            {"config": LLAMA | {"num_key_value_heads": 3}},
            "model.config.num_key_value_heads=3 must divide model.config.num_attention_heads=4",
        ),
        ({"config": LLAMA | {"hidden_size": -1}}, "model.config.hidden_size=-1: must be >= 1."),
        (
            {"config": LLAMA | {"hidden_size": 66}},
            "model.config: transformers refuses this llama config (Class validation error",
        ),
        ({"pretrained": "no/such/dir"}, "not a model directory (no config.json"),
    ],
)
def test_transformers_settings_that_would_be_ignored_or_fail_are_refused(settings, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        causal_lm(vocab_size=50, **settings)


def test_pretrained_weights_that_are_missing_or_cut_short_are_refused_in_the_checks_on_meta(tmp_path):
    """The launch builds the model on meta: the weights' files are checked there (headers and sizes), so a
    missing or truncated file is named before any rank starts, not when a rank loads it."""
    whole = tmp_path / "whole"
    config = {key: value for key, value in LLAMA.items() if key != "model_type"} | {"num_hidden_layers": 1}
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=50, **config)).save_pretrained(
        whole
    )
    cut, bare = tmp_path / "cut", tmp_path / "bare"
    shutil.copytree(whole, cut)
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    bare.mkdir()
    shutil.copy(whole / "config.json", bare)
    with torch.device("meta"):
        causal_lm(pretrained=str(whole), vocab_size=50)
        with pytest.raises(
            ConfigError, match=re.escape(f"{cut / 'model.safetensors'} is not a whole safetensors file")
        ):
            causal_lm(pretrained=str(cut), vocab_size=50)
        with pytest.raises(ConfigError, match=re.escape(f"{bare} holds no model.safetensors")):
            causal_lm(pretrained=str(bare), vocab_size=50)
        causal_lm(pretrained=str(bare), load_weights=False, vocab_size=50)  # the architecture only


def test_a_transformers_step_runs_on_meta_so_layout_mistakes_are_found_before_launch():
    """transformers' SDPA attention asks whether the padding mask is all ones, which meta tensors cannot
    answer: the step on meta (the launch's check and the FLOP count) runs the eager attention instead."""
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    mask, labels = torch.ones_like(ids), torch.zeros(2, dtype=torch.long, device="meta")
    with torch.device("meta"):
        model = sequence_classification(vocab_size=50, num_labels=2, config=LLAMA | {"pad_token_id": 0})
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with pytest.raises(RuntimeError, match="meta"):
        Classification().training_step(model, batch)
    with value_free_attention(model):
        assert Classification().training_step(model, batch).shape == ()
    assert model.config._attn_implementation == "sdpa"  # restored
    with value_free_attention(model), pytest.raises(ValueError, match="to match target batch_size"):  # a mistake
        Classification().training_step(model, batch | {"input_ids": ids[:1]})


def test_a_sequence_longer_than_the_models_learned_positions_is_refused_by_its_shape():
    """GPT-2 with `n_positions=8` on sequences of 16: the step on meta (the checks before launch) fails
    naming the key and both ways out, and so does a real step, instead of an IndexError inside the
    embedding; a model with rotary positions (Llama) has no such limit."""
    gpt2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 8}
    expected = re.escape("16 tokens long, and the model has 8 learned positions (GPT2Config.n_positions=8)")
    for device in ("meta", "cpu"):
        ids = torch.zeros(2, 16, dtype=torch.long, device=device)
        with torch.device(device):
            model = causal_lm(vocab_size=50, config=gpt2)
            llama = causal_lm(vocab_size=50, config=LLAMA | {"max_position_embeddings": 8})
        with value_free_attention(model), pytest.raises(ValueError, match=expected):
            LanguageModeling().training_step(model, {"input_ids": ids, "labels": ids})
        assert (
            LanguageModeling().training_step(model, {"input_ids": ids[:, :8], "labels": ids[:, :8]}).shape
            == ()
        )
        with value_free_attention(llama):
            assert LanguageModeling().training_step(llama, {"input_ids": ids, "labels": ids}).shape == ()
