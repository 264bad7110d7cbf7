"""Training throughput on one GPU: a GPT of ~125M parameters, plain PyTorch against runner's Accelerator,
`python -m runner` and Hugging Face Accelerate (where installed), eager and compiled, measured in one run.

    python benchmarks/gpu_throughput.py [--modes plain,plain-compiled,...] [--steps 100] [--rounds 3]

Every mode trains the same model (GPT-2 small's shape: 12 x 768, 12 heads, vocabulary 50304, sequence 1024,
tied embeddings, SDPA attention) on the same random tokens with fused AdamW under bf16 autocast, in a fresh
process of its own, as a user's script or `python -m runner` would run. The loops (plain, plain again as the
A/A control, runner's Accelerator, Accelerate) are warmed up, then `--steps` steps are timed between two
device synchronisations. `python -m runner` (data=random_tokens, the same model and batch) is timed from
its own log: from its "step W/N" line to its "step N/N" line, W the warm-up steps, so that start-up,
compilation and the evaluation stay out. Compiled modes compile the model alone (`Module.compile`, in
place: the plain loop as runner's `trainer.compile.scope=model` does), `regional` each block; `fp8` adds
torchao's float8 linears (compute capability 8.9 or newer). Each row is compared with the plain loop of its
kind (eager or compiled), measured in the same run. The modes take turns, `--rounds` times, in a rotating
order; each row is the median, with the spread (max - min over median) of its rounds. MFU: model FLOPs per
token (6 x parameters + 12 x layers x width x sequence) times tokens/s over the device's peak dense bf16
rate; `python -m runner` rows also give the MFU runner itself logged (perf/mfu). Peak memory: what the
loop allocated up to the end of its warm-up (runner's own perf/peak_memory_gb for `python -m runner`). Not
a test: nothing here gates CI. `--device cpu --tiny` checks the script itself on a machine without a GPU.
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
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from runner import Accelerator
from runner.config import CompileConfig, CompileScope
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


@dataclass(frozen=True)
class Mode:
    """One row: which loop (`plain`, `runner`, `accelerate` or `cli`), compiled how, in which precision,
    and the row it is compared with."""

    label: str
    loop: str
    compile: str = "none"  # none | model | regional
    precision: str = "bf16"  # bf16 | fp8 (python -m runner only)
    reference: str = "plain"


MODES = {
    "plain": Mode("plain PyTorch", "plain"),
    "plain-aa": Mode("plain PyTorch (A/A)", "plain"),
    "runner": Mode("runner Accelerator", "runner"),
    "accelerate": Mode("HF Accelerate", "accelerate"),
    "cli": Mode("python -m runner", "cli"),
    "plain-compiled": Mode("plain, compiled", "plain", "model", reference="plain-compiled"),
    "plain-compiled-aa": Mode("plain, compiled (A/A)", "plain", "model", reference="plain-compiled"),
    "runner-compiled": Mode("Accelerator, compiled", "runner", "model", reference="plain-compiled"),
    "cli-compiled": Mode("runner, compile model", "cli", "model", reference="plain-compiled"),
    "cli-regional": Mode("runner, compile regional", "cli", "regional", reference="plain-compiled"),
    "cli-fp8": Mode("runner, fp8, compile model", "cli", "model", "fp8", reference="plain-compiled"),
}


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


def adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")


def plain(config: dict[str, int], batch: int, device: torch.device, compile: str) -> Step:
    torch.manual_seed(0)
    model = GPT(**config).to(device)
    if compile == "model":
        model.compile()
    elif compile != "none":
        raise ValueError(f"the plain loop compiles the model or nothing, not {compile!r}")
    optimizer = adamw(model, device)
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


def accelerated(accelerator: object, config: dict[str, int], batch: int, device: torch.device) -> Step:
    """The same loop written against an Accelerate-style `Accelerator` (runner's or Accelerate's)."""
    model = GPT(**config)
    optimizer = adamw(model, device)
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


def build_loop(mode: Mode, config: dict[str, int], batch: int, device: torch.device) -> Step:
    torch.manual_seed(0)
    cpu = device.type == "cpu"
    if mode.loop == "plain":
        return plain(config, batch, device, mode.compile)
    if mode.loop == "runner":
        compile = CompileConfig(scope=CompileScope(mode.compile))
        return accelerated(
            Accelerator(mixed_precision="bf16", cpu=cpu, compile=compile), config, batch, device
        )
    if mode.loop == "accelerate" and mode.compile == "none":
        from accelerate import Accelerator as HFAccelerator

        return accelerated(HFAccelerator(mixed_precision="bf16", cpu=cpu), config, batch, device)
    raise ValueError(f"no in-process loop for {mode}")


def measure_loop(mode: Mode, args: argparse.Namespace, config: dict[str, int], device: torch.device) -> dict:
    """In this process: build `mode`'s loop, warm it up (its peak memory is measured over that), then time
    `--steps` steps between two device synchronisations."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = build_loop(mode, config, args.batch, device)
    step(args.warmup)
    synchronize(device)
    memory = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")
    start = time.perf_counter()
    step(args.steps)
    synchronize(device)
    tokens = args.steps * args.batch * config["max_seq_len"]
    return {"tokens_per_s": tokens / (time.perf_counter() - start), "memory_gb": memory}


