"""Training throughput on one GPU: a GPT of ~125M parameters in bf16, plain PyTorch against runner's
Accelerator, `python -m runner` and Hugging Face Accelerate (where installed), all measured in this run.

    python benchmarks/gpu_throughput.py [--steps 50] [--rounds 5] [--cli-steps 300]

The in-process loops (plain, a second plain loop as the A/A control, runner's Accelerator, Accelerate)
train the same model (GPT-2 small's shape: 12 x 768, 12 heads, vocabulary 50304, sequence 1024, tied
embeddings) on the same random tokens with AdamW under bf16 autocast. They run in interleaved rounds of
`--steps` steps (the device synchronised around each round); each reports its median tokens/s, MFU (model
FLOPs per token, 6 x parameters + 12 x layers x width x sequence, over the device's peak bf16 rate) and the
peak memory it allocated over its own warm-up. `python -m runner` (data=random_tokens, the same model and
batch) is timed from its own log: the time between "training ..." and the final evaluation line of a run
of `--cli-steps` + 20 steps minus that of a run of 20 steps, so that start-up, the first steps and the
evaluation cancel out. Not a test: nothing here gates CI. `--device cpu --tiny` checks the script itself on
a machine without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from runner import Accelerator
from runner.data import RandomTokens
from runner.models import GPT

REPO = Path(__file__).resolve().parents[1]
# Dense bf16 peak (FLOP/s) by device name, from the vendors' datasheets (without sparsity).
PEAK_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}

Step = Callable[[int], None]


def model_config(tiny: bool) -> dict[str, int]:
    if tiny:
        return {"vocab_size": 512, "max_seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}
    return {"vocab_size": 50304, "max_seq_len": 1024, "d_model": 768, "n_layers": 12, "n_heads": 12}


def flops_per_token(config: dict[str, int]) -> float:
    """6 x parameters (the position embedding excluded: it is a lookup) + attention's 12 x L x d x T."""
    model = GPT(**config)
    params = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    return 6 * params + 12 * config["n_layers"] * config["d_model"] * config["max_seq_len"]


def loader(config: dict[str, int], batch: int) -> DataLoader:
    data = RandomTokens(
        vocab_size=config["vocab_size"],
        seq_len=config["max_seq_len"],
        num_samples=64 * batch,
        batch_size=batch,
    )
    data.setup()
    return data.train_dataloader(seed=0)


def forever(batches: DataLoader) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from batches


