"""Peak memory and time to load a ~1 GB fp32 GPT from sharded safetensors and run it, each way in a fresh
process: plain PyTorch (construct, then load_state_dict), runner's load_checkpoint_and_dispatch with
device_map="auto" and with max_memory sending 75% of the weights to disk, and Accelerate's (when installed)
on the same files. Peak memory is the process's peak resident set above what it held before loading.

    pip install accelerate   # optional: its rows are skipped without it
    python benchmarks/big_model_load.py [--layers 9 --width 1536]

Ratios are against the model's size; outputs are compared with plain PyTorch's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from runner.models import GPT

METHODS = ("plain", "runner_auto", "runner_disk75", "accelerate_auto", "accelerate_disk75")


def config(args: argparse.Namespace) -> dict[str, int]:
    return {
        "vocab_size": 256,
        "max_seq_len": 64,
        "d_model": args.width,
        "n_layers": args.layers,
        "n_heads": max(1, args.width // 128),
    }


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(method: str, checkpoint: Path, offload: Path, model_config: dict[str, int], size: int) -> dict:
    """Runs in its own process: load one way, run one forward, report peak memory and times."""
    import safetensors.torch

    inputs = torch.arange(32).view(1, 32) % 256
    empty = None
    if method.startswith("runner"):
        from runner.big_modeling import init_empty_weights, load_checkpoint_and_dispatch
    elif method.startswith("accelerate"):
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    torch.set_num_threads(1)
    baseline = rss_bytes()
    started = time.perf_counter()
    if method == "plain":
        model = GPT(**model_config)
        state = {}
        for shard in sorted(checkpoint.glob("*.safetensors")):
            state.update(safetensors.torch.load_file(shard))
        model.load_state_dict(state, strict=False)  # lm_head.weight is tied to tok_emb.weight, stored once
        del state
    else:
        with init_empty_weights():
            empty = GPT(**model_config)
        if method.startswith(
            "accelerate"
        ):  # its init_empty_weights unties them: tie again, as transformers does
            empty.lm_head.weight = empty.tok_emb.weight
        # 75% to disk: the CPU holds a quarter of the weights, plus room for one block to run.
        block = sum(p.numel() * 4 for p in empty.blocks[0].parameters())
        max_memory = {"cpu": int(size * 0.25) + block} if method.endswith("disk75") else None
        model = load_checkpoint_and_dispatch(
            empty, str(checkpoint), device_map="auto", max_memory=max_memory,
            no_split_module_classes=["Block"], offload_folder=str(offload / method),
        )  # fmt: skip
    loaded = time.perf_counter() - started
    with torch.no_grad():
        logits = model(inputs)
    forward = time.perf_counter() - started - loaded
    peak = peak_rss_bytes() - baseline
    device_map = getattr(model, "hf_device_map", {"": "cpu"})
    on_disk = sum(1 for d in device_map.values() if d == "disk")
    torch.save(logits, offload / f"{method}.pt")
    return {"peak": peak, "load_s": loaded, "forward_s": forward, "disk_entries": on_disk}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--width", type=int, default=1536, help="d_model (heads of 128)")
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}"
    )
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one method, in a child process
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model_config = config(args)
    if args.measure:
        work = Path(args.dir)
        size = int((work / "size").read_text())
        print(json.dumps(measure(args.measure, work / "checkpoint", work, model_config, size)))
        return

    from runner.checkpoint.weights import save_model_files

    with tempfile.TemporaryDirectory(prefix="big-model-") as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        model = GPT(**model_config)
        size = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head counted once
        save_model_files(model.state_dict(), work / "checkpoint", max_shard_size=args.shard_size)
        del model
        (work / "size").write_text(str(size))
        shards = len(list((work / "checkpoint").glob("*.safetensors")))
        print(
            f"GPT {args.layers} x {args.width}: {size / 2**30:.2f} GiB fp32 in {shards} safetensors shards\n"
        )
        print(
            f"{'method':<18} {'peak / size':>11} {'load s':>8} {'forward s':>10} {'disk entries':>13}  output"
        )
        results = {}
        for method in args.methods.split(","):
            if method.startswith("accelerate"):
                try:
                    import accelerate  # noqa: F401
                except ImportError:
                    print(f"{method:<18} (accelerate not installed: pip install accelerate)")
                    continue
            out = subprocess.run(
                [sys.executable, __file__, "--measure", method, "--dir", str(work),
                 "--layers", str(args.layers), "--width", str(args.width)],
                capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode != 0:
                raise SystemExit(f"{method} failed:\n{out.stderr}")
            results[method] = json.loads(out.stdout.strip().splitlines()[-1])
            same = torch.equal(torch.load(work / f"{method}.pt"), torch.load(work / "plain.pt"))
            r = results[method]
            print(
                f"{method:<18} {r['peak'] / size:>10.2f}x {r['load_s']:>8.2f} {r['forward_s']:>10.2f} "
                f"{r['disk_entries']:>13}  {'identical' if same else 'DIFFERENT'}"
            )


if __name__ == "__main__":
    main()
