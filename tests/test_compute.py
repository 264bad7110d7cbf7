"""The compute options: `trainer.compile`, `trainer.activation_checkpointing`, `precision=fp8`; the
`perf/*` metrics (throughput, MFU, peak memory) and the FLOP count behind MFU; the profiler; and the
combinations refused before launch.

Compilation runs in forked ranks or fresh processes only: a process that compiled may not fork ranks
safely afterwards (the inductor's worker threads), and the other tests here fork from this one.
"""

from __future__ import annotations

import json
from pathlib import Path

import probes
import pytest
import rank_checks
import torch
import torch.nn.functional as F
import yaml
from conftest import run_to_end
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from torch.utils.flop_counter import FlopCounterMode

from runner import Accelerator
from runner.checkpoint.weights import load_weights
from runner.config import CONF_DIR, ActivationCheckpointingConfig, CompileConfig, ProfileConfig
from runner.errors import ConfigError
from runner.group_schemas import register_configs
from runner.hardware import SingleDevice
from runner.hardware.parallelize import apply_compile
from runner.models import GPT, MLP
from runner.perf import PEAK_FLOPS, Profiler, count_flops, kept_for_backward, peak_flops
from runner.plan import describe
from runner.precision import Float8Precision
from runner.task import batch_units
from runner.validate import check_job

TESTS = Path(__file__).parent

SEQ, VOCAB = 16, 32


def tiny_gpt(n_layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=n_layers, n_heads=2)


def one_step(checkpointing: ActivationCheckpointingConfig) -> dict:
    """One fp32 step of the tiny GPT prepared with `checkpointing` on one process: its gradients, the
    bytes autograd kept for backward, and the FLOPs of the backward pass (recomputation included)."""
    accelerator = Accelerator(strategy=SingleDevice("cpu"), activation_checkpointing=checkpointing)
    model = accelerator.prepare(tiny_gpt())
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with kept_for_backward(model) as kept:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    with FlopCounterMode(display=False) as backward:
        accelerator.backward(loss)
    return {
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "kept": sum(kept.values()),
        "backward_flops": backward.get_total_flops(),
    }


@pytest.fixture(scope="module")
def eager_step():
    return one_step(ActivationCheckpointingConfig())


CHECKPOINTING = {
    "full": ActivationCheckpointingConfig(mode="full"),
    "selective_every_2": ActivationCheckpointingConfig(mode="selective", every_n_blocks=2),
    "selective_matmuls": ActivationCheckpointingConfig(mode="selective", save_matmuls=True),
}


@pytest.fixture(scope="module")
def checkpointed_steps():
    return {name: one_step(config) for name, config in CHECKPOINTING.items()}


@pytest.mark.parametrize("name", list(CHECKPOINTING))
def test_activation_checkpointing_gives_the_eager_gradients_bitwise(eager_step, checkpointed_steps, name):
    for parameter, grad in eager_step["grads"].items():
        assert torch.equal(checkpointed_steps[name]["grads"][parameter], grad), parameter


def test_activation_checkpointing_keeps_less_and_recomputes_what_it_selects(eager_step, checkpointed_steps):
    """Bytes kept for backward (the activation memory) and the FLOPs recomputed in backward, of the
    4-block GPT: `full` keeps only the blocks' inputs and recomputes every block; `selective` every 2nd
    block recomputes half as much and keeps about half; with `save_matmuls` no matmul is recomputed."""
    kept = {name: step["kept"] for name, step in checkpointed_steps.items()}
    recomputed = {
        name: step["backward_flops"] - eager_step["backward_flops"]
        for name, step in checkpointed_steps.items()
    }
    assert kept["full"] < eager_step["kept"] / 4
    assert eager_step["kept"] / 4 < kept["selective_every_2"] < eager_step["kept"] * 0.75
    assert recomputed["full"] > 0 and recomputed["selective_every_2"] == recomputed["full"] / 2
    assert recomputed["selective_matmuls"] == 0 and kept["selective_matmuls"] < eager_step["kept"] / 4


