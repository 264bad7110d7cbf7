"""Training throughput on one GPU: a GPT of ~125M parameters, plain PyTorch against runner's Accelerator,
`python -m runner` and Hugging Face Accelerate (where installed), eager and compiled, measured in one run.

    python benchmarks/gpu_throughput.py [--modes plain,plain-compiled,...] [--size 124m] [--steps 100] [--rounds 3]

Every GPT mode trains the same model (`--size 124m`: GPT-2 small's shape, 12 x 768, 12 heads; `1b`: 18 x
2048, 16 heads, 1.0B parameters; both vocabulary 50304, sequence 1024, tied embeddings, SDPA attention) on
the same random tokens with fused AdamW under bf16 autocast, in a fresh process of its own, as a user's
script or `python -m runner` would run. `cli-hf-fsdp` trains a Hugging Face Llama from scratch through
`python -m runner model=hf_causal_lm hardware=fsdp` on one device (`1b`: TinyLlama's shape, 22 x 2048, 32
heads, 4 key-value heads, vocabulary 32000, 1.1B parameters; `124m`: 12 x 768, 12 heads, vocabulary 50304),
eager (`cli-hf-fsdp-regional`: each decoder layer compiled), with no plain reference (its ratio is n/a). The loops (plain, plain again as the
A/A control, runner's Accelerator, Accelerate) are warmed up, then `--steps` steps are timed between two
device synchronisations. `python -m runner` (data=random_tokens, the same model and batch) is timed from
its own log: from its "step W/N" line to its "step N/N" line, W the warm-up steps, so that start-up,
compilation and the evaluation stay out. Compiled modes compile the model (`Module.compile`, in place)
and the loss, as runner's `trainer.compile.scope=model` does (`trainer.compile.loss`, on by default; the
Accelerator's loop computes its loss eagerly, as a ported script does; `cli-compiled-eager-loss` turns
`trainer.compile.loss` off, `cli-reduce-overhead` adds CUDA graphs), `regional` each block; `fp8` adds
torchao's float8 linears (compute capability 8.9 or newer). `cli-compiled-tokens` reads token shards from disk (`data=tokens`, synthetic
ids written once per run) instead of random tokens made in memory, and prints the share of its training
steps' time spent waiting for batches (the goodput ledger's data wait). Each row is compared with the plain loop of its
kind (eager or compiled), measured in the same run. The modes take turns, `--rounds` times, in a rotating
order; each row is the median, with the spread (max - min over median) of its rounds. MFU: model FLOPs per
token (6 x parameters + 12 x layers x width x sequence) times tokens/s over the device's peak dense bf16
rate; `python -m runner` rows also give the MFU runner itself logged (perf/mfu). Peak memory: what the
loop allocated up to the end of its warm-up (runner's own perf/peak_memory_gb for `python -m runner`). `--profile DIR`: the `python -m runner`
rows also record three steps of the warm-up with `trainer.profile`, the in-process loops three steps after
the timed ones with torch.profiler (each mode's ops table goes to DIR), and print the fraction of those
steps' time the GPU was busy. Not a test: nothing here gates CI. `--device cpu
--size tiny` checks the script itself on a machine without a GPU.
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
sys.path.insert(0, str(REPO / "benchmarks"))
from data_scale import synthetic_shards  # noqa: E402

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
    reference: str | None = "plain"
    model: str = "gpt"  # gpt | llama (Hugging Face's, python -m runner with hardware=fsdp only)
    data: str = "random_tokens"  # random_tokens | tokens (shards on disk; python -m runner only)
    overrides: tuple[str, ...] = ()  # more `python -m runner` overrides


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
    "cli-compiled-eager-loss": Mode(
        "runner, compile model, loss eager",
        "cli",
        "model",
        reference="plain-compiled",
        overrides=("trainer.compile.loss=false",),
    ),
    "cli-reduce-overhead": Mode(
        "runner, compile model, CUDA graphs",
        "cli",
        "model",
        reference="plain-compiled",
        overrides=("trainer.compile.mode=reduce-overhead",),
    ),
    "cli-compiled-tokens": Mode(
        "runner, compile model, data=tokens", "cli", "model", reference="plain-compiled", data="tokens"
    ),
    "cli-compiled-tokens-workers": Mode(
        "runner, compile model, data=tokens, 2 loader processes",
        "cli",
        "model",
        reference="plain-compiled",
        data="tokens",
        overrides=("data.num_workers=2",),
    ),
    "cli-regional": Mode("runner, compile regional", "cli", "regional", reference="plain-compiled"),
    "cli-fp8": Mode("runner, fp8, compile model", "cli", "model", "fp8", reference="plain-compiled"),
    "cli-hf-fsdp": Mode("runner, HF Llama, fsdp", "cli", reference=None, model="llama"),
    "cli-hf-fsdp-regional": Mode(
        "runner, HF Llama, fsdp, compile regional", "cli", "regional", reference=None, model="llama"
    ),
}

SIZES = ("tiny", "124m", "1b")


def model_config(size: str) -> dict[str, int]:
    """runner's GPT at `size` (its constructor's arguments)."""
    if size == "tiny":
        return {"vocab_size": 512, "max_seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}
    if size == "1b":
        return {"vocab_size": 50304, "max_seq_len": 1024, "d_model": 2048, "n_layers": 18, "n_heads": 16}
    return {"vocab_size": 50304, "max_seq_len": 1024, "d_model": 768, "n_layers": 12, "n_heads": 12}


def llama_config(size: str) -> dict[str, int]:
    """A Hugging Face Llama's config at `size` (`model.config` of `model=hf_causal_lm`), vocabulary apart."""
    if size == "tiny":
        shape = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
        return shape | {"num_key_value_heads": 4, "max_position_embeddings": 64}
    if size == "1b":  # TinyLlama-1.1B
        shape = {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
        }
        return shape | {"num_key_value_heads": 4, "max_position_embeddings": 2048}
    shape = {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
    }
    return shape | {"num_key_value_heads": 12, "max_position_embeddings": 1024}


