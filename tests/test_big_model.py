"""Big model inference: empty init, device maps, CPU and disk offload, load_checkpoint_and_dispatch, against
the same model fully loaded; bad checkpoints and maps refused with nothing loaded."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_env
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner import (
    Accelerator,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    skip_first_batches,
)
from runner.checkpoint.weights import save_model_files
from runner.cli.estimate_memory import main as estimate_memory
from runner.hardware.big_modeling import UserCpuOffloadHook, compute_module_sizes
from runner.models import GPT

SIZE = {"vocab_size": 97, "max_seq_len": 32, "d_model": 64, "n_layers": 4, "n_heads": 4}


def empty_gpt(**changes) -> GPT:
    with init_empty_weights():
        return GPT(**{**SIZE, **changes})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A GPT, its outputs on a batch, and its weights saved as sharded safetensors and as torch files."""
    torch.manual_seed(0)
    model = GPT(**SIZE).eval()
    root = tmp_path_factory.mktemp("checkpoints")
    save_model_files(model.state_dict(), root / "sharded", max_shard_size="60KB")
    save_model_files(model.state_dict(), root / "torch", max_shard_size="60KB", safe_serialization=False)
    inputs = torch.randint(0, SIZE["vocab_size"], (3, 20))
    with torch.no_grad():
        expected = model(inputs)
    return model, inputs, expected, root


def test_init_empty_weights_puts_parameters_on_meta_and_keeps_ties_and_buffers():
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

    model = empty_gpt()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.lm_head.weight is model.tok_emb.weight
    with init_empty_weights():
        kept = WithBuffer()
    with init_empty_weights(include_buffers=True):
        emptied = WithBuffer()
    assert kept.linear.weight.is_meta and kept.scale.device.type == "cpu"
    assert emptied.scale.is_meta
    with init_on_device("cpu"):
        assert WithBuffer().linear.weight.device.type == "cpu"


