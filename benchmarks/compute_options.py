"""The compute options against plain PyTorch, measured in the same run: eager, `torch.compile` of the
whole model and of each block (regional), and activation checkpointing (full; selective with the matmul
outputs kept), through runner's Accelerator, next to a plain PyTorch loop (eager, twice: the A/A
control) and a plain loop compiled with `torch.compile`.

The model is the gpt experiment's GPT at a size that takes about 100 ms per step on a 2-core CPU
(d_model 256, 4 blocks, 4 x 256 tokens, vocabulary 512, AdamW). Each mode runs in a fresh process (its
own compilation, its own peak memory): warm-up steps (compilation included), then timed steps; the modes
take turns for `--rounds` rounds, and the medians are reported with the spread (max - min over median).
Memory: the bytes autograd keeps for backward in one step (activations, measured with saved-tensor
hooks: what activation checkpointing cuts), and the peak memory (the allocator's on a GPU; on a CPU the
process's peak resident set, which the torch libraries and the compiler dominate).

On a GPU (`--device cuda`) the modes run in bf16 autocast, plus fp8 (torchao's float8 linears), with
tokens/s and MFU against the device's bf16 peak (runner.perf.PEAK_FLOPS).

Not a test: nothing here gates CI.

    python benchmarks/compute_options.py [--rounds 3] [--steps 10] [--warmup 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from runner import Accelerator
from runner.config import ActivationCheckpointingConfig, CompileConfig
from runner.hardware import SingleDevice
from runner.models import GPT
from runner.perf import count_flops, kept_for_backward, peak_flops, peak_memory_gb
from runner.precision import Float8Precision, MixedPrecision, Precision

SIZE = {"vocab_size": 512, "max_seq_len": 256, "d_model": 256, "n_layers": 4, "n_heads": 4}
BATCH = 4

# mode -> (plain PyTorch or runner, compile scope, activation checkpointing)
MODES = {
    "plain eager": ("plain", "none", "none"),
    "plain eager (A/A)": ("plain", "none", "none"),
    "plain torch.compile": ("plain", "model", "none"),
    "runner eager": ("runner", "none", "none"),
    "runner compile=model": ("runner", "model", "none"),
    "runner compile=regional": ("runner", "regional", "none"),
    "runner checkpointing=full": ("runner", "none", "full"),
    "runner checkpointing=selective+matmuls": ("runner", "none", "selective"),
    "runner regional + full checkpointing": ("runner", "regional", "full"),
}
GPU_MODES = {
    "runner fp8": ("runner", "none", "none"),
    "runner fp8 + regional": ("runner", "regional", "none"),
}


def worker(mode: str, device: str, warmup: int, steps: int) -> dict[str, float]:
    """Train in this process in `mode`; what it measured."""
    kind, scope, checkpointing = {**MODES, **GPU_MODES}[mode]
    torch.manual_seed(0)
    model = GPT(**SIZE)
    tokens = torch.randint(0, SIZE["vocab_size"], (BATCH, SIZE["max_seq_len"] + 1))
    with torch.device("meta"):
        meta = GPT(**SIZE)
    flops_per_step = count_flops(
        lambda: F.cross_entropy(
            meta(tokens[:, :-1].to("meta")).flatten(0, 1), tokens[:, 1:].flatten().to("meta")
        )
    )
    precision: Precision = Precision() if device == "cpu" else MixedPrecision("bfloat16")
    if mode.startswith("runner fp8"):
        precision = Float8Precision()
    if kind == "plain":
        model = model.to(device)
        if scope == "model":
            model.compile()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

        def backward(loss: torch.Tensor) -> None:
            loss.backward()
    else:
        accelerator = Accelerator(
            strategy=SingleDevice(device),
            mixed_precision=precision,
            compile=CompileConfig(scope=scope),
            activation_checkpointing=ActivationCheckpointingConfig(
                mode=checkpointing, save_matmuls=checkpointing == "selective"
            ),
        )
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        autocast = torch.autocast(device, enabled=False)
        backward = accelerator.backward
    tokens = tokens.to(device)

    def step() -> None:
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    with kept_for_backward(model) as kept:
        step()
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens_per_s = BATCH * SIZE["max_seq_len"] / seconds
    peak = peak_flops(torch.cuda.get_device_name() if device == "cuda" else "cpu", "bf16")
    return {
        "steps_per_s": 1 / seconds,
        "tokens_per_s": tokens_per_s,
        "mfu": flops_per_step / seconds / peak if peak else float("nan"),
        "peak_memory_gb": peak_memory_gb(torch.device(device))[0],
        "activations_mb": sum(kept.values()) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.device, args.warmup, args.steps)))
        return
    modes = list(MODES) + (list(GPU_MODES) if args.device == "cuda" else [])
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            command = [sys.executable, __file__, "--worker", mode, "--device", args.device,
                       "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {round_ + 1}/{args.rounds} {mode}: {results[mode][-1]}", file=sys.stderr)
    base = statistics.median(r["steps_per_s"] for r in results["plain eager"])
    name = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"\n| mode ({name}, torch {torch.__version__}) | steps/s | vs plain eager | spread | tokens/s | MFU "
        "| activations MB | peak memory GB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, rounds in results.items():
        rate = [r["steps_per_s"] for r in rounds]
        median = statistics.median(rate)
        mfu = statistics.median(r["mfu"] for r in rounds)
        print(
            f"| {mode} | {median:.2f} | {median / base:.3f} | {(max(rate) - min(rate)) / median:.1%} | "
            f"{statistics.median(r['tokens_per_s'] for r in rounds):.0f} | "
            f"{'n/a' if mfu != mfu else f'{mfu:.1%}'} | "
            f"{statistics.median(r['activations_mb'] for r in rounds):.1f} | "
            f"{statistics.median(r['peak_memory_gb'] for r in rounds):.2f} |"
        )


if __name__ == "__main__":
    main()