def test_the_flop_count_is_the_analytic_one():
    """6 x (matmul parameters) x tokens, plus the attention scores and their use (causal mask not
    discounted, as torch's counter does not), for GPT; 6 x weights x samples for the MLP."""
    batch, layers, width = 8, 4, 32
    with torch.device("meta"):
        model = GPT(vocab_size=1000, max_seq_len=SEQ, d_model=width, n_layers=layers, n_heads=2)
    tokens = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    counted = count_flops(lambda: model(tokens).sum())
    matmul_parameters = sum(
        p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "pos_emb" not in name
    )
    analytic = 6 * matmul_parameters * batch * SEQ + 6 * 2 * layers * SEQ * width * batch * SEQ
    assert counted == pytest.approx(analytic, rel=0.05)

    with torch.device("meta"):
        mlp = MLP(in_features=20, out_features=3, hidden_size=64, num_layers=3)
    counted = count_flops(lambda: mlp(torch.zeros(batch, 20, device="meta")).sum())
    weights = sum(p.numel() for p in mlp.parameters() if p.ndim == 2)
    assert counted == pytest.approx(6 * weights * batch, rel=0.05)


def test_throughput_counts_tokens_for_token_ids_and_samples_otherwise():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert batch_units({"inputs": ids, "targets": ids}) == ("tokens", 64)
    assert batch_units({"input_ids": ids, "attention_mask": ids, "labels": ids}) == ("tokens", 64)
    assert batch_units((ids, ids)) == ("tokens", 64)
    assert batch_units({"inputs": torch.zeros(4, 16), "targets": torch.zeros(4)}) == ("samples", 4)
    assert batch_units({"inputs": torch.zeros(5, 3, 8, 8, dtype=torch.uint8)}) == ("samples", 5)


def test_peak_flops_come_from_the_device_name_and_the_precision():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "no") == 66.9e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == 989.4e12  # fp8 against the 16-bit peak
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12  # the more specific name first
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp16") == 312e12
    assert peak_flops("TPU v5litepod-8", "bf16") == 197e12
    assert peak_flops("cpu", "no") is None
    assert all(set(peaks) <= {"bf16", "fp32"} for peaks in PEAK_FLOPS.values())


def test_fp8_converts_the_linear_layers_but_those_kept_and_those_float8_cannot_take():
    model = GPT(vocab_size=40, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=2, tie_embeddings=False)
    model.blocks[1].mlp.fc_out = torch.nn.Linear(128, 24)  # 24 outputs: not a multiple of 16
    converted = Float8Precision(keep=["lm_head", "blocks.0.attn.*"], emulate=True).convert_module(model)
    kinds = {
        name: type(m).__name__ for name, m in converted.named_modules() if isinstance(m, torch.nn.Linear)
    }
    assert kinds["lm_head"] == "Linear" and kinds["blocks.0.attn.q_proj"] == "Linear"
    assert kinds["blocks.1.mlp.fc_out"] == "Linear"
    assert kinds["blocks.0.mlp.fc_in"] == kinds["blocks.1.attn.q_proj"] == "Float8Linear"
    assert set(converted.state_dict()) == set(model.state_dict())  # the checkpoint keys are a Linear's

    def scaling(precision: Float8Precision) -> str:
        layer = precision.convert_module(torch.nn.Sequential(torch.nn.Linear(32, 32)))[0]
        return f"{layer.config.cast_config_input.scaling_granularity} {layer.config.enable_fsdp_float8_all_gather}"

    assert scaling(Float8Precision(emulate=True)) == "ScalingGranularity.TENSORWISE False"
    assert scaling(Float8Precision(recipe="rowwise", emulate=True)) == "ScalingGranularity.AXISWISE False"
    assert scaling(Float8Precision(fsdp_float8_all_gather=True, emulate=True)).endswith("True")
    with pytest.raises(ConfigError, match=r"compute capability 8\.9 or newer .* on the cpu device"):
        Float8Precision().check_device(torch.device("cpu"))
    Float8Precision(emulate=True).check_device(torch.device("cpu"))


@pytest.fixture(scope="module")
def hydra_context():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