def test_building_empty_skips_the_initialisation_of_meta_tensors_only():
    """A model built empty runs no init kernel on its meta weights (some import torch._dynamo: 75 MB and a
    second, most of what loading held above the model's size); tensors that stay real keep their values."""

    class RandomBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            nn.init.trunc_normal_(self.linear.weight)
            self.register_buffer("noise", torch.empty(4).normal_())

    torch.manual_seed(0)
    with init_empty_weights():
        kept = RandomBuffer()
    torch.manual_seed(0)  # the meta weights drew nothing: the buffer got the first numbers
    assert kept.linear.weight.is_meta and torch.equal(kept.noise, torch.empty(4).normal_())
    build = (
        "import sys; from runner import init_empty_weights; from runner.models import GPT\n"
        "with init_empty_weights():\n"
        "    model = GPT(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=2)\n"
        "assert all(p.is_meta for p in model.parameters())\n"
        "print('torch._dynamo' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_auto_map_fills_memory_in_order_keeps_no_split_modules_whole_and_leaves_room_to_run():
    model = empty_gpt()
    sizes = compute_module_sizes(model)
    assert infer_auto_device_map(model, {"cpu": sizes[""]}) == {"": "cpu"}
    block = sizes["blocks.0"]
    budget = sizes["tok_emb"] + sizes["pos_emb"] + 2 * block + block  # 2 blocks, plus room for one to run
    device_map = infer_auto_device_map(model, {"cpu": budget}, no_split_module_classes=["Block"])
    assert device_map == {
        "tok_emb": "cpu", "pos_emb": "cpu", "drop": "cpu", "blocks.0": "cpu", "blocks.1": "cpu",
        "blocks.2": "disk", "blocks.3": "disk", "ln_f": "disk", "lm_head": "disk",
    }  # fmt: skip
    split = infer_auto_device_map(model, {"cpu": budget})  # Blocks may be split: the last cpu one is
    assert any(name.startswith("blocks.2.") for name in split)
    with pytest.raises(ValueError, match=r"largest module that cannot be split, 'blocks.\d' \("):
        infer_auto_device_map(model, {"cpu": block // 2}, no_split_module_classes=["Block"])


@pytest.mark.parametrize("files", ["sharded", "torch"])
@pytest.mark.parametrize(
    ("device_map", "max_memory", "on_disk"),
    [
        ("auto", None, []),
        ("sequential", {"cpu": "400KB"}, ["blocks", "ln_f", "lm_head"]),
        ({"": "disk"}, None, [""]),
        ({"blocks": "disk", "": "cpu"}, None, ["blocks"]),
    ],
)
def test_dispatched_outputs_equal_the_fully_loaded_model(
    trained, tmp_path, files, device_map, max_memory, on_disk
):
    _, inputs, expected, root = trained
    model = load_checkpoint_and_dispatch(
        empty_gpt(),
        root / files,
        device_map=device_map,
        max_memory=max_memory,
        no_split_module_classes=["Block"],
        offload_folder=tmp_path / "offload",
    )
    with torch.no_grad():
        assert torch.equal(model(inputs), expected)
        assert torch.equal(model(inputs), expected)  # offloaded weights come back each time
    assert [name for name, device in model.hf_device_map.items() if device == "disk"] == on_disk
    for name in on_disk:  # their weights are not kept in memory between forwards: lm_head's is tok_emb's
        in_memory = {id(p) for p in model.get_submodule(name).parameters() if not p.is_meta}
        assert in_memory <= {id(model.tok_emb.weight)}, name
    assert model.lm_head.weight is model.tok_emb.weight  # the tie survives dispatch, wherever lm_head is


def test_dtype_loads_weights_converted_wherever_they_are(trained, tmp_path):
    model, inputs, _, root = trained
    expected = copy.deepcopy(model).to(torch.bfloat16)(inputs)  # the shared model stays fp32
    for device_map in ("auto", {"": "disk"}):
        loaded = load_checkpoint_and_dispatch(
            empty_gpt(), root / "sharded", device_map=device_map, offload_folder=tmp_path, dtype="bfloat16"
        )
        with torch.no_grad():
            assert torch.equal(loaded(inputs), expected)


def test_load_then_dispatch_separately_as_accelerate_does(trained, tmp_path):
    _, inputs, expected, root = trained
    model = empty_gpt()
    device_map = {"tok_emb": "cpu", "pos_emb": "cpu", "blocks": "disk", "ln_f": "cpu", "lm_head": "cpu"}
    load_checkpoint_in_model(model, root / "sharded", device_map=device_map, offload_folder=tmp_path)
    model = dispatch_model(model, device_map, offload_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(inputs), expected)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_layers": 3}, r"not in the model: blocks.3.attn.k_proj.bias"),
        ({"n_layers": 5}, r"missing from the checkpoint: blocks.4.ln_1.weight"),
        ({"vocab_size": 98}, r"with another shape: tok_emb.weight \(97, 64\) \(the model has \(98, 64\)\)"),
    ],
)
def test_a_checkpoint_that_does_not_match_names_the_keys_and_loads_nothing(trained, changes, message):
    model = empty_gpt(**changes)
    with pytest.raises(ValueError, match=message):
        load_checkpoint_and_dispatch(model, trained[3] / "sharded", device_map="auto", strict=True)
    assert all(p.is_meta for p in model.parameters())  # nothing half-loaded


def test_by_default_keys_on_one_side_only_are_a_warning_and_the_rest_loads(trained, caplog):
    model = empty_gpt(n_layers=3)  # the checkpoint has a fourth block
    load_checkpoint_in_model(model, trained[3] / "sharded")
    assert "not in the model: blocks.3.attn.k_proj.bias" in caplog.text
    assert torch.equal(model.blocks[2].mlp.fc_in.weight, trained[0].blocks[2].mlp.fc_in.weight)
    with pytest.raises(ValueError, match="with another shape"):  # a shape is never loaded past
        load_checkpoint_in_model(empty_gpt(vocab_size=98), trained[3] / "sharded")


def test_keep_in_fp32_modules_keeps_those_modules_out_of_dtype(trained):
    model = empty_gpt()
    load_checkpoint_in_model(
        model, trained[3] / "sharded", dtype=torch.bfloat16, keep_in_fp32_modules=["ln_1"]
    )
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert (
        dtypes["blocks.0.ln_1.weight"] == torch.float32 and dtypes["blocks.0.ln_2.weight"] == torch.bfloat16
    )
    assert dtypes["blocks.3.attn.q_proj.weight"] == torch.bfloat16


@pytest.mark.parametrize(
    ("device_map", "message"),
    [
        (
            {"": "cuda:3"},
            r"device_map\[''\] names device 'cuda:3', which this machine does not have. Devices here: ",
        ),
        ({"blocks": "cpu"}, r"device_map does not place tok_emb.weight"),
        (
            {"blockz": "cpu", "": "cpu"},
            r"'blockz', which is not a module or tensor of the model. Did you mean 'blocks'",
        ),
        ("fastest", r"device_map='fastest': expected one of"),
    ],
)
def test_a_device_map_that_cannot_be_followed_is_refused_before_loading(trained, device_map, message):
    model = empty_gpt()
    with pytest.raises(ValueError, match=message):
        load_checkpoint_and_dispatch(model, trained[3] / "sharded", device_map=device_map)
    assert all(p.is_meta for p in model.parameters())


def test_max_memory_naming_a_missing_device_or_too_small_is_refused(trained):
    with pytest.raises(ValueError, match="max_memory names device 3"):
        load_checkpoint_and_dispatch(
            empty_gpt(), trained[3] / "sharded", device_map="auto", max_memory={3: "1GB"}
        )
    with pytest.raises(ValueError, match="Raise max_memory\\['cpu'\\] to at least"):
        load_checkpoint_and_dispatch(
            empty_gpt(), trained[3] / "sharded", max_memory={"cpu": "10KB"}, device_map="auto",
            no_split_module_classes=["Block"],
        )  # fmt: skip


def test_disk_placement_without_an_offload_folder_is_refused(trained):
    with pytest.raises(ValueError, match="pass an offload_folder"):
        load_checkpoint_in_model(empty_gpt(), trained[3] / "sharded", device_map={"": "disk"})


def test_estimate_memory_counts_states_per_device_for_each_hardware_group(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # the ZeRO rows need no DeepSpeed installed
    estimate_memory(["experiment=gpt_sonnets", "--num-processes", "4"])
    report = capsys.readouterr().out
    with init_empty_weights():
        parameters = sum(
            p.numel() for p in GPT(vocab_size=256, max_seq_len=64, d_model=96, n_layers=2).parameters()
        )
    assert f"{parameters / 1e6:.2f}M parameters" in report and "4 devices" in report
    rows = {tuple(line.split()[:2]): line.split() for line in report.splitlines()[3:] if line.strip()}
    mb = parameters * 4 / 2**20
    # AdamW, float32: weights + gradients + 2 moments = 16 bytes per parameter on every DDP rank.
    assert float(rows["float32", "DDP"][-2]) == pytest.approx(4 * mb, abs=0.1)
    assert float(rows["float32", "FSDP"][-2]) == pytest.approx(mb, abs=0.1)  # everything / 4
    assert float(rows["float32", "ZeRO-1"][-2]) == pytest.approx(2 * mb + 2 * mb / 4, abs=0.1)
    assert float(rows["float32", "ZeRO-2"][-2]) == pytest.approx(mb + 3 * mb / 4, abs=0.1)
    assert float(rows["bfloat16", "inference"][-2]) == pytest.approx(mb / 2, abs=0.1)


@pytest.fixture(scope="module")
def sonnets_model(tmp_path_factory):
    """A GPT that `python -m runner experiment=gpt_sonnets` trained and saved."""
    run_dir = tmp_path_factory.mktemp("gpt_sonnets")
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "experiment=gpt_sonnets", "trainer.max_steps=30", "trainer.progress_bar=false", "trainer.plots=false",
         f"hydra.run.dir={run_dir}"],
        env=cli_env(), cwd=run_dir, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return run_dir / "model"


GENERATE = ["experiment=gpt_generate", "task.max_new_tokens=40", "task.prompt=Shall I"]


@pytest.mark.slow
def test_generate_streams_the_same_text_with_weights_in_memory_or_on_disk(run_cli, sonnets_model):
    in_memory = run_cli(*GENERATE, f"checkpoint={sonnets_model}")
    assert in_memory.returncode == 0, in_memory.stderr
    assert "placement (all): cpu" in in_memory.stderr
    assert in_memory.stdout.startswith("Shall I") and len(in_memory.stdout.strip()) > len("Shall I") + 20
    assert "generate/tokens_per_s" in in_memory.stderr
    offloaded = run_cli(*GENERATE, f"checkpoint={sonnets_model}", "hardware.max_memory.cpu=600KB")
    assert offloaded.returncode == 0, offloaded.stderr
    assert "blocks: disk" in offloaded.stderr and (offloaded.run_dir / "offload" / "index.json").exists()
    assert offloaded.stdout == in_memory.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], "checkpoint: an inference task needs the weights to run. Set checkpoint="),
        (["checkpoint=nowhere"], "checkpoint=nowhere: no such file or directory"),
        (
            ["checkpoint={model}", "model.d_model=64"],
            "does not match GPT (with another shape: tok_emb.weight (256, 96) (the model has (256, 64))",
        ),
        (
            ["checkpoint={model}", "hardware.max_memory.cpu=100KB"],
            "less than the largest module that cannot be split, 'blocks.",
        ),
        (
            ["checkpoint={model}", "+hardware.max_memory.3=1GB"],
            "hardware.max_memory names device '3', which this machine does not have",
        ),
        (
            ["checkpoint={model}", "hardware.device_map=fastest"],
            "hardware.device_map='fastest': expected one of auto",
        ),
        (["checkpoint={model}", "hardware=single_device"], "is an inference task: it runs with hardware=big_model"),
    ],
)
def test_bad_generate_input_is_one_paragraph_and_exit_2(forked_cli, sonnets_model, overrides, message):
    proc = forked_cli(*GENERATE, *(o.format(model=sonnets_model) for o in overrides))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not proc.stdout  # nothing generated


