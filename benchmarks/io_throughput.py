"""Checkpoint and prepare throughput against what the machine does without runner, measured in this run:

    python benchmarks/io_throughput.py [--rounds 3] [--width 4096] [--prepare-tokens 2e7] [--dir /tmp]

1. The disk: `--dir`'s own sequential write of a checkpoint's size in 8 MiB blocks, fsync'd (as `dd
   conv=fsync` writes), and its read back with the file's pages dropped from the page cache first
   (`posix_fadvise(DONTNEED)`), twice a round (the second an A/A control).
2. Checkpoints through `python -m runner`: an MLP of `--width` (4 hidden layers: about 67M parameters, a
   checkpoint of about 0.8 GB with AdamW's two states) saves one checkpoint after its first step, and a
   second command resumes from it with its files dropped from the page cache; the goodput ledger's
   `checkpoint` phase (the blocking save: staging, every file fsync'd, the rename) and `restore` phase (the
   load) time them. Full (`hardware=cpu`, one process) and sharded (`hardware=fsdp`, 2 processes over gloo:
   DCP, each rank its own shard). GB/s is the checkpoint directory's size over that time, and the ratio is
   against the disk's rate of the same round.
3. `runner prepare-data` against `datasets`: the same JSON-lines corpus of `--prepare-tokens` words, the
   same word-level tokenizer, 2 processes each: runner's `prepare` (tokenize, write the shards and their
   document index, fsync'd, checksum) against nanoGPT's way with `datasets`: `load_dataset("json")`,
   `map(tokenize, batched=True, num_proc=2)` and the ids written into one `np.memmap` (twice a round, the
   second an A/A control). Tokens per second per process.

Medians over `--rounds` interleaved rounds. Not a test: nothing here gates CI.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from data_scale import word_corpus, word_tokenizer  # noqa: E402

from runner.data.prepare import prepare  # noqa: E402

BLOCK = 8 << 20
CHECKPOINTS = {
    "full (1 process)": ["hardware=cpu"],
    "sharded (fsdp, 2 processes)": ["hardware=fsdp", "hardware.device=cpu", "hardware.num_processes=2"],
}


def dropped(path: Path) -> None:
    """Drop `path`'s pages (every file under it) from the page cache: the next read is the disk's."""
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_rates(directory: Path, size: int) -> tuple[float, float]:
    """(write, read) GB/s of `size` bytes in `BLOCK`s: written and fsync'd, then read from the disk."""
    path = directory / "disk.bin"
    block = os.urandom(BLOCK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // BLOCK):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - start
    dropped(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(BLOCK):
            pass
    read = time.perf_counter() - start
    path.unlink()
    return size / write / 1e9, size / read / 1e9


def runner_run(run_dir: Path, overrides: list[str]) -> dict[str, float]:
    """The goodput ledger's phases (seconds) of one `python -m runner` command."""
    command = [
        sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", "trainer.progress_bar=false", "tracker=none",
        "trainer.plots=false", "trainer.eval_every=0", "trainer.save_model=false", "data.batch_size=8", *overrides,
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=run_dir.parent, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "goodput.json").read_text())["phases_s"]


def checkpoint_rates(root: Path, hardware: list[str], width: int) -> tuple[int, float, float]:
    """(checkpoint bytes, save s, load s) of one checkpoint written after step 1 and resumed from."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model = [f"model.hidden_size={width}", *hardware]
    saved = runner_run(root / "saved", [*model, "trainer.max_steps=1", "trainer.checkpoint_every=1"])
    checkpoint = root / "saved" / "checkpoints" / "checkpoint_0"
    # Each file once: the Accelerate-readable names are hard links to runner's own files.
    files = {p.stat().st_ino: p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()}
    size = sum(files.values())
    dropped(checkpoint)
    resumed = runner_run(root / "resumed", [*model, "trainer.max_steps=2", f"trainer.resume={checkpoint}"])
    shutil.rmtree(root)
    return size, saved["checkpoint"], resumed["restore"]


def runner_prepare(corpus: Path, tokenizer: Path, out: Path) -> float:
    """Tokens per second of runner's `prepare` (2 processes), into `out`."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    manifest = prepare(out, str(corpus), str(tokenizer), shard_mb=16, workers=2, progress=False)
    return manifest.tokens / (time.perf_counter() - start)


def datasets_prepare(corpus: Path, tokenizer: Path, out: Path) -> float:
    """Tokens per second of nanoGPT's prepare with `datasets` (2 processes), into `out` (one memmap)."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    start = time.perf_counter()
    encoder = AutoTokenizer.from_pretrained(tokenizer)
    eos = encoder.eos_token_id

    def tokenize(rows: dict) -> dict:
        ids = [[*row, eos] for row in encoder(rows["text"], add_special_tokens=False)["input_ids"]]
        return {"ids": ids, "len": [len(row) for row in ids]}

    rows = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(out / "cache"))
    tokenized = rows.map(tokenize, batched=True, remove_columns=["text"], num_proc=2)
    total = int(np.sum(tokenized["len"]))
    ids = np.memmap(out / "train.bin", dtype=np.uint16, mode="w+", shape=(total,))
    at = 0
    for shard in range(16):
        part = np.concatenate(tokenized.shard(16, shard, contiguous=True).with_format("numpy")["ids"])
        ids[at : at + len(part)] = part
        at += len(part)
    ids.flush()
    with open(out / "train.bin", "rb") as f:
        os.fsync(f.fileno())
    return total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--prepare-tokens", type=float, default=2e7)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    corpus = word_corpus(root / "words.jsonl", int(args.prepare_tokens))
    tokenizer = word_tokenizer(root / "tokenizer")
    disks: list[tuple[float, float]] = []
    saves: dict[str, list[float]] = {name: [] for name in CHECKPOINTS}
    loads: dict[str, list[float]] = {name: [] for name in CHECKPOINTS}
    sizes: dict[str, int] = {}
    prepares: dict[str, list[float]] = {
        "runner prepare-data": [],
        "datasets.map + np.memmap": [],
        "again (A/A)": [],
    }
    for _ in range(args.rounds):
        for name, hardware in CHECKPOINTS.items():
            sizes[name], save_s, load_s = checkpoint_rates(root / "checkpoints", hardware, args.width)
            saves[name].append(sizes[name] / save_s / 1e9)
            loads[name].append(sizes[name] / load_s / 1e9)
        disks += [disk_rates(root, max(sizes.values())) for _ in range(2)]
        prepares["datasets.map + np.memmap"].append(datasets_prepare(corpus, tokenizer, root / "hf"))
        prepares["runner prepare-data"].append(runner_prepare(corpus, tokenizer, root / "shards"))
        prepares["again (A/A)"].append(datasets_prepare(corpus, tokenizer, root / "hf"))
    write, read = statistics.median(d[0] for d in disks), statistics.median(d[1] for d in disks)
    aa = [d for i, d in enumerate(disks) if i % 2]
    print(f"disk ({root}): write {write:.3g} GB/s, read {read:.3g} GB/s; A/A (the second of each round): "
          f"write {statistics.median(d[0] for d in aa) / write:.2f}x, read {statistics.median(d[1] for d in aa) / read:.2f}x")  # fmt: skip
    print(f"{'checkpoint':<30} {'GB':>5} {'save GB/s':>10} {'vs disk':>8} {'load GB/s':>10} {'vs disk':>8}")
    for name in CHECKPOINTS:
        save, load = statistics.median(saves[name]), statistics.median(loads[name])
        print(
            f"{name:<30} {sizes[name] / 1e9:5.2f} {save:10.3g} {save / write:7.2f}x {load:10.3g} {load / read:7.2f}x"
        )
    reference = statistics.median(prepares["datasets.map + np.memmap"])
    print(f"{'prepare (2 processes)':<30} {'tokens/s/process':>17} {'ratio':>6}")
    for name, rates in prepares.items():
        rate = statistics.median(rates)
        print(f"{name:<30} {rate / 2:17.4g} {rate / reference:5.2f}x")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