def llama_vocab(size: str) -> int:
    return 32000 if size == "1b" else model_config(size)["vocab_size"]


def flops_per_token(mode: Mode, size: str) -> float:
    """6 x parameters (embedding lookups excluded: the position embedding, or an untied input embedding) +
    attention's 12 x layers x width x sequence."""
    seq = model_config(size)["max_seq_len"]
    if mode.model == "llama":
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = llama_config(size)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=llama_vocab(size), **config))
        lookup = model.get_input_embeddings().weight.numel()
        layers, width = config["num_hidden_layers"], config["hidden_size"]
    else:
        config = model_config(size)
        with torch.device("meta"):
            model = GPT(**config)
        lookup = model.pos_emb.weight.numel()
        layers, width = config["n_layers"], config["d_model"]
    params = sum(p.numel() for p in model.parameters()) - lookup
    return 6 * params + 12 * layers * width * seq


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
    loss_fn = lm_loss
    if compile == "model":
        model.compile()
        loss_fn = torch.compile(lm_loss)
    elif compile != "none":
        raise ValueError(f"the plain loop compiles the model (and loss) or nothing, not {compile!r}")
    optimizer = adamw(model, device)
    stream = forever(loader(config, batch))

    def run(steps: int) -> None:
        for _ in range(steps):
            sample = next(stream)
            inputs, targets = sample["inputs"].to(device), sample["targets"].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(inputs)
            loss = loss_fn(logits, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    return run


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


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
    result = {"tokens_per_s": tokens / (time.perf_counter() - start), "memory_gb": memory}
    if args.profile:  # after the timed steps, which it would slow
        result["gpu_busy"] = profile_steps(step, device, args.profile / f"{args.worker}-ops.txt")
    return result


def profile_steps(step: Step, device: torch.device, table: Path) -> float:
    """Three steps of a loop under torch.profiler: their ops table written to `table`; the GPU's busy share."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        step(3)
        synchronize(device)
    table.parent.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table.write_text(profiler.key_averages().table(sort_by=sort, row_limit=40) + "\n")
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        return gpu_busy(trace)


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
    one after the last step (it logs every `--warmup` steps), and the MFU and peak memory it logged. With
    `--profile`, three steps of the warm-up are profiled (their ops table copied, the GPU's busy share)."""
    if args.steps % args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --warmup ({args.warmup})")
    steps = args.warmup + args.steps
    vocab = llama_vocab(args.size) if mode.model == "llama" else config["vocab_size"]
    overrides = [
        "task=language_modeling",
        *data_overrides(mode, args, vocab, config["max_seq_len"], run_dir.parent),
        f"data.seq_len={config['max_seq_len']}",
        f"data.batch_size={args.batch}",
        "data.eval_samples=1",
        *model_overrides(mode, args.size, config),
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
        *mode.overrides,
    ]
    if args.profile:  # steps warmup-4 .. warmup-2, before the timed window
        overrides += [
            f"trainer.profile.wait={args.warmup - 5}",
            "trainer.profile.warmup=1",
            "trainer.profile.active=3",
        ]
    proc = subprocess.run(
        [sys.executable, "-m", "runner", *overrides], env=_env(), capture_output=True, text=True, timeout=1200
    )
    if proc.returncode != 0:
        raise RuntimeError(f"python -m runner failed:\n{proc.stderr[-3000:]}")
    log = (run_dir / "runner.log").read_text()
    start, _ = _step_line(log, args.warmup, steps)
    end, metrics = _step_line(log, steps, steps)
    result = {
        "tokens_per_s": args.steps * args.batch * config["max_seq_len"] / (end - start).total_seconds(),
        "memory_gb": metrics.get("perf/peak_memory_gb", float("nan")) * 1024**3 / 1e9,  # GiB logged
        "runner_mfu": metrics.get("perf/mfu", float("nan")),
    }
    phases = json.loads((run_dir / "goodput.json").read_text())["phases_s"]
    result["data_wait"] = phases.get("data_wait", 0.0) / (phases.get("data_wait", 0.0) + phases["train"])
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        table = run_dir / "profile" / "key_averages_rank0.txt"
        (args.profile / f"{run_dir.name.rsplit('-', 1)[0]}-ops.txt").write_text(
            table.read_text()
        )  # {key}-{round}
        result["gpu_busy"] = gpu_busy(run_dir / "profile" / "trace_rank0.json")
    return result


def data_overrides(
    mode: Mode, args: argparse.Namespace, vocab: int, seq_len: int, workdir: Path
) -> list[str]:
    """The `data=` overrides of `mode`: random tokens made in memory, or token shards on disk (`tokens`:
    synthetic shards in `workdir` holding each window of the run twice over, written once for all rounds)."""
    if mode.data == "tokens":
        windows = 2 * (args.warmup + args.steps) * args.batch
        shards = synthetic_shards(workdir / f"shards-{vocab}", windows * (seq_len + 1), vocab)
        return ["data=tokens", f"data.path={shards}"]
    return ["data=random_tokens", f"data.vocab_size={vocab}", f"data.num_samples={64 * args.batch}"]


def model_overrides(mode: Mode, size: str, config: dict[str, int]) -> list[str]:
    """The `model=` overrides of `mode` at `size`: runner's GPT, or a Hugging Face Llama with fsdp."""
    if mode.model == "llama":
        shape = [f"model.config.{name}={value}" for name, value in llama_config(size).items()]
        return ["model=hf_causal_lm", *shape, "hardware=fsdp", "hardware.num_processes=1"]
    return [
        "model=gpt",
        f"model.max_seq_len={config['max_seq_len']}",
        f"model.d_model={config['d_model']}",
        f"model.n_layers={config['n_layers']}",
        f"model.n_heads={config['n_heads']}",
    ]


def gpu_busy(trace: Path) -> float:
    """The share of the profiled window (first to last GPU kernel) in which some kernel ran."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e)
    if not spans:
        return float("nan")
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / (end - spans[0][0])


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
    parser.add_argument(
        "--size", choices=SIZES, default="124m", help="the model's size (tiny: to check the script on a CPU)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="profile python -m runner's warm-up; its ops tables go here",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = model_config(args.size)
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
    peak = peak_flops(args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with torch.device("meta"):
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
                busy = (
                    f", GPU busy {result['gpu_busy']:.1%} of the profiled steps"
                    if "gpu_busy" in result
                    else ""
                )
                if "data_wait" in result:
                    busy += f", data wait {result['data_wait']:.2%} of the training steps (goodput ledger)"
                print(
                    f"round {r + 1}: {mode.label}: {result['tokens_per_s']:.0f} tokens/s ({took:.0f} s){busy}",
                    flush=True,
                )
    width = max(len(MODES[key].label) for key in keys)
    print(
        f"{'':<{width}} {'tokens/s':>10} {'vs ref':>7} {'ref':<21} {'spread':>7} {'MFU':>6} {'logged':>7} {'peak GB':>8}"
    )
    for key in keys:
        mode, rates = MODES[key], [r["tokens_per_s"] for r in results[key]]
        rate = statistics.median(rates)
        spread = (max(rates) - min(rates)) / rate
        reference = results.get(mode.reference) if mode.reference else None
        ratio = rate / statistics.median(r["tokens_per_s"] for r in reference) if reference else float("nan")
        mfu = f"{rate * flops_per_token(mode, args.size) / peak:.1%}" if peak else "n/a"
        reference_label = MODES[mode.reference].label if mode.reference else "none"
        logged = statistics.median(r.get("runner_mfu", float("nan")) for r in results[key])
        logged_mfu = "n/a" if logged != logged else f"{logged:.1%}"
        memory = statistics.median(r["memory_gb"] for r in results[key])
        print(
            f"{mode.label:<{width}} {rate:>10.0f} {ratio:>7.3f} {reference_label:<21} {spread:>7.1%} "
            f"{mfu:>6} {logged_mfu:>7} {memory:>8.2f}"
        )


if __name__ == "__main__":
    main()