@pytest.mark.slow
def test_training_starts_from_checkpoint_weights_and_big_model_hardware_cannot_train(run_cli, sonnets_model):
    proc = run_cli("experiment=gpt_sonnets", "trainer.max_steps=1", f"checkpoint={sonnets_model}")
    assert proc.returncode == 0, proc.stderr
    assert f"weights from {sonnets_model}" in (proc.run_dir / "runner.log").read_text()
    refused = run_cli("experiment=gpt_sonnets", "hardware=big_model")
    assert refused.returncode == 2
    assert "hardware=big_model places a model for inference" in refused.stderr


@pytest.mark.slow
def test_loading_peaks_at_the_model_size_and_disk_offload_at_a_third_of_it():
    """The memory targets, measured by benchmarks/big_model_load.py on its ~1 GB model (peak resident memory
    over loading and one forward; not time)."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/big_model_load.py", "--methods", "plain,runner_auto,runner_disk75"],
        cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {
        line.split()[0]: line.split()
        for line in proc.stdout.splitlines()
        if line.startswith(("plain", "runner"))
    }
    peak = {method: float(row[1].rstrip("x")) for method, row in rows.items()}
    assert all(row[-1] == "identical" for row in rows.values()), proc.stdout
    assert peak["plain"] > 1.8, proc.stdout  # construct, then a second copy to load from
    assert peak["runner_auto"] <= 1.05, proc.stdout  # 1.02x measured: the weights and one forward
    assert peak["runner_disk75"] <= 0.5 and int(rows["runner_disk75"][-2]) > 0, proc.stdout


def test_disk_offload_keeps_no_weight_in_memory_and_computes_the_same(trained, tmp_path):
    model = copy.deepcopy(trained[0])
    disk_offload(model, tmp_path / "offload", execution_device="cpu")
    assert all(p.is_meta for p in model.parameters()) and (tmp_path / "offload" / "index.json").is_file()
    with torch.no_grad():
        assert torch.equal(model(trained[1]), trained[2])
    assert all(p.is_meta for p in model.parameters())  # loaded for the forward only


def test_cpu_offload_computes_the_same(trained):
    model = cpu_offload(copy.deepcopy(trained[0]), execution_device="cpu")
    with torch.no_grad():
        assert torch.equal(model(trained[1]), trained[2])


class UsesChildWeight(nn.Module):
    """Computes with its child's weight without calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.child.weight, self.child.bias)


