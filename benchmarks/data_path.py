"""The data path's host time per batch: from asking the loader for a batch to having it on the device, runner's
prepared loader against a plain `torch.utils.data.DataLoader` over the same memory map, in the same run:

    python benchmarks/data_path.py [--rounds 5] [--batches 200]

Two sources, GPT-124M's batch shape (8 x 1024), read in the training process (`num_workers=0`, the default):
`data=tokens` (runner's shards of 20M synthetic ids, its shuffled windows) against a plain Dataset of
nanoGPT's windows over the same shard's `np.memmap`, and `data=random_tokens` against a plain DataLoader
over the same samples. Each loader is timed whole (the batches as the loop takes them), and phase by phase
over the same batches:

- fetch: the batch sampler's indices and the samples read (`dataset.__getitems__` where the dataset has it,
  as the loader's fetcher does, else `dataset[i]` each);
- collate: the loader's `collate_fn`;
- pin: `Tensor.pin_memory()`, only where an accelerator is (a CPU-only machine has no page-locked memory
  to give: the phase is skipped and said so);
- place: the copy's launch to the device (`.to(device, non_blocking=pinned)`; on the CPU, a no-op).

runner's loader is `Accelerator.prepare(source.train_dataloader(seed))`, the loop's (`DataLoaderShard`: the
read-ahead of one batch, its position, the batch put on the device). The plain loader takes
`pin_memory=True` where an accelerator is and moves each batch itself. Rounds interleave the three (plain,
runner, plain again as an A/A control); every timing is a median of rounds, the cyclic collector paused.
Nothing here gates CI.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from data_scale import synthetic_shards  # noqa: E402

from runner import Accelerator  # noqa: E402
from runner.data import RandomTokens, TokenShards  # noqa: E402

SEQ_LEN, BATCH, VOCAB, TOKENS = 1024, 8, 50304, 20_000_000
PINNING = torch.accelerator.is_available()


class MemmapWindows(Dataset):
    """nanoGPT's windows of one shard's `np.memmap`: sample i is `seq_len + 1` ids from i * seq_len."""

    def __init__(self, path: Path, seq_len: int) -> None:
        self.path, self.seq_len = path, seq_len
        self.ids = np.memmap(path, dtype=np.uint16, mode="r")

    def __len__(self) -> int:
        return (len(self.ids) - self.seq_len - 1) // self.seq_len + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(self.ids[start : start + self.seq_len + 1].astype(np.int64))
        return {"inputs": window[:-1], "targets": window[1:]}


def placed(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=PINNING) for key, value in batch.items()}


def plain_batches(loader: DataLoader, device: torch.device) -> Iterator[Any]:
    return (placed(batch, device) for batch in loader)


def whole(batches: Callable[[], Iterator[Any]], count: int) -> float:
    """Seconds a batch, `count` batches taken as the loop takes them."""
    iterator = batches()
    next(iterator)  # the iterator's start (the sampler's first draw) is not per batch
    began = time.perf_counter()
    for _ in range(count):
        next(iterator)
    return (time.perf_counter() - began) / count


def phases(loader: DataLoader, device: torch.device, count: int) -> dict[str, float]:
    """Seconds a batch in each phase, over `count` of the loader's batches."""
    spent = dict.fromkeys(("fetch", "collate", "pin", "place"), 0.0)
    indices = iter(loader.batch_sampler)
    dataset = loader.dataset  # as the loader's fetcher reads: a batch at once where the dataset can
    fetch = getattr(dataset, "__getitems__", None) or (lambda batch: [dataset[i] for i in batch])
    next(indices)  # as in `whole`: the pass's start (a shuffle's first draw) is not per batch
    for _ in range(count):
        began = time.perf_counter()
        samples = fetch(next(indices))
        fetched = time.perf_counter()
        batch = loader.collate_fn(samples)
        collated = time.perf_counter()
        if PINNING:
            batch = {key: value.pin_memory() for key, value in batch.items()}
        pinned = time.perf_counter()
        placed(batch, device)
        done = time.perf_counter()
        for phase, seconds in zip(
            spent, (fetched - began, collated - fetched, pinned - collated, done - pinned), strict=True
        ):
            spent[phase] += seconds
    return {phase: seconds / count for phase, seconds in spent.items()}


def sources(directory: Path) -> dict[str, tuple[Any, DataLoader]]:
    """name -> (runner's data source, set up; the plain loader over the same samples)."""
    shards = synthetic_shards(directory / "shards", TOKENS, VOCAB)
    tokens = TokenShards(path=str(shards), seq_len=SEQ_LEN, batch_size=BATCH, eval_samples=8)
    random_tokens = RandomTokens(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=4096, batch_size=BATCH)
    made = {}
    for name, source in (("data=tokens", tokens), ("data=random_tokens", random_tokens)):
        source.setup()
        dataset = MemmapWindows(shards / "shard_00000.bin", SEQ_LEN) if source is tokens else source.train_set
        plain = DataLoader(dataset, batch_size=BATCH, shuffle=True, pin_memory=PINNING)
        made[name] = (source, plain)
    return made


def measure(name: str, source: Any, plain: DataLoader, args: argparse.Namespace) -> None:
    accelerator = Accelerator()
    device = accelerator.device
    runner_loader = source.train_dataloader(seed=0)
    prepared = accelerator.prepare(runner_loader)
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "runner": [], "plain again (A/A)": []}
    for _ in range(args.rounds):
        for row in rows:
            loader = runner_loader if row == "runner" else plain
            batches = (lambda: iter(prepared)) if row == "runner" else (lambda: plain_batches(plain, device))
            gc.disable()
            try:
                timing = {"whole": whole(batches, args.batches), **phases(loader, device, args.batches)}
            finally:
                gc.enable()
            rows[row].append(timing)
    medians = {
        row: {k: statistics.median(t[k] for t in timings) for k in timings[0]}
        for row, timings in rows.items()
    }
    reference = medians["plain"]["whole"]
    print(
        f"\n{name}, batch {BATCH} x {SEQ_LEN}, device {device}; microseconds a batch (medians of {args.rounds} rounds)"
    )
    print(f"{'loader':<20}{'whole':>9}{'ratio':>8}{'fetch':>9}{'collate':>9}{'pin':>7}{'place':>8}")
    for row, m in medians.items():
        pin = f"{m['pin'] * 1e6:7.0f}" if PINNING else f"{'-':>7}"
        print(
            f"{row:<20}{m['whole'] * 1e6:9.0f}{m['whole'] / reference:7.2f}x{m['fetch'] * 1e6:9.0f}"
            f"{m['collate'] * 1e6:9.0f}{pin}{m['place'] * 1e6:8.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")  # CPU-only: no pinning to do
    print(f"torch {torch.__version__}; pinning: {'yes' if PINNING else 'no (no accelerator)'}")
    with tempfile.TemporaryDirectory(prefix="runner-data-path-") as directory:
        for name, (source, plain) in sources(Path(directory)).items():
            measure(name, source, plain, args)


if __name__ == "__main__":
    main()
