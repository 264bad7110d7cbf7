"""Training throughput on one GPU: a GPT of ~125M parameters in bf16, plain PyTorch against runner's
Accelerator, `python -m runner` and Hugging Face Accelerate (where installed), all measured in this run.

    python benchmarks/gpu_throughput.py [--steps 100] [--rounds 3] [--batch 8]

Every mode trains the same model (GPT-2 small's shape: 12 x 768, 12 heads, vocabulary 50304, sequence 1024,
tied embeddings) on the same random tokens with AdamW under bf16 autocast, in a fresh process of its own,
as a user's script or `python -m runner` would run: the loops (plain, plain again as the A/A control,
runner's Accelerator, Accelerate) are warmed up, then `--steps` steps are timed between two device
synchronisations; `python -m runner` (data=random_tokens, the same model and batch) is timed from its own
log, the time between "training ..." and the final evaluation line of a run of warm-up + `--steps` steps
minus that of a run of the warm-up steps, so that start-up, the first steps and the evaluation cancel out.
The modes take turns, `--rounds` times, in a rotating order; each row is the median, with the spread
(max - min over median) of its rounds. MFU: model FLOPs per token (6 x parameters + 12 x layers x width x
sequence) times tokens/s over the device's peak dense bf16 rate. Peak memory: what the loop allocated up to
the end of its warm-up. Not a test: nothing here gates CI. `--device cpu --tiny` checks the script itself
on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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


def measure_loop(mode: str, args: argparse.Namespace, config: dict[str, int], device: torch.device) -> dict:
    """In this process: build `mode`'s loop, warm it up (its peak memory is measured over that), then time
    `--steps` steps between two device synchronisations."""
    makers: dict[str, Callable[[], Step]] = {
        "plain": lambda: plain(config, args.batch, device),
        "runner": lambda: accelerated(Accelerator, config, args.batch, device),
    }
    if mode == "accelerate":
        from accelerate import Accelerator as HFAccelerator

        makers["accelerate"] = lambda: accelerated(HFAccelerator, config, args.batch, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = makers[mode]()
    step(args.warmup)
    synchronize(device)
    memory = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")
    start = time.perf_counter()
    step(args.steps)
    synchronize(device)
    tokens = args.steps * args.batch * config["max_seq_len"]
    return {"tokens_per_s": tokens / (time.perf_counter() - start), "memory_gb": memory}


def measure_in_new_process(mode: str, args: argparse.Namespace) -> dict:
    """`measure_loop` in a fresh Python process (as `python -m runner` runs), so that no mode inherits
    another's allocator state, compiled kernels or warm caches."""
    command = [sys.executable, __file__, "--worker", mode, *sys.argv[1:]]
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def measure_cli(args: argparse.Namespace, config: dict[str, int], workdir: Path) -> dict:
    """`python -m runner`'s training loop alone: a run of warm-up + `--steps` steps minus one of the warm-up
    steps, each timed from its own log."""
    seconds = cli_loop_seconds(args.warmup + args.steps, config, args, workdir)
    seconds -= cli_loop_seconds(args.warmup, config, args, workdir)
    return {
        "tokens_per_s": args.steps * args.batch * config["max_seq_len"] / seconds,
        "memory_gb": float("nan"),
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
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *overrides], env=_env(), capture_output=True, text=True, timeout=1200
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
    parser.add_argument("--steps", type=int, default=100, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each mode, interleaved")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, to check the script on a CPU")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = model_config(args.tiny)
    if args.worker:
        print(json.dumps(measure_loop(args.worker, args, config, device)))
        return
    # label -> what runs; the second plain measurement is the A/A control.
    modes = {
        "plain PyTorch": "plain",
        "plain PyTorch (A/A)": "plain",
        "runner Accelerator": "runner",
        "HF Accelerate": "accelerate",
        "python -m runner": "cli",
    }
    if importlib.util.find_spec("accelerate") is None:
        print("accelerate is not installed: its row is left out")
        del modes["HF Accelerate"]
    per_token, peak = flops_per_token(config), peak_flops(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    params = sum(p.numel() for p in GPT(**config).parameters())
    print(
        f"{name}, torch {torch.__version__}; GPT {params / 1e6:.1f}M parameters, batch {args.batch} x "
        f"{config['max_seq_len']} tokens, bf16; each mode in a process of its own, {args.rounds} rounds x "
        f"{args.steps} steps"
    )
    results: dict[str, list[dict]] = {label: [] for label in modes}
    labels = list(modes)
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:  # rotate the order
                if modes[label] == "cli":
                    result = measure_cli(args, config, Path(workdir) / str(r))
                else:
                    result = measure_in_new_process(modes[label], args)
                results[label].append(result)
    reference = statistics.median(r["tokens_per_s"] for r in results["plain PyTorch"])
    print(f"{'':<22} {'tokens/s':>10} {'vs plain':>9} {'spread':>7} {'MFU':>6} {'peak GB':>8}")
    for label in modes:
        rates = [r["tokens_per_s"] for r in results[label]]
        rate = statistics.median(rates)
        spread = (max(rates) - min(rates)) / rate
        mfu = f"{rate * per_token / peak:.1%}" if peak else "n/a"
        memory = statistics.median(r["memory_gb"] for r in results[label])
        print(f"{label:<22} {rate:>10.0f} {rate / reference:>9.3f} {spread:>7.1%} {mfu:>6} {memory:>8.2f}")


if __name__ == "__main__":
    main()
