"""Data at scale: what `data=tokens` costs as the corpus grows, against `data=hf` and a plain memory-mapped
loader, all measured in this run:

    python benchmarks/data_scale.py [--sizes 1e7,1e8,1e9] [--hf-sizes 1e6,4e6] [--rounds 3]

1. Synthetic token shards (uint16, the word-level tokenizer's vocabulary) of each size: `python -m runner
   model=hf_causal_lm data=tokens trainer.max_steps=1` (a 2-layer Llama of width 64, batches of 1 x 256)
   in a fresh process: its peak resident memory (the process's, from wait4) and the time to its first
   optimizer step, medians of `--rounds` interleaved rounds. `data=hf` on text of `--hf-sizes` tokens
   (words of a word-level tokenizer, its cache built before the measured runs) shows what it grows by;
   `data=hf data.streaming=true` on text of `--stream-sizes` tokens, tokenized as it is read, what it does not.
2. Loader throughput on one core for GPT-124M's batch shape (8 x 1024): tokens per second that `data=tokens`'
   loader (shuffled windows, collated) delivers from the largest shards, against nanoGPT's plain loop
   (`np.memmap` of one 200 MB shard, random windows, `torch.stack`), measured twice (the second an A/A
   control).
3. Preparing real text (the sonnets repeated to `--prepare-mb` MB, one 8.6 kB document per file, 8
   shards): tokens per second with the byte tokenizer and a word-level tokenizer, in 1 and 2 processes.

Ratios are against the plain reference of the same run. Nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from command_time import STAMP_ENV  # noqa: E402

from runner.data.prepare import prepare  # noqa: E402
from runner.data.shards import MANIFEST, Manifest, write_json, write_shard  # noqa: E402
from runner.data.tokens import TokenShards  # noqa: E402

SHARD_TOKENS = 100_000_000
SONNETS = REPO / "runner" / "data" / "assets" / "sonnets.txt"
# One small model for both sources (data=hf batches carry an attention mask, which runner's GPT does not take);
# batches of 1 x 256 keep the activations small next to the data.
MODEL = ["model=hf_causal_lm", "data.seq_len=256", "data.batch_size=1"]


def synthetic_shards(directory: Path, tokens: int, vocab: int) -> Path:
    """Shards of `tokens` random ids below `vocab`, written by the format's own writer (kept between runs)."""
    if (directory / MANIFEST).is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shards = []
    for number, start in enumerate(range(0, tokens, SHARD_TOKENS)):
        count = min(SHARD_TOKENS, tokens - start)
        ids = rng.integers(0, vocab, count, dtype=np.uint16)
        shards.append(write_shard(directory, f"shard_{number:05d}", ids, np.array([0]), {"synthetic": start}))
    manifest = Manifest("<u2", vocab, "ids", None, shards, [], {"synthetic": True})
    write_json(directory / MANIFEST, manifest.to_json())
    return directory