REFUSED = {
    ("trainer.activation_checkpointing.mode=full",): "MLP declares none",
    ("experiment=gpt_sonnets", "trainer.activation_checkpointing.mode=full", "trainer.activation_checkpointing.every_n_blocks=2"): "a setting of mode=selective, and mode is full",
    ("experiment=gpt_sonnets", "trainer.activation_checkpointing.save_matmuls=true"): "a setting of mode=selective, and mode is none",
    ("experiment=gpt_sonnets", "precision=fp8"): "needs an NVIDIA GPU of compute capability 8.9 or newer",
    ("experiment=gpt_sonnets", "precision=fp8", "precision.emulate=true", "hardware=tensor_parallel"): "precision=fp8 with hardware=tensor_parallel",
    ("experiment=gpt_sonnets", "precision=fp8", "precision.emulate=true", "hardware=deepspeed"): "precision=fp8 with hardware=deepspeed",
    ("experiment=gpt_sonnets", "precision=fp8", "precision.recipe=rowwise", "precision.fsdp_float8_all_gather=true"): "one scale per tensor only",
    ("experiment=gpt_sonnets", "trainer.memory_snapshot=true"): "records the CUDA allocator's history",
    ("experiment=gpt_sonnets", "trainer.profile.active=200"): "longer than trainer.max_steps=150",
    ("experiment=gpt_sonnets", "trainer.compile.scope=bogus"): "compile.scope",
    ("trainer.compile.scope=model", "trainer.compile.backend=nosuch"): "trainer.compile.backend=nosuch: not a torch.compile backend",
    ("trainer.compile.scope=model", "trainer.compile.mode=bogus"): "trainer.compile.mode=bogus: not a mode of the inductor backend",
    ("trainer.compile.scope=model", "trainer.compile.backend=eager", "trainer.compile.mode=max-autotune"): "modes are the inductor backend's",
    ("experiment=gpt_sonnets", "hardware=tensor_parallel", "trainer.compile.scope=regional", "trainer.activation_checkpointing.mode=full"): "under tensor parallel in this torch",
}  # fmt: skip


@pytest.mark.parametrize("overrides", list(REFUSED), ids=lambda o: o[-1])
def test_combinations_that_cannot_run_are_refused_before_launch(hydra_context, overrides):
    try:
        check_job(compose("config", overrides=[*overrides, "tracker=none"]))
    except ConfigError as err:
        message = str(err)
    except Exception as err:  # composition errors (a value outside an enum) name the key
        message = str(err)
    else:
        raise AssertionError(f"{overrides} was accepted")
    assert REFUSED[overrides] in message, message


def test_the_plan_shows_the_compute_options_and_the_activations_they_keep(hydra_context):
    def plan(*overrides: str) -> dict[str, str]:
        cfg = compose("config", overrides=["experiment=gpt_sonnets", "tracker=none", *overrides])
        built, world_size = check_job(cfg)
        text = describe(cfg, built.hardware, world_size, "local", None)
        return dict(line.strip().split(None, 1) for line in text.splitlines()[1:])

    eager = plan()
    checkpointed = plan("trainer.activation_checkpointing.mode=full", "trainer.compile.scope=regional")
    assert eager["compute"] == "eager; no activation checkpointing"
    assert checkpointed["compute"].startswith("torch.compile regional (backend inductor")
    assert checkpointed["compute"].endswith("activation checkpointing of every block")

    def megabytes(line: str) -> float:
        return float(line.split("about ")[1].split(" MB")[0])

    assert megabytes(checkpointed["activations"]) < megabytes(eager["activations"]) / 4
    assert (
        "GFLOP" in eager["activations"]
        and eager["activations"].split("computes")[1] == checkpointed["activations"].split("computes")[1]
    )  # the same model FLOPs: recomputation is not counted


# --- in real ranks and fresh processes -------------------------------------------------------------------
@pytest.fixture(scope="module")
def eager_reference(tmp_path_factory):
    """The eager one-process fp32 run of the correctness matrix (in this process: nothing compiles here)."""
    return rank_checks.matrix_run("cpu", "no", str(tmp_path_factory.mktemp("eager")))


