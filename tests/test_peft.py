"""PEFT adapters (`model/peft=lora`, the `peft` extra) on a tiny transformers Llama saved locally: the run
trains the adapter only, its loss curve is a plain PEFT loop's, its checkpoints hold what it trains and
resume bitwise, FSDP2 and DeepSpeed train it as one process does, its final dir is PEFT's (or merged), and
bad settings are refused before launch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import run_to_end
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

import runner.data
from runner.checkpoint.formats import model_shapes
from runner.errors import ConfigError
from runner.models.adapters import adapter_config
from runner.models.hf import causal_lm, sequence_classification

TESTS = Path(__file__).parent
STEPS = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny Llama with random weights, saved as a local pretrained model."""
    directory = tmp_path_factory.mktemp("peft") / "tiny_llama"
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def lora_run(base: Path, *overrides: str) -> list[str]:
    return [
        "data=sonnets",
        "data.seq_len=32",
        "data.batch_size=8",
        "task=language_modeling",
        "model=hf_causal_lm",
        f"model.pretrained={base}",
        "model/peft=lora",
        "model.peft.r=4",
        "model.peft.target_modules=[q_proj,v_proj]",
        "optimizer.lr=1e-2",
        "scheduler=constant",
        f"trainer.max_steps={STEPS}",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.split_batches=true",  # the same global batches on 1 and 2 processes
        *overrides,
    ]


def losses(run_dir: Path) -> list[float]:
    """The loss of each step the run logged."""
    lines = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    return [line["train/loss"] for line in lines if "train/loss" in line]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights at the run's end (probes.FinalWeights), frozen ones included."""
    return load_file(run_dir / "final_weights.safetensors")


def record_final_weights(run_dir: Path) -> str:
    return f"+callbacks.final_weights={{_target_: probes.FinalWeights, path: {run_dir}/final_weights.safetensors}}"


@pytest.fixture(scope="module")
def one_process(base, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora") / "one"
    run_to_end(
        run_dir,
        *lora_run(base, "trainer.checkpoint_every=4", record_final_weights(run_dir)),
        pythonpath=TESTS,
    )
    return run_dir


def plain_peft_losses(base: Path) -> list[float]:
    """The same training written with PEFT and a plain loop: the model, its adapter, AdamW over what
    requires grad, runner's data source for the same batches."""
    torch.manual_seed(0)  # trainer.seed
    data = runner.data.sonnets(seq_len=32, batch_size=8)
    data.setup()
    model = AutoModelForCausalLM.from_pretrained(base)
    model = peft.get_peft_model(
        model, peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999)
    )
    model.train()
    curve = []
    for batch, _ in zip(data.train_dataloader(seed=0), range(STEPS), strict=False):
        logits = model(batch["inputs"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(loss.item())
    return curve


@pytest.mark.slow
def test_lora_trains_the_adapter_only_as_a_plain_peft_loop_does(base, one_process):
    assert losses(one_process) == pytest.approx(plain_peft_losses(base), abs=1e-5)
    trained = final_weights(one_process)
    pretrained = load_file(base / "model.safetensors")
    frozen = {name: t for name, t in trained.items() if "lora_" not in name}
    assert len(frozen) == len(pretrained)
    for name, tensor in frozen.items():  # base_model.model.<its name>, the adapted ones as <name>.base_layer
        original = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(tensor, pretrained[original]), name
    lora_b = [t for name, t in trained.items() if "lora_B" in name]
    assert len(lora_b) == 2 * 2 and all(t.abs().sum() > 0 for t in lora_b)  # q and v of 2 layers; from zeros
    log = (one_process / "runner.log").read_text()
    assert "PeftModelForCausalLM (" in log and " trained)" in log


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (  # PEFT's own refusal, with the names to choose from
            ["model.peft.target_modules=[query]"],
            r"model\.peft: .*query.* The model's modules are named: .*q_proj.*v_proj",
        ),
        (
            ["+model.peft.lora_alpah=8"],
            r"model\.peft\.lora_alpah: not a setting of PEFT's LoraConfig; did you mean model\.peft\.lora_alpha\?",
        ),
        (["model.peft.method=lorra"], r"model\.peft\.method='lorra': not a PEFT method; did you mean lora\?"),
        (
            ["model.peft.method=prefix_tuning"],
            r"model\.peft\.method='prefix_tuning': a prompt-learning method",
        ),
    ],
)
def test_adapter_settings_that_peft_would_refuse_or_ignore_are_refused_before_launch(
    base, forked_cli, overrides, expected
):
    proc = forked_cli(*lora_run(base, *overrides))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(expected, proc.stderr), proc.stderr[-2000:]
    assert not (proc.run_dir / "resolved_config.yaml").exists()