def plain(config: dict[str, int], batch: int, device: torch.device) -> Step:
    torch.manual_seed(0)
    model = GPT(**config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    stream = forever(loader(config, batch))

    def run(steps: int) -> None:
        for _ in range(steps):
            sample = next(stream)
            inputs, targets = sample["inputs"].to(device), sample["targets"].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    return run


def accelerated(accelerator_class: type, config: dict[str, int], batch: int, device: torch.device) -> Step:
    """The same loop written against an Accelerate-style `Accelerator` (runner's or Accelerate's)."""
    torch.manual_seed(0)
    accelerator = accelerator_class(mixed_precision="bf16", cpu=device.type == "cpu")
    model = GPT(**config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer, batches = accelerator.prepare(model, optimizer, loader(config, batch))
    stream = forever(batches)

    def run(steps: int) -> None:
        for _ in range(steps):
            sample = next(stream)
            loss = F.cross_entropy(model(sample["inputs"]).flatten(0, 1), sample["targets"].flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    return run


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(make: Callable[[], Step], device: torch.device, warmup: int) -> tuple[Step, float]:
    """The loop `make` builds, warmed up, and the peak memory (GB) it allocated doing so (above what was
    allocated before it)."""
    gc.collect()
    if device.type != "cuda":
        step = make()
        step(warmup)
        return step, float("nan")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step = make()
    step(warmup)
    torch.cuda.synchronize(device)
    return step, (torch.cuda.max_memory_allocated(device) - before) / 1e9


def in_process(args: argparse.Namespace, config: dict[str, int], device: torch.device) -> dict[str, dict]:
    makers: dict[str, Callable[[], Step]] = {
        "plain PyTorch": lambda: plain(config, args.batch, device),
        "plain PyTorch (A/A)": lambda: plain(config, args.batch, device),
        "runner Accelerator": lambda: accelerated(Accelerator, config, args.batch, device),
    }
    try:
        from accelerate import Accelerator as HFAccelerator

        makers["HF Accelerate"] = lambda: accelerated(HFAccelerator, config, args.batch, device)
    except ImportError:
        print("accelerate is not installed: its row is left out")
    loops, memory = {}, {}
    for name, make in makers.items():
        loops[name], memory[name] = build(make, device, args.warmup)
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
            synchronize(device)
            start = time.perf_counter()
            loops[name](args.steps)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    tokens = args.steps * args.batch * config["max_seq_len"]
    return {
        name: {"tokens_per_s": tokens / statistics.median(times[name]), "memory_gb": memory[name]}
        for name in loops
    }


def cli_loop_seconds(steps: int, config: dict[str, int], args: argparse.Namespace, workdir: Path) -> float:
    """Seconds between `python -m runner`'s "training ..." line and its final evaluation line."""
    run_dir = workdir / f"steps{steps}"
    overrides = [
        "experiment=gpt_sonnets",
        "data=random_tokens",
        f"data.vocab_size={config['vocab_size']}",
        f"data.seq_len={config['max_seq_len']}",
        f"data.batch_size={args.batch}",
        f"data.num_samples={64 * args.batch}",
        "data.eval_samples=1",
        f"model.d_model={config['d_model']}",
        f"model.n_layers={config['n_layers']}",
        f"model.n_heads={config['n_heads']}",
        "optimizer.lr=3e-4",
        "scheduler=constant",
        "trainer.max_grad_norm=null",
        "trainer.eval_every=0",
        f"trainer.log_every={steps}",
        f"trainer.max_steps={steps}",
        "trainer.save_model=false",
        "trainer.progress_bar=false",
        f"hardware.device={args.device}",
        "precision=bf16",
        "tracker=none",
        f"hydra.run.dir={run_dir}",
    ]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *overrides], env=env, capture_output=True, text=True, timeout=1200
    )
    if proc.returncode != 0:
        raise RuntimeError(f"python -m runner failed:\n{proc.stderr[-3000:]}")
    log = (run_dir / "runner.log").read_text()
    start = _stamp(log, " training ")
    end = _stamp(log, rf" step {steps}/{steps}: ")
    return (end - start).total_seconds()


def _stamp(log: str, pattern: str) -> datetime:
    match = re.search(r"^\[([\d\- :,]+)\]\[[^\]]+\]\[INFO\]" + pattern, log, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no line matching {pattern!r} in the run's log")
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cli-steps", type=int, default=300, help="0 leaves python -m runner out")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, to check the script on a CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = model_config(args.tiny)
    per_token = flops_per_token(config)
    peak = peak_flops(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    params = sum(p.numel() for p in GPT(**config).parameters())
    print(
        f"{name}, torch {torch.__version__}; GPT {params / 1e6:.1f}M parameters, batch {args.batch} x "
        f"{config['max_seq_len']} tokens, bf16; {args.rounds} rounds x {args.steps} steps"
    )
    results = in_process(args, config, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.cli_steps:
        with tempfile.TemporaryDirectory() as workdir:
            short = cli_loop_seconds(20, config, args, Path(workdir))
            long = cli_loop_seconds(20 + args.cli_steps, config, args, Path(workdir))
        tokens = args.cli_steps * args.batch * config["max_seq_len"]
        results["python -m runner"] = {"tokens_per_s": tokens / (long - short), "memory_gb": float("nan")}
    reference = results["plain PyTorch"]["tokens_per_s"]
    print(f"{'':<22} {'tokens/s':>10} {'vs plain':>9} {'MFU':>6} {'peak GB':>8}")
    for mode, result in results.items():
        rate = result["tokens_per_s"]
        mfu = f"{rate * per_token / peak:.1%}" if peak else "n/a"
        print(f"{mode:<22} {rate:>10.0f} {rate / reference:>9.3f} {mfu:>6} {result['memory_gb']:>8.2f}")


if __name__ == "__main__":
    main()