def measure_in_new_process(key: str, args: argparse.Namespace) -> dict:
    """`measure_loop` in a fresh Python process (as `python -m runner` runs), so that no mode inherits
    another's allocator state, compiled kernels or warm caches."""
    command = [sys.executable, __file__, "--worker", key, *sys.argv[1:]]
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{key} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def measure_cli(mode: Mode, args: argparse.Namespace, config: dict[str, int], run_dir: Path) -> dict:
    """`python -m runner`'s training loop alone: the time from its log line after the warm-up steps to the
    one after the last step (it logs every `--warmup` steps), and the MFU and peak memory it logged."""
    if args.steps % args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --warmup ({args.warmup})")
    steps = args.warmup + args.steps
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
        f"+optimizer.fused={args.device == 'cuda'}",
        "trainer.eval_every=0",
        f"trainer.log_every={args.warmup}",
        f"trainer.max_steps={steps}",
        f"trainer.compile.scope={mode.compile}",
        "trainer.save_model=false",
        "trainer.progress_bar=false",
        f"hardware.device={args.device}",
        f"precision={mode.precision}",
        "tracker=none",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *overrides], env=_env(), capture_output=True, text=True, timeout=1200
    )
    if proc.returncode != 0:
        raise RuntimeError(f"python -m runner failed:\n{proc.stderr[-3000:]}")
    log = (run_dir / "runner.log").read_text()
    start, _ = _step_line(log, args.warmup, steps)
    end, metrics = _step_line(log, steps, steps)
    return {
        "tokens_per_s": args.steps * args.batch * config["max_seq_len"] / (end - start).total_seconds(),
        "memory_gb": metrics.get("perf/peak_memory_gb", float("nan")),
        "runner_mfu": metrics.get("perf/mfu", float("nan")),
    }


def _step_line(log: str, step: int, total: int) -> tuple[datetime, dict[str, float]]:
    """The time stamp and the metrics of the run log's first "step `step`/`total`: ..." line."""
    pattern = rf"^\[([\d\- :,]+)\]\[[^\]]+\]\[INFO\] step {step}/{total}: (.*)$"
    match = re.search(pattern, log, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no 'step {step}/{total}' line in the run's log")
    metrics = dict(item.split("=", 1) for item in match.group(2).split())
    stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
    return stamp, {name: float(value) for name, value in metrics.items()}


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"rows, comma-separated: {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each mode, interleaved")
    parser.add_argument(
        "--warmup", type=int, default=10, help="steps before the timed ones (a divisor of --steps)"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, to check the script on a CPU")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = model_config(args.tiny)
    if args.worker:
        print(json.dumps(measure_loop(MODES[args.worker], args, config, device)))
        return
    keys = [key.strip() for key in args.modes.split(",") if key.strip()]
    unknown = [key for key in keys if key not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if importlib.util.find_spec("accelerate") is None and "accelerate" in keys:
        print("accelerate is not installed: its row is left out")
        keys.remove("accelerate")
    per_token, peak = flops_per_token(config), peak_flops(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    params = sum(p.numel() for p in GPT(**config).parameters())
    print(
        f"{name}, torch {torch.__version__}; GPT {params / 1e6:.1f}M parameters, batch {args.batch} x "
        f"{config['max_seq_len']} tokens, bf16 autocast, fused AdamW; each mode in a process of its own, "
        f"{args.rounds} rounds x {args.steps} steps after {args.warmup}",
        flush=True,
    )
    results: dict[str, list[dict]] = {key: [] for key in keys}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # rotate the order
                mode = MODES[key]
                started = time.perf_counter()
                if mode.loop == "cli":
                    result = measure_cli(mode, args, config, Path(workdir) / f"{key}-{r}")
                else:
                    result = measure_in_new_process(key, args)
                results[key].append(result)
                took = time.perf_counter() - started
                print(
                    f"round {r + 1}: {mode.label}: {result['tokens_per_s']:.0f} tokens/s ({took:.0f} s)",
                    flush=True,
                )
    print(
        f"{'':<27} {'tokens/s':>10} {'vs ref':>7} {'ref':<15} {'spread':>7} {'MFU':>6} {'logged':>7} {'peak GB':>8}"
    )
    for key in keys:
        mode, rates = MODES[key], [r["tokens_per_s"] for r in results[key]]
        rate = statistics.median(rates)
        spread = (max(rates) - min(rates)) / rate
        reference = results.get(mode.reference)
        ratio = rate / statistics.median(r["tokens_per_s"] for r in reference) if reference else float("nan")
        mfu = f"{rate * per_token / peak:.1%}" if peak else "n/a"
        logged = statistics.median(r.get("runner_mfu", float("nan")) for r in results[key])
        logged_mfu = "n/a" if logged != logged else f"{logged:.1%}"
        memory = statistics.median(r["memory_gb"] for r in results[key])
        print(
            f"{mode.label:<27} {rate:>10.0f} {ratio:>7.3f} {MODES[mode.reference].label:<15} {spread:>7.1%} "
            f"{mfu:>6} {logged_mfu:>7} {memory:>8.2f}"
        )


if __name__ == "__main__":
    main()