def test_an_adapter_on_runners_own_models_names_the_models_that_take_one(forked_cli):
    proc = forked_cli("model=gpt", "+model/peft=lora", "data=sonnets", "task=language_modeling")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.peft: runner.models.GPT trains every weight it has" in proc.stderr
    assert "model=hf_causal_lm" in proc.stderr


def test_the_adapter_method_and_its_settings_reach_pefts_config(base):
    lora = adapter_config(
        {"method": "lora", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}, "CAUSAL_LM"
    )
    assert (type(lora).__name__, lora.r, lora.lora_alpha, lora.target_modules) == (
        "LoraConfig",
        2,
        4,
        {"q_proj"},
    )
    ia3 = causal_lm(
        pretrained=str(base), peft={"method": "ia3", "target_modules": ["k_proj"], "feedforward_modules": []}
    )
    trained = [name for name, p in ia3.named_parameters() if p.requires_grad]
    assert trained and all("ia3_l" in name and "k_proj" in name for name in trained)
    with pytest.raises(ConfigError, match=r"model\.peft: .*r.* should be a positive integer"):
        causal_lm(pretrained=str(base), peft={"method": "lora", "r": 0})


@pytest.mark.slow
def test_a_checkpoint_holds_the_adapter_and_its_optimizer_state_and_resumes_bitwise(
    base, one_process, tmp_path
):
    checkpoint = one_process / "checkpoints" / "checkpoint_0"  # at step 4 of 8
    stored = load_file(checkpoint / "model_0.safetensors")
    assert stored and all("lora_" in name for name in stored)  # the frozen base is the build's
    optimizer = torch.load(checkpoint / "optimizer_0.pt", weights_only=True)
    assert len(optimizer["state"]) == len(stored)  # a state per adapter tensor only
    resumed = tmp_path / "resumed"
    run_to_end(
        resumed,
        *lora_run(base, f"trainer.resume={checkpoint}", record_final_weights(resumed)),
        pythonpath=TESTS,
    )
    assert losses(resumed) == losses(one_process)[4:]
    expected, got = final_weights(one_process), final_weights(resumed)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "hardware",
    [
        ["hardware=ddp", "hardware.num_processes=2"],  # DDP reduces the adapter's gradients only
        ["hardware=fsdp", "hardware.num_processes=2"],  # the frozen base sharded, the adapter trained
        ["hardware=deepspeed", "hardware.num_processes=2", "hardware.zero_stage=3"],
    ],
    ids=["ddp", "fsdp", "deepspeed_zero3"],
)
def test_a_sharded_lora_run_on_two_ranks_trains_as_one_process_and_resumes_from_its_adapter(
    base, one_process, tmp_path, hardware
):
    run_dir = tmp_path / "two"
    run_to_end(
        run_dir,
        *lora_run(base, "trainer.checkpoint_every=4", *hardware, record_final_weights(run_dir)),
        pythonpath=TESTS,
    )
    assert losses(run_dir) == pytest.approx(losses(one_process), abs=1e-5)
    expected, got = final_weights(one_process), final_weights(run_dir)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.allclose(got[name], tensor, atol=1e-5), name
    adapter = load_file(run_dir / "model" / "adapter_model.safetensors")  # gathered, in PEFT's layout
    for name, tensor in load_file(one_process / "model" / "adapter_model.safetensors").items():
        assert torch.allclose(adapter[name], tensor, atol=1e-5), name
    checkpoint = run_dir / "checkpoints" / "checkpoint_0"
    names = checkpoint_names(checkpoint, hardware[0])
    assert names and all("lora_" in name for name in names)  # the frozen base is the build's
    resumed = tmp_path / "resumed"
    resume = [f"trainer.resume={checkpoint}", *hardware, record_final_weights(resumed)]
    run_to_end(resumed, *lora_run(base, *resume), pythonpath=TESTS)
    assert losses(resumed) == losses(run_dir)[4:]
    assert all(torch.equal(final_weights(resumed)[name], t) for name, t in got.items())


