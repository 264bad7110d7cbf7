"""The CUDA paths, on a real GPU: mixed precision, FSDP2 and DeepSpeed ZeRO-3 over NCCL, big model
inference split across the GPU, the CPU and the disk, torch.compile, bitwise resume and in-job restarts,
token shards with the best checkpoint kept.

Marked `cuda` and skipped without a GPU: `python -m pytest -m cuda tests/gpu` (runner installed, as the
README's set-up does). Subprocess runs use `tracker=none` (the GPU machine need not have MLflow).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import runner_command, wait_for_checkpoint

from runner import (
    Accelerator,
    cpu_offload,
    cpu_offload_with_hook,
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)
from runner.accelerate.handlers import DataLoaderConfiguration
from runner.checkpoint.weights import save_model_files
from runner.hardware.big_modeling import compute_module_sizes
from runner.models import GPT

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SONNETS = Path(__file__).parents[2] / "runner" / "data" / "assets" / "sonnets.txt"
SIZE = {"vocab_size": 97, "max_seq_len": 32, "d_model": 64, "n_layers": 2, "n_heads": 4}
DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def token_batches(steps: int, batch: int = 8, seq: int = 32) -> torch.Tensor:
    """Counting sequences from random starts (the next token is the last one plus one): learnable."""
    starts = torch.randint(
        0, SIZE["vocab_size"], (steps, batch, 1), generator=torch.Generator().manual_seed(0)
    )
    return (starts + torch.arange(seq + 1)) % SIZE["vocab_size"]


def train_gpt(precision: str = "no", steps: int = 30, compile: bool = False) -> dict:
    """A tiny GPT trained on the GPU through the Accelerator: its losses, the dtype its first MLP layer
    computed in, and the prepared objects."""
    torch.manual_seed(0)
    model = GPT(**SIZE)
    seen: list[torch.dtype] = []
    model.blocks[0].mlp.fc_in.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    accelerator = Accelerator(mixed_precision=precision)
    assert accelerator.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(torch.compile(model) if compile else model, optimizer)
    losses = []
    for batch in token_batches(steps).to(accelerator.device):
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "dtype": seen[0],
        "accelerator": accelerator,
        "model": model,
        "optimizer": optimizer,
    }


@pytest.fixture(scope="module")
def fp32_run() -> dict:
    return train_gpt("no")


@pytest.mark.parametrize(("precision", "tolerance"), [("bf16", 0.02), ("fp16", 0.02)])
def test_mixed_precision_computes_in_its_dtype_and_follows_fp32(fp32_run, precision, tolerance):
    run = train_gpt(precision)
    assert fp32_run["dtype"] == torch.float32 and run["dtype"] == DTYPES[precision]
    assert run["losses"][-1] < run["losses"][0] - 0.5  # it learns
    for step, (ours, reference) in enumerate(zip(run["losses"], fp32_run["losses"], strict=True)):
        assert abs(ours - reference) <= tolerance * reference, (step, ours, reference)
    assert all(p.dtype == torch.float32 for p in run["model"].parameters())  # fp32 master weights


def test_fp16_loss_scaling_skips_a_step_with_inf_gradients_and_backs_off():
    run = train_gpt("fp16", steps=3)
    accelerator, model, optimizer = run["accelerator"], run["model"], run["optimizer"]
    scaler = accelerator.precision.scaler
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**16
    before = [p.detach().clone() for p in model.parameters()]
    batch = token_batches(1)[0].to(accelerator.device)
    accelerator.backward(F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()))
    next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    assert accelerator.optimizer_step_was_skipped
    assert scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(("precision", "tolerance"), [("no", 1e-4), ("bf16", 0.05)])
def test_compiled_model_trains_like_eager(fp32_run, precision, tolerance):
    eager = fp32_run if precision == "no" else train_gpt(precision)
    compiled = train_gpt(precision, compile=True)
    for step, (ours, reference) in enumerate(zip(compiled["losses"], eager["losses"], strict=True)):
        assert abs(ours - reference) <= tolerance * reference, (step, ours, reference)


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_save_state_and_load_state_resume_bitwise_on_cuda(tmp_path, precision):
    """A dropout model (the CUDA RNG in play): stop after 5 of 10 steps, restore into fresh objects with
    other RNG states, and end with bitwise the weights of the uninterrupted run."""
    data = torch.randn(10, 16, 4, generator=torch.Generator().manual_seed(1))

    def setup(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.3), torch.nn.Linear(64, 1))
        accelerator = Accelerator(mixed_precision=precision)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.7)
        return accelerator, *accelerator.prepare(model, optimizer, scheduler)

    def train(accelerator, model, optimizer, scheduler, steps: range, save_at: int | None = None):
        for step in steps:
            x = data[step].to(accelerator.device)
            accelerator.backward(model(x).float().pow(2).mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step == save_at:
                accelerator.save_state(str(tmp_path / "checkpoint"))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    reference = train(*setup(0), range(10), save_at=4)
    accelerator, *objects = setup(0)
    assert next(objects[0].parameters()).device.type == "cuda"
    torch.manual_seed(123), torch.cuda.manual_seed(123)
    accelerator.load_state(str(tmp_path / "checkpoint"))
    assert torch.equal(train(accelerator, *objects, range(5, 10)), reference)


def test_big_model_split_over_gpu_cpu_and_disk_generates_the_in_memory_tokens(tmp_path):
    size = {**SIZE, "n_layers": 6}
    torch.manual_seed(0)
    model = GPT(**size).eval()
    save_model_files(model.state_dict(), tmp_path / "weights", max_shard_size="200KB")
    with init_empty_weights():
        empty = GPT(**size)
    sizes = compute_module_sizes(empty)
    block = sizes["blocks.0"]
    # Embeddings and two blocks fit on the GPU (plus room to run one), two more blocks on the CPU; the rest
    # goes to disk.
    max_memory = {0: sizes["tok_emb"] + sizes["pos_emb"] + 3 * block, "cpu": 3 * block}
    dispatched = load_checkpoint_and_dispatch(
        empty,
        tmp_path / "weights",
        device_map="sequential",
        max_memory=max_memory,
        no_split_module_classes=["Block"],
        offload_folder=tmp_path / "offload",
    )
    assert set(dispatched.hf_device_map.values()) == {0, "cpu", "disk"}, dispatched.hf_device_map
    prompt = torch.randint(0, size["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert dispatched(prompt).device.type == "cuda"  # computed on the GPU, wherever the weights live
    assert torch.equal(greedy(dispatched, prompt.cuda()), greedy(model.cuda(), prompt.cuda()))


def greedy(model: torch.nn.Module, tokens: torch.Tensor, new_tokens: int = 12) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new_tokens):
            next_id = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_id.to(tokens.device)], dim=1)
    return tokens


# ------------------------------------------------------------------------------ python -m runner on CUDA
def runner_env() -> dict[str, str]:
    return os.environ | {"PYTHONUNBUFFERED": "1"}


def runner_cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        runner_command(run_dir, "tracker=none", *overrides),
        env=runner_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def final_metrics(proc: subprocess.CompletedProcess) -> dict[str, float]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stderr.split("final metrics")[1].split("time spent")[0].splitlines()[1:]
    return {name: float(value) for name, value in (line.split() for line in lines if line.startswith("  "))}


GPT_RUN = [
    "experiment=gpt_sonnets",
    "trainer.max_steps=20",
    "trainer.eval_every=0",
    "trainer.save_model=false",
]
ONE_GPU = ["hardware.device=cuda", "hardware.num_processes=1"]
SHARDED = {
    "fsdp": ["hardware=fsdp", *ONE_GPU, "hardware.shard_modules=[Block]"],
    "deepspeed_zero3": ["hardware=deepspeed", *ONE_GPU, "hardware.zero_stage=3"],
}


@pytest.fixture(scope="module")
def single_gpu(tmp_path_factory) -> dict[str, dict[str, float]]:
    return {
        precision: final_metrics(
            runner_cli(
                tmp_path_factory.mktemp(precision), *GPT_RUN, "hardware.device=cuda", f"precision={precision}"
            )
        )
        for precision in ("fp32", "bf16")
    }


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-4), ("bf16", 2e-2)])
@pytest.mark.parametrize("hardware", list(SHARDED))
def test_sharded_backends_on_one_gpu_match_the_single_gpu_run(
    tmp_path, single_gpu, hardware, precision, tolerance
):
    if hardware.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    proc = runner_cli(tmp_path, *GPT_RUN, *SHARDED[hardware], f"precision={precision}")
    ours, reference = final_metrics(proc), single_gpu[precision]
    assert "on cuda:0, 1 process(es)" in proc.stderr
    for name in ("train/loss", "eval/loss"):
        assert abs(ours[name] - reference[name]) <= tolerance * reference[name], (name, ours, reference)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallel needs a GPU per rank (NCCL)")
@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-4), ("bf16", 2e-2)])
def test_context_parallel_on_two_gpus_matches_the_single_gpu_run(tmp_path, single_gpu, precision, tolerance):
    """`hardware.cp_size=2` on NCCL: each GPU attends with its share of every sequence over the gathered
    keys and values (the efficient-attention kernel with a mask), as one GPU computes the whole."""
    proc = runner_cli(
        tmp_path,
        *GPT_RUN,
        "hardware=fsdp",
        "hardware.device=cuda",
        "hardware.num_processes=2",
        "hardware.cp_size=2",
        f"precision={precision}",
    )
    ours, reference = final_metrics(proc), single_gpu[precision]
    assert "layout: pp 1 x dp_replicate 1 x dp_shard 1 x cp 2 x tp 1" in proc.stderr
    for name in ("train/loss", "eval/loss"):
        assert abs(ours[name] - reference[name]) <= tolerance * reference[name], (name, ours, reference)


# The default experiment on CUDA with dropout (the CUDA RNG in the checkpoints), checkpoints every 50 steps.
CUDA_TRAIN = [
    "hardware.device=cuda",
    "trainer.max_steps=1500",
    "trainer.checkpoint_every=50",
    "model.dropout=0.1",
]
WEIGHTS = "model/model.safetensors"


@pytest.fixture(scope="module")
def uninterrupted_weights(tmp_path_factory) -> bytes:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    final_metrics(runner_cli(run_dir, *CUDA_TRAIN))
    return (run_dir / WEIGHTS).read_bytes()


def test_stopped_cli_run_on_cuda_resumes_to_bitwise_the_uninterrupted_weights(
    tmp_path, uninterrupted_weights
):
    proc = subprocess.Popen(
        runner_command(tmp_path, "tracker=none", *CUDA_TRAIN),
        env=runner_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr[-4000:]
    final_metrics(runner_cli(tmp_path, *CUDA_TRAIN))
    assert "resumed from" in (tmp_path / "runner.log").read_text()
    assert (tmp_path / WEIGHTS).read_bytes() == uninterrupted_weights


def test_a_rank_killed_on_cuda_is_restarted_in_the_job_and_ends_bitwise_as_the_uninterrupted_run(
    tmp_path, uninterrupted_weights
):
    """launcher.restarts=1: the rank (a spawned process on CUDA) killed after a checkpoint; the agent
    starts it again, it resumes from the latest checkpoint, and the ledger counts the restart."""
    proc = subprocess.Popen(
        runner_command(tmp_path, "tracker=none", *CUDA_TRAIN, "launcher.restarts=1"),
        env=runner_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(tmp_path, proc)
    rank = subprocess.check_output(["pgrep", "-P", str(proc.pid), "-f", "spawn_main"], text=True).split()
    assert len(rank) == 1, rank
    os.kill(int(rank[0]), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    assert "restart 1 of 1, the ranks resume from the run's latest checkpoint" in stderr
    assert "resumed from" in stderr
    assert (tmp_path / WEIGHTS).read_bytes() == uninterrupted_weights
    summary = json.loads((tmp_path / "goodput.json").read_text())
    assert (summary["attempts"], summary["restarts"]) == (2, 1) and summary["phases_s"]["restart"] > 0


def test_token_shards_feed_a_gpt_on_cuda_which_keeps_its_best_checkpoint(tmp_path):
    """`runner prepare-data` writes the sonnets (100 times over: an epoch is longer than the run) as
    byte-token shards; a GPT trains on them on the GPU in bf16 (batches from pinned memory),
    `callbacks=[best_checkpoints]` keeps the evaluation with the lowest eval/loss, and the goodput ledger
    has the steps waiting for batches a small share of their time."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SONNETS.read_text() * 100)
    data = ["data=tokens", f"data.path={tmp_path / 'shards'}", f"data.source={corpus}"]
    prepared = subprocess.run(
        [sys.executable, "-m", "runner", "prepare-data", *data],
        cwd=tmp_path,
        env=runner_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert prepared.returncode == 0, prepared.stderr[-4000:]
    run_dir = tmp_path / "run"
    proc = runner_cli(
        run_dir,
        "experiment=gpt_sonnets",
        *data,
        "data.seq_len=64",
        "data.batch_size=16",
        "hardware.device=cuda",
        "precision=bf16",
        "trainer.max_steps=300",
        "trainer.eval_every=50",
        "trainer.log_every=50",
        "callbacks=[best_checkpoints]",
    )
    metrics = final_metrics(proc)
    assert metrics["train/loss"] < 3.0  # learned from the bytes (uniform: ln 256 = 5.5)
    found = re.findall(r"step (\d+)/\d+: eval/loss=([\d.e-]+)", (run_dir / "runner.log").read_text())
    evaluations = {int(step): float(value) for step, value in found}
    assert sorted(evaluations) == [50, 100, 150, 200, 250, 300]
    best = json.loads((run_dir / "best" / "best.json").read_text())["best"]
    assert [entry["step"] for entry in best] == [min(evaluations, key=evaluations.get)]
    assert (Path(best[0]["path"]) / "meta.json").is_file()
    phases = json.loads((run_dir / "goodput.json").read_text())["phases_s"]
    assert phases.get("data_wait", 0.0) < 0.1 * phases["train"], phases


@pytest.mark.parametrize("options", [["trainer.compile.scope=regional"], ["trainer.compile.scope=model"],
                                     ["trainer.activation_checkpointing.mode=full", "trainer.compile.scope=regional"]])  # fmt: skip
def test_compute_options_on_cuda_follow_the_eager_bf16_run_and_report_mfu(tmp_path, single_gpu, options):
    proc = runner_cli(tmp_path, *GPT_RUN, "hardware.device=cuda", "precision=bf16", *options)
    ours, reference = final_metrics(proc), single_gpu["bf16"]
    assert abs(ours["train/loss"] - reference["train/loss"]) <= 5e-2 * reference["train/loss"], (
        ours,
        reference,
    )
    assert (
        ours["perf/tokens_per_s"] > 0 and 0 < ours.get("perf/mfu", 0) < 1
    )  # the GPU is in runner.perf's table


def test_fp8_on_a_capable_gpu_trains_float8_linears_near_bf16(tmp_path, single_gpu):
    if torch.cuda.get_device_capability() < (8, 9):
        proc = runner_cli(tmp_path, *GPT_RUN, "hardware.device=cuda", "precision=fp8")
        assert proc.returncode == 2 and "compute capability 8.9 or newer" in proc.stderr
        return
    # gpt_sonnets' widths (96, 384) are multiples of 16: every block linear is float8, the head is kept.
    proc = runner_cli(tmp_path, *GPT_RUN, "hardware.device=cuda", "precision=fp8")
    ours, reference = final_metrics(proc), single_gpu["bf16"]
    assert abs(ours["train/loss"] - reference["train/loss"]) <= 0.1 * reference["train/loss"], (
        ours,
        reference,
    )
    assert "precision fp8" in proc.stderr


def test_an_out_of_memory_error_leaves_a_memory_snapshot(tmp_path):
    run_dir = tmp_path / "oom"
    # 1024 x 1024 tokens: their logits alone over a vocabulary of 50304 are 211 GB.
    proc = runner_cli(run_dir, *GPT_RUN, "hardware.device=cuda", "trainer.memory_snapshot=true",
                      "data=random_tokens", "data.batch_size=1024")  # fmt: skip
    assert proc.returncode != 0 and "OutOfMemoryError" in proc.stderr, proc.stderr[-3000:]
    assert (run_dir / "memory_snapshot_rank0.pickle").stat().st_size > 0


def test_cpu_offload_keeps_weights_on_the_cpu_and_computes_on_the_gpu():
    torch.manual_seed(0)
    model, x = GPT(**SIZE).eval(), torch.randint(0, SIZE["vocab_size"], (2, 16))
    with torch.no_grad():
        expected = model(x)
        offloaded = cpu_offload(model, execution_device=0)
        out = offloaded(x)
    assert out.device.type == "cuda" and torch.allclose(out.cpu(), expected, atol=1e-4)
    assert all(p.device.type == "cpu" for p in offloaded.parameters())  # brought over only while running


def test_cpu_offload_with_hook_moves_the_previous_model_back_when_the_next_runs():
    first, hook = cpu_offload_with_hook(torch.nn.Linear(4, 4), execution_device=0)
    second, _ = cpu_offload_with_hook(torch.nn.Linear(4, 4), execution_device=0, prev_module_hook=hook)
    first(torch.randn(2, 4))
    assert first.weight.device.type == "cuda"  # stays on the GPU until the next model runs
    second(torch.randn(2, 4))
    assert first.weight.device.type == "cpu" and second.weight.device.type == "cuda"


def test_dispatch_skip_keys_leave_those_inputs_where_they_are():
    class TakesExtra(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
            self.seen = extra.device.type
            return self.linear(x)

    model = dispatch_model(TakesExtra().cuda(), {"": 0}, skip_keys="extra")
    model(torch.randn(2, 4), extra=torch.zeros(1))
    assert model.seen == "cpu"


def test_non_blocking_batches_arrive_on_the_gpu_from_pinned_memory():
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(non_blocking=True))
    data = torch.utils.data.TensorDataset(torch.arange(8.0)[:, None])
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True))
    batches = [batch[0] for batch in loader]
    torch.cuda.synchronize()
    assert all(b.device.type == "cuda" for b in batches) and torch.cat(batches).flatten().tolist() == list(
        range(8)
    )
    accelerator.end_training()