@pytest.fixture(autouse=True)
def one_compile_thread(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no worker pool per rank on 2 cores


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hardware", "scope"),
    [("cpu_forked", "regional"), ("multi_gpu", "model"), ("fsdp", "model"), ("fsdp", "regional")],
)  # regional with one process, model with DDP, and both under FSDP (its units compiled, or the root)
def test_compiled_training_matches_eager_and_its_checkpoints_resume_across(
    eager_reference, tmp_path, hardware, scope
):
    ranks = 1 if hardware == "cpu_forked" else 2
    runs = rank_checks.run_ranks(
        rank_checks.compiled_round_trip, hardware, scope, str(tmp_path), num_processes=ranks
    )[0]  # one launch: each run below a fresh Accelerator and model in the same ranks
    compiled = runs["compiled"]
    for step, (ours, eager) in enumerate(zip(compiled["losses"], eager_reference["losses"], strict=True)):
        assert abs(ours - eager) <= 1e-5, (step, ours, eager)
    assert compiled["after_load"] == compiled["continued"]
    # The compiled run's checkpoint resumes in an eager run, which saves it again; that one resumes compiled.
    assert abs(runs["eager"] - compiled["continued"]) <= 1e-5
    assert abs(runs["back"] - runs["eager"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hardware", "compile", "checkpointing"),
    [
        ("fsdp", "none", "full"),
        ("fsdp", "none", "selective"),
        ("megatron_tp2", "none", "full"),
        ("megatron_tp2", "none", "selective"),
        ("megatron_tp2", "regional", "none"),  # both at once are refused there
        ("deepspeed_zero3", "regional", "full"),  # before DeepSpeed's engine wraps the model
    ],
)
def test_compute_options_match_eager_across_ranks(
    eager_reference, tmp_path, hardware, compile, checkpointing
):
    result = rank_checks.run_ranks(
        rank_checks.matrix_run, hardware, "no", str(tmp_path / "ckpt"), compile, checkpointing
    )[0]
    for step, (ours, eager) in enumerate(zip(result["losses"], eager_reference["losses"], strict=True)):
        assert abs(ours - eager) <= 1e-5, (step, ours, eager)
    assert result["after_load"] == result["continued"]


GPT_RUN = ("experiment=gpt_sonnets", "trainer.max_steps=6", "trainer.log_every=2", "trainer.eval_every=0")


def test_a_compiled_run_compiles_the_tasks_loss_unless_told_not_to(tmp_path):
    """`trainer.compile.loss` (on by default): the task's loss runs as a compiled graph (traced, so it
    sees `is_compiling()`); with `loss=false` it stays eager while the model compiles."""
    record = tmp_path / "record"
    run_to_end(
        tmp_path / "run", "trainer.max_steps=2", "trainer.eval_every=0", "tracker=none", "trainer.save_model=false",
        "trainer.compile.scope=model", "trainer.compile.backend=eager", "task._target_=probes.LossRecordingRegression",
        f"+task.record={record}", pythonpath=TESTS,
    )  # fmt: skip
    assert probes.read(record, "loss") == ["compiled"] * 2
    strategy = SingleDevice()
    strategy.setup_compute(
        CompileConfig(scope="model", backend="eager", loss=False), ActivationCheckpointingConfig()
    )
    loss_fn = probes.LossRecordingRegression(str(tmp_path / "eager")).loss
    assert strategy.compile_loss(loss_fn) is loss_fn


@pytest.mark.parametrize(("hardware", "scope"), [("cpu", "none"), ("cpu", "model"), ("fsdp", "none")])
def test_the_loops_loss_upcasts_bf16_outputs_itself_with_the_same_value(hardware, scope):
    """Under bf16 a prepared model returns fp32 outputs (Accelerate's semantics), but the training loop's
    loss (`Engine.loss_of_batch`) takes them as autocast (or FSDP's units) computed them and upcasts them
    itself, so that a compiled loss fuses the upcast (on an H100, GPT-124M at batch 32: 0.89x -> 1.00x of
    the compiled plain loop). The loss sees fp32 and has the same value; a compiled model keeps a graph for
    each (the flag is guarded, so evaluation after training still gets fp32)."""
    if hardware == "cpu":
        seen = rank_checks.loop_loss_dtypes(hardware, scope)
    else:
        seen = rank_checks.run_ranks(rank_checks.loop_loss_dtypes, hardware, scope)[0]
    assert seen["returned"] == ["float32", "bfloat16", "float32"]
    assert seen["seen_by_loss"] == ["float32", "float32"]
    assert seen["loss"] == seen["reference"]


@pytest.mark.slow
def test_a_run_compiles_checkpoints_logs_perf_and_profiles_as_configured(tmp_path):
    """One `python -m runner` run with every compute option of the trainer: the rank's model has its
    blocks compiled and checkpointed (seen by the task), the tracker and metrics.json get tokens/s and an
    MFU that agrees with the analytic FLOPs, and the profiler's trace holds the profiled steps with the
    shapes and memory it was asked for."""
    record = tmp_path / "record"
    run_dir = tmp_path / "run"
    proc = run_to_end(
        run_dir, *GPT_RUN, "trainer.compile.scope=regional", "trainer.activation_checkpointing.mode=selective",
        "trainer.activation_checkpointing.every_n_blocks=2", "hardware.peak_flops=1e12",
        "trainer.profile.active=2", "trainer.profile.record_shapes=true", "trainer.profile.profile_memory=true",
        "task._target_=probes.ComputeRecordingLanguageModeling", f"+task.record={record}",
        f"tracker.uri=sqlite:///{tmp_path / 'mlflow.db'}", pythonpath=TESTS,
    )  # fmt: skip
    # gpt_sonnets has 2 blocks: both compiled, block 1 checkpointed, the root eager, no float8.
    assert set(probes.read(record, "compute")) == {"2,1,0,0"}

    metrics = json.loads((run_dir / "metrics.json").read_text())
    logged = [json.loads(line) for line in (run_dir / "tracking" / "events.jsonl").read_text().splitlines()]
    logged = [
        event["metrics"] for event in logged if event["op"] == "metrics" and "perf/mfu" in event["metrics"]
    ]
    assert len(logged) == 3  # steps 2, 4, 6
    for name in ("perf/tokens_per_s", "perf/step_time_s", "perf/peak_memory_gb", "perf/peak_host_memory_gb"):
        assert metrics[name] > 0 and all(event[name] > 0 for event in logged)
    assert "step 6/6" in proc.stderr and "perf/tokens_per_s=" in proc.stderr
    assert metrics["perf/mfu"] == pytest.approx(
        metrics["perf/tokens_per_s"] * flops_per_token(run_dir) / 1e12, rel=0.05
    )

    trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())
    steps = {
        event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("ProfilerStep#")
    }
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # wait 1, warmup 1, active 2
    assert any("Input Dims" in event.get("args", {}) for event in trace["traceEvents"])  # record_shapes
    assert any(event.get("name") == "[memory]" for event in trace["traceEvents"])  # profile_memory
    assert "aten::" in (run_dir / "profile" / "key_averages_rank0.txt").read_text()