def checkpoint_names(checkpoint: Path, hardware: str) -> list[str]:
    """The tensors a checkpoint holds: the "full" format's weights file, DCP's model and optimizer
    metadata, DeepSpeed's module state."""
    if hardware == "hardware=ddp":  # the "full" format: the main process's file
        return list(load_file(checkpoint / "model_0.safetensors"))
    if hardware == "hardware=fsdp":
        names = list(model_shapes(checkpoint, "sharded"))
        optimizer = dcp.FileSystemReader(checkpoint / "optimizer_0").read_metadata().state_dict_metadata
        return names + [name for name in optimizer if name.startswith("optimizer.state.")]
    state = checkpoint / "deepspeed" / "state"
    return [
        name
        for path in state.rglob("*model_states.pt")
        for name in torch.load(path, weights_only=False)["module"]
    ]


def eval_loss(model: torch.nn.Module) -> float:
    """runner's eval loss of `model` on the sonnets' held-out sequences: each sequence's mean token loss,
    averaged."""
    data = runner.data.sonnets(seq_len=32, batch_size=8)
    data.setup()
    per_sequence = []
    with torch.no_grad():
        for batch in data.eval_dataloader():
            logits = model(batch["inputs"]).logits
            per_sequence.append(
                F.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none").mean(-1)
            )
    return torch.cat(per_sequence).mean().item()


@pytest.mark.slow
def test_the_final_dir_is_pefts_adapter_or_with_merge_the_merged_model(base, one_process, tmp_path):
    saved = one_process / "model"
    assert (saved / "adapter_config.json").is_file() and not (saved / "config.json").exists()
    adapter = load_file(saved / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), saved).eval()
    metrics = json.loads((one_process / "metrics.json").read_text())
    assert eval_loss(loaded) == pytest.approx(metrics["eval/loss"], abs=1e-5)

    merged_run = tmp_path / "merged"
    run_to_end(merged_run, *lora_run(base, "model.peft.merge=true"))
    merged = AutoModelForCausalLM.from_pretrained(merged_run / "model").eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, loaded(tokens).logits, atol=1e-5, rtol=1e-5)


def test_the_plan_shows_what_trains_and_the_memory_of_its_gradients_and_optimizer_state(base, forked_cli):
    def plan(overrides: list[str]) -> dict[str, str]:
        proc = forked_cli(*overrides, "plan=true")
        assert proc.returncode == 0, proc.stderr[-2000:]
        return dict(re.findall(r"^  (model|memory/device) +(.*)$", proc.stdout + proc.stderr, re.MULTILINE))

    lora = plan(lora_run(base))
    full = plan([override for override in lora_run(base) if "peft" not in override])
    assert full["model"].endswith(" parameters") and "frozen" not in full["model"]
    assert re.search(r", 1\.02K trained \(PeftModelForCausalLM: the others frozen\)$", lora["model"]), lora[
        "model"
    ]
    gradients = [
        float(re.search(r"gradients ([\d.]+) MB", p["memory/device"]).group(1)) for p in (full, lora)
    ]
    assert gradients[1] < gradients[0] / 10


def test_exporting_an_adapter_run_says_how_its_model_dir_loads_and_how_to_merge(one_process, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "export", str(one_process), "--to", "hf", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trained a PEFT adapter (model.peft)" in proc.stderr and "model.peft.merge=true" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_sequence_classifier_trains_its_head_whole_beside_the_adapter():
    model = sequence_classification(
        config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 4, "pad_token_id": 0},
        vocab_size=64, num_labels=3, peft={"method": "lora", "r": 2, "target_modules": ["q_proj"]},
    )  # fmt: skip
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("score" in name for name in trained) and any("lora_A" in name for name in trained)
    assert not any("embed_tokens" in name or "mlp" in name for name in trained)