def word_corpus(path: Path, tokens: int) -> Path:
    """About `tokens` words from a 5,000-word vocabulary, 1,000 per line (one jsonl row each)."""
    if path.is_file():
        return path
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(5000)]
    with open(path, "w") as f:
        for _ in range(max(1, tokens // 1000)):
            f.write(json.dumps({"text": " ".join(words[i] for i in rng.integers(0, 5000, 1000))}) + "\n")
    return path


def word_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not directory.is_dir():
        vocab = {"[UNK]": 0, "[EOS]": 1} | {f"w{i}": i + 2 for i in range(5000)}
        vocab |= {w: len(vocab) + i for i, w in enumerate(sorted(set(SONNETS.read_text().split())))}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[EOS]"
        ).save_pretrained(directory)
    return directory


def run_once(overrides: list[str], workdir: Path) -> tuple[float, float]:
    """(seconds to the first optimizer step, peak resident GB) of one `python -m runner` process."""
    stamp = workdir / "stamp"
    stamp.unlink(missing_ok=True)
    env = os.environ | {STAMP_ENV: str(stamp), "PYTHONPATH": str(HERE)}
    command = [
        sys.executable, "-m", "runner", f"hydra.run.dir={workdir / 'run'}", "trainer.overwrite=true",
        "trainer.progress_bar=false", "tracker=none", "task=language_modeling", "trainer.max_steps=1",
        "trainer.eval_every=0", "trainer.save_model=false", "optimizer._target_=command_time.StampedAdamW",
        *MODEL, *overrides,
    ]  # fmt: skip
    start = time.time()
    proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return float(stamp.read_text()) - start, usage.ru_maxrss / 2**20  # KB -> GB


def measured(commands: dict[str, list[str]], workdir: Path, rounds: int) -> dict[str, tuple[float, float]]:
    """Each command's medians over `rounds` interleaved rounds."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, overrides in commands.items():
            runs[name].append(run_once(overrides, workdir))
    return {
        n: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        for n, rs in runs.items()
    }


def loader_throughput(directory: Path, batches: int) -> dict[str, float]:
    """Tokens per second, one core, GPT-124M's batch (8 x 1024): runner's loader and the plain one (twice)."""
    torch.set_num_threads(1)
    data = TokenShards(str(directory), seq_len=1024, batch_size=8, eval_samples=1)
    data.setup()
    loader = data.train_dataloader(seed=0)
    files = sorted(directory.glob("shard_*.bin"))
    for path in files:  # both read from the page cache
        with open(path, "rb") as f:
            while f.read(1 << 26):
                pass
    maps = [np.memmap(path, dtype=np.uint16, mode="r") for path in files]
    rng = torch.Generator().manual_seed(0)

    def plain() -> None:  # nanoGPT's get_batch, from a shard drawn at random
        mapped = maps[int(torch.randint(len(maps), (), generator=rng))]
        starts = torch.randint(len(mapped) - 1025, (8,), generator=rng).tolist()
        x = torch.stack([torch.from_numpy(mapped[i : i + 1024].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(mapped[i + 1 : i + 1025].astype(np.int64)) for i in starts])
        x.sum(), y.sum()

    def ours() -> None:
        nonlocal iterator
        batch = next(iterator)
        batch["inputs"].sum(), batch["targets"].sum()

    iterator = iter(loader)
    results: dict[str, list[float]] = {"plain": [], "data=tokens": [], "plain (A/A)": []}
    for _ in range(5):  # interleaved rounds
        for name, fetch in (("plain", plain), ("data=tokens", ours), ("plain (A/A)", plain)):
            start = time.perf_counter()
            for _ in range(batches):
                fetch()
            results[name].append(8 * 1024 * batches / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in results.items()}


def prepare_speed(root: Path, megabytes: int) -> list[tuple[str, int, float]]:
    """(tokenizer, processes, tokens per second) of preparing the sonnets repeated (`prepare`, its worker
    processes' start included; the command adds its own start, about as long as `python -m runner plan=true`)."""
    text = SONNETS.read_text()
    corpus = root / f"sonnets_{megabytes}mb"
    if not corpus.is_dir():
        corpus.mkdir()
        for i in range(megabytes * 2**20 // len(text)):
            (corpus / f"{i:06d}.txt").write_text(text)
    found = []
    for name, spec in (("bytes", "bytes"), ("word-level", str(word_tokenizer(root / "tokenizer")))):
        for workers in (1, 2):
            out = root / f"prepared-{name}-{workers}"
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            manifest = prepare(
                out, str(corpus), spec, shard_mb=megabytes / 8, workers=workers, progress=False
            )
            found.append((name, workers, manifest.tokens / (time.perf_counter() - start)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e7,1e8,1e9", help="token counts of the synthetic shards")
    parser.add_argument("--hf-sizes", default="1e6,4e6", help="token counts of the data=hf text ('' to skip)")
    parser.add_argument(
        "--stream-sizes", default="4e6,4e7", help="token counts of the streamed data=hf text ('' to skip)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=200, help="batches per loader round")
    parser.add_argument("--prepare-mb", type=int, default=100, help="MB of text for the prepare measurement")
    parser.add_argument("--parts", default="1,2,3", help="which measurements (see above)")
    parser.add_argument("--workdir", default=None, help="keep the generated data here (default: a temp dir)")
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="data_scale_"))
    root.mkdir(parents=True, exist_ok=True)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s); data in {root}\n")
    parts = set(args.parts.split(","))
    tokenizer = word_tokenizer(root / "tokenizer")
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    shards = {size: synthetic_shards(root / f"tokens_{size}", size, vocab) for size in sizes}
    if "1" in parts:
        commands = {("data=tokens", size): ["data=tokens", f"data.path={shards[size]}"] for size in sizes}
        for size in [int(float(s)) for s in args.hf_sizes.split(",") if s]:
            corpus = word_corpus(root / f"words_{size}.jsonl", size)
            hf = ["data=hf", f"data.path={corpus}", f"data.tokenizer={tokenizer}", "data.eval_fraction=0.01"]
            run_once(hf, root)  # tokenizes and caches; the measured runs read the cache
            commands["data=hf", size] = hf
        for size in [int(float(s)) for s in args.stream_sizes.split(",") if s]:
            corpus = word_corpus(root / f"words_{size}.jsonl", size)
            commands["data=hf stream", size] = [
                "data=hf",
                f"data.path={corpus}",
                f"data.tokenizer={tokenizer}",
                "data.streaming=true",
                "data.eval_rows=2",
            ]
        print(f"{'data':<15} {'tokens':>14} {'first step s':>13} {'peak RSS GB':>12}")
        for (name, size), (first, peak) in measured(commands, root, args.rounds).items():
            print(f"{name:<15} {size:>14,} {first:>13.2f} {peak:>12.3f}", flush=True)
    if "2" in parts:
        rates = loader_throughput(shards[max(sizes)], args.batches)
        print(
            f"\nloader, one core, batch 8 x 1024 from {max(sizes):,} tokens (tokens/s, median of 5 rounds):"
        )
        for name, rate in rates.items():
            print(f"  {name:<14} {rate:>14,.0f}  {rate / rates['plain']:.3f}x plain", flush=True)
    if "3" in parts:
        print(f"\npreparing {args.prepare_mb} MB of text in 8 shards (tokens/s):")
        rates = prepare_speed(root, args.prepare_mb)
        for name, workers, rate in rates:
            alone = next(r for n, w, r in rates if n == name and w == 1)
            print(f"  {name:<11} {workers} process(es) {rate:>14,.0f}  {rate / alone:.2f}x one process")


if __name__ == "__main__":
    main()
