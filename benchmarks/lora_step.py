"""LoRA against full fine-tuning of the same transformers Llama: step time and peak memory, each in a fresh
process, written plainly (transformers, PEFT, a torch loop) and run by runner (`python -m runner
model=hf_causal_lm model.pretrained=<dir> [model/peft=lora]`), on the same data (the sonnets' bytes).

The model (random weights, `--width` x `--layers`) is saved once as a local pretrained dir. Each row
trains `--steps` steps of batch `--batch` x `--seq-len` with AdamW (lr 1e-3): the median step time of
the steps after `--warmup`, and the process's peak resident memory (CPU: the imports' few hundred MB
included, in both; on a GPU the peak allocated device memory). Ratios:
runner against the plain loop of the same kind, LoRA against full fine-tuning; the A/A row is the plain
full fine-tune run a second time (the noise of the method).

Not a test: nothing here gates CI.

    pip install 'runner-ml[peft]'
    python benchmarks/lora_step.py [--width 1024 --layers 4 --batch 4 --seq-len 64 --steps 12]

About 2 minutes on the project's 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def peak_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def plain(args: argparse.Namespace, lora: bool) -> dict[str, float]:
    """The training written plainly, in this process: its median step time and peak memory."""
    import peft
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import runner.data

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    data = runner.data.sonnets(seq_len=args.seq_len, batch_size=args.batch)
    data.setup()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).to(device)
    if lora:
        config = peft.LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear")
        model = peft.get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times = []
    batches = iter(data.train_dataloader(seed=0))
    for _ in range(args.steps):
        batch = next(batches)
        inputs, targets = batch["inputs"].to(device), batch["targets"].to(device)
        began = time.perf_counter()
        loss = F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss.item()
        times.append(time.perf_counter() - began)
    return {"step_s": statistics.median(times[args.warmup :]), "peak_gb": peak_gb(device)}


def with_runner(args: argparse.Namespace, lora: bool, run_dir: Path) -> dict[str, float]:
    """The same training as `python -m runner`: the median of its logged step times (every step logged)
    after the warm-up, and its peak memory."""
    command = [
        sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", "tracker=none", "trainer.plots=false",
        "trainer.progress_bar=false", "data=sonnets", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
        "task=language_modeling", "model=hf_causal_lm", f"model.pretrained={args.model_dir}", "optimizer.lr=1e-3",
        "optimizer.weight_decay=0.01", "scheduler=constant", f"trainer.max_steps={args.steps}", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.save_model=false", "trainer.limit_eval_batches=1",
        *(["model/peft=lora", "model.peft.r=8"] if lora else []),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    lines = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "perf/step_time_s" in line]
    peak = "perf/peak_memory_gb" if torch.cuda.is_available() else "perf/peak_host_memory_gb"
    return {
        "step_s": statistics.median(line["perf/step_time_s"] for line in steps[args.warmup :]),
        "peak_gb": steps[-1][peak],
    }


def in_fresh_process(args: argparse.Namespace, kind: str) -> dict[str, float]:
    command = [sys.executable, __file__, "--only", kind, "--model-dir", str(args.model_dir), *args.passed]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def save_model(args: argparse.Namespace, directory: Path) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=args.width, intermediate_size=args.width * 4, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.width // 64), num_key_value_heads=max(1, args.width // 64),
        max_position_embeddings=args.seq_len,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", choices=["full", "lora"])
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args()
    args.passed = [
        f"--seq-len={args.seq_len}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
    ]
    if args.only:  # a plain loop, in this fresh process
        print(json.dumps(plain(args, lora=args.only == "lora")))
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = Path(tmp) / "llama"
        parameters = save_model(args, args.model_dir)
        rows = {
            "plain full": in_fresh_process(args, "full"),
            "plain full (A/A)": in_fresh_process(args, "full"),
            "plain LoRA": in_fresh_process(args, "lora"),
            "runner full": with_runner(args, False, Path(tmp) / "full"),
            "runner LoRA": with_runner(args, True, Path(tmp) / "lora"),
        }
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"Llama {args.width} x {args.layers} layers, {parameters / 1e6:.1f}M parameters, batch {args.batch} x "
          f"{args.seq_len}, {args.steps} steps (median after {args.warmup}), on {device}")  # fmt: skip
    print(f"{'':18} {'step ms':>9} {'peak GB':>9}  {'vs plain (time, memory)':>24}")
    for name, row in rows.items():
        kind = "full" if "full" in name else "LoRA"
        reference = rows[f"plain {kind}"]
        ratio = f"{row['step_s'] / reference['step_s']:.2f}x, {row['peak_gb'] / reference['peak_gb']:.2f}x"
        print(f"{name:18} {row['step_s'] * 1e3:9.1f} {row['peak_gb']:9.3f}  {ratio:>24}")
    for method in ("plain", "runner"):
        full, lora = rows[f"{method} full"], rows[f"{method} LoRA"]
        print(f"{method}: LoRA / full = {lora['step_s'] / full['step_s']:.2f}x step time, "
              f"{lora['peak_gb'] / full['peak_gb']:.2f}x peak memory")  # fmt: skip


if __name__ == "__main__":
    main()
