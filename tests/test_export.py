"""`runner export RUN_DIR --to hf OUT`: runner's GPT, trained on 2 FSDP ranks (DCP-sharded checkpoints) and
with DeepSpeed, written as a transformers GPT2LMHeadModel from its final model/ and from its checkpoints;
loaded by transformers, it computes the logits runner's model does. Bad input is refused before anything
is written."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from conftest import cli_env, run_to_end
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

from runner.checkpoint.weights import load_weights
from runner.errors import ConfigError
from runner.export import export_hf
from runner.models.gpt import GPT
from runner.models.gpt2_layout import as_gpt2

GPT_RUN = [
    "experiment=gpt_sonnets",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "data.batch_size=8",
    "trainer.max_steps=4",
    "trainer.checkpoint_every=2",
    "trainer.eval_every=0",
    "trainer.plots=false",
    "tracker=none",
]
RUNS = {
    # no biases, the head tied to the embedding; sharded (DCP) checkpoints
    "fsdp": ["hardware=fsdp", "hardware.num_processes=2", "model.bias=false"],
    # biases, an untied head; DeepSpeed's partitions
    "deepspeed": ["hardware=deepspeed", "hardware.num_processes=1", "model.tie_embeddings=false"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    for name, overrides in RUNS.items():
        run_to_end(root / name, *GPT_RUN, *overrides)
    return {name: root / name for name in RUNS}


def runners_model(run_dir: Path, weights: Path | None = None) -> GPT:
    """runner's GPT of the run, built from its resolved config, loaded from `weights` by runner."""
    settings = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["model"]
    settings = {k: v for k, v in settings.items() if k != "_target_"} | {"vocab_size": 256}
    model = GPT(**settings)
    if weights is not None:
        load_weights(model, weights)
    return model.eval()


def logits_difference(ours: GPT, exported: Path) -> float:
    theirs = AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(theirs) is GPT2LMHeadModel
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(ids) - theirs(ids).logits).abs().max().item()


def export(run_dir: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "export", str(run_dir), "--to", "hf", str(out), *flags],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "checkpoint", "described"),
    [
        ("fsdp", None, "final model"),
        ("fsdp", "checkpoint_0", "sharded, step 2"),
        ("fsdp", "checkpoint_1", "sharded, step 4"),
        ("deepspeed", "checkpoint_1", "deepspeed, step 4"),
    ],
)
def test_runners_gpt_exported_from_any_format_gives_runners_logits_in_transformers(
    runs, tmp_path, run, checkpoint, described
):
    run_dir = runs[run]
    source = run_dir / "checkpoints" / checkpoint if checkpoint else run_dir / "model"
    proc = export(run_dir, tmp_path / "hf", *(["--checkpoint", str(source)] if checkpoint else []))
    assert re.search(
        rf"wrote \S+hf: GPT2LMHeadModel, [\d,]+ parameters in float32, from {re.escape(str(source))} \({described}\)",
        proc.stdout,
    ), proc.stdout
    assert "tokenizer: none (the run's data is byte-level" in proc.stdout
    final = runners_model(run_dir, run_dir / "model")  # as runner loads the final weights
    if checkpoint == "checkpoint_0":  # step 2's state, read with DCP here
        early = runners_model(run_dir)
        state = {"model": early.state_dict()}
        dcp.load(state, checkpoint_id=source / "model_0")
        assert logits_difference(early, tmp_path / "hf") < 1e-5
        assert logits_difference(final, tmp_path / "hf") > 1e-3  # not the final state
    else:  # the checkpoint of the last step holds the final weights
        assert logits_difference(final, tmp_path / "hf") < 1e-5
    config = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config
    assert config.tie_word_embeddings == (run == "fsdp")
    assert (config.n_embd, config.n_layer, config.n_head, config.n_inner, config.n_positions) == (
        32,
        2,
        4,
        128,
        16,
    )


def test_the_layout_holds_for_every_gpt_setting(tmp_path):
    """No biases and biases, tied and untied, dropout: GPT-2 with the GPT's tensors computes its logits."""
    for bias, tie in [(True, True), (False, False), (False, True)]:
        torch.manual_seed(0)
        model = GPT(
            50,
            max_seq_len=12,
            d_model=24,
            n_layers=3,
            n_heads=3,
            mlp_ratio=2,
            dropout=0.1,
            bias=bias,
            tie_embeddings=tie,
        )
        with torch.no_grad():
            for parameter in model.parameters():  # LayerNorms and biases away from their init
                parameter.add_(torch.randn_like(parameter) * 0.1)
        out = tmp_path / f"{bias}-{tie}"
        as_gpt2(model).save_pretrained(out)
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert loaded.config.attn_pdrop == loaded.config.resid_pdrop == 0.1
        ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert (model.eval()(ids) - loaded.eval()(ids).logits).abs().max() < 1e-5
        assert loaded.config.tie_word_embeddings == tie
        assert (loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()) == tie


@pytest.mark.slow
def test_bad_input_is_refused_before_anything_is_written(runs, tmp_path):
    fsdp = runs["fsdp"]
    mlp, unsaved = tmp_path / "mlp", tmp_path / "unsaved"
    run_to_end(mlp, "trainer.max_steps=2", "tracker=none", "trainer.plots=false", "trainer.eval_every=0")
    run_to_end(
        unsaved, *GPT_RUN, "trainer.max_steps=1", "trainer.checkpoint_every=0", "trainer.save_model=false"
    )
    with pytest.raises(
        ConfigError, match=r"model \(runner.models.MLP, MLP\) has no transformers architecture"
    ):
        export_hf(mlp, tmp_path / "out")
    with pytest.raises(ConfigError, match="the run has no model/ and no checkpoint yet"):
        export_hf(unsaved, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"not a run's dir \(no runner.log in it\)"):
        export_hf(tmp_path, tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("")
    with pytest.raises(ConfigError, match=r"taken exists\. Give a new directory"):
        export_hf(fsdp, tmp_path / "taken")
    with pytest.raises(ConfigError, match=r"is not a tokenizer dir here .* --tokenizer DIR"):
        export_hf(fsdp, tmp_path / "out", tokenizer=tmp_path)
    other = runs["deepspeed"] / "checkpoints" / "checkpoint_1"  # biases the fsdp run's GPT does not have
    with pytest.raises(
        ConfigError, match=r"does not match GPT \(not in the model: .*bias.* a checkpoint of this run"
    ):
        export_hf(fsdp, tmp_path / "out", checkpoint=other)
    damaged = tmp_path / "damaged"
    shutil.copytree(runs["deepspeed"] / "checkpoints" / "checkpoint_1", damaged)
    state = next((damaged / "deepspeed" / "state").glob("*model_states.pt"))
    state.write_bytes(state.read_bytes()[:-10])
    with pytest.raises(ConfigError, match=r"damaged: deepspeed/state/\S+model_states.pt has \d+ bytes"):
        export_hf(runs["deepspeed"], tmp_path / "out", checkpoint=damaged)
    assert not (tmp_path / "out").exists()