def flops_per_token(run_dir: Path) -> float:
    """The analytic training FLOPs per token of the run's GPT (from its resolved config and weights)."""
    weights = load_file(str(run_dir / "model" / "model.safetensors"))
    matmul = sum(t.numel() for name, t in weights.items() if t.ndim == 2 and "pos_emb" not in name)
    model = resolved_model(run_dir)
    return 6 * matmul + 6 * 2 * model["n_layers"] * model["max_seq_len"] * model["d_model"]


@pytest.mark.slow
def test_an_fp8_run_trains_float8_linears_and_saves_plain_weights(tmp_path):
    """precision=fp8 with torchao's emulation on the CPU: the rank trains Float8Linear layers (but the
    head), the loss falls, and the saved weights load into the plain model."""
    record = tmp_path / "record"
    run_dir = tmp_path / "run"
    proc = run_to_end(
        run_dir, *GPT_RUN, "precision=fp8", "precision.emulate=true", "tracker=none",
        "task._target_=probes.ComputeRecordingLanguageModeling", f"+task.record={record}", pythonpath=TESTS,
    )  # fmt: skip
    assert set(probes.read(record, "compute")) == {"0,0,0,12"}  # 2 blocks x 6 linears; lm_head kept
    assert "precision fp8" in proc.stderr
    model = resolved_model(run_dir)
    sizes = {key: model[key] for key in ("max_seq_len", "d_model", "n_layers", "n_heads")}
    vocab_size = len(load_file(str(run_dir / "model" / "model.safetensors"))["tok_emb.weight"])
    load_weights(GPT(vocab_size=vocab_size, **sizes), run_dir / "model")


def resolved_model(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "resolved_config.yaml").read_text())["model"]


def test_the_profiler_records_the_steps_after_its_wait_and_warmup(tmp_path):
    """trainer.profile: `wait` steps skipped, `warmup` steps run under the profiler unrecorded, then
    `active` steps recorded (the run's own test sees the defaults, 1 and 1)."""
    profiler = Profiler(ProfileConfig(wait=2, warmup=1, active=2), tmp_path, 0, torch.device("cpu"))
    with profiler.profile:
        for _ in range(6):
            torch.ones(4) @ torch.ones(4)
            profiler.step()
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4"}


class CompileRecorder(torch.nn.Module):
    """A module that records what `Module.compile` was asked for instead of compiling."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Linear(2, 2)
        self.asked: list[dict] = []

    def compile(self, **options: object) -> None:
        self.asked.append(options)


def test_the_compile_settings_reach_torch_compile():
    model = CompileRecorder()
    settings = {
        "backend": "aot_eager",
        "mode": "max-autotune-no-cudagraphs",
        "fullgraph": True,
        "dynamic": False,
        "options": None,
    }
    apply_compile(model, [], CompileConfig(scope="model", **settings))
    assert model.asked == [settings]
    inductor_options = {**settings, "mode": None, "options": {"max_autotune": True}}
    apply_compile(model, [], CompileConfig(scope="model", **inductor_options))
    assert model.asked[-1] == inductor_options
    model.asked.pop()
    blocks = [CompileRecorder(), CompileRecorder()]
    apply_compile(model, blocks, CompileConfig(scope="regional"))
    assert [b.asked for b in blocks] == [
        [{"backend": "inductor", "mode": None, "fullgraph": False, "dynamic": None, "options": None}]
    ] * 2
    assert len(model.asked) == 1  # regional leaves the root alone