def test_preload_module_classes_load_the_children_of_such_modules(tmp_path):
    torch.manual_seed(0)
    model, x = UsesChildWeight(), torch.randn(2, 4)
    expected = model(x)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the child's weights stay on meta
        disk_offload(copy.deepcopy(model), tmp_path / "plain", execution_device="cpu")(x)
    preloaded = disk_offload(
        copy.deepcopy(model),
        tmp_path / "preloaded",
        execution_device="cpu",
        preload_module_classes=["UsesChildWeight"],
    )
    assert torch.equal(preloaded(x), expected)


def test_cpu_offload_with_hook_offloads_the_previous_model_when_the_next_runs():
    offloaded = []

    class Recorded(UserCpuOffloadHook):
        def offload(self) -> None:
            offloaded.append(self.model)
            super().offload()

    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    first, first_hook = cpu_offload_with_hook(first, execution_device="cpu")
    first_hook.__class__ = Recorded
    second, second_hook = cpu_offload_with_hook(second, execution_device="cpu", prev_module_hook=first_hook)
    first(torch.randn(1, 2))
    assert offloaded == []
    second(torch.randn(1, 2))
    assert offloaded == [first]  # the first model left the execution device before the second ran
    second_hook.remove()
    second(torch.randn(1, 2))
    assert offloaded == [first]


def test_skip_first_batches_of_a_plain_dataloader():
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=3)
    assert [b[0].tolist() for b in skip_first_batches(loader, 2)] == [[6, 7, 8], [9]]


def test_verify_device_map_tells_a_dispatched_model(trained, tmp_path):
    model = empty_gpt()
    load_checkpoint_and_dispatch(
        model, trained[3] / "sharded", device_map={"blocks": "disk", "": "cpu"}, offload_folder=tmp_path
    )
    accelerator = Accelerator(cpu=True)
    assert accelerator.verify_device_map(model) and not accelerator.verify_device_map(trained[0])
    accelerator.end_training()
