"""The data-source contract: datasets of dict samples, their loaders, and the model sizes they imply."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from runner.config import NonNegativeInt, PositiveInt
from runner.errors import ConfigError
from runner.files import replacing

log = logging.getLogger(__name__)


class TensorDictDataset(Dataset):
    """Samples `{name: tensor[i]}` from equally long tensors."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        lengths = {len(t) for t in tensors.values()}
        if len(lengths) != 1:
            raise ValueError(f"tensors have different lengths: { {k: len(t) for k, t in tensors.items()} }")
        self.tensors = tensors
        self.length = lengths.pop()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: t[index] for name, t in self.tensors.items()}


class Stream(IterableDataset):
    """An endless dataset that splits itself between data-parallel processes and loader workers, and knows
    where it is: a checkpoint keeps that position, and a resumed run reads on from it without reading again
    what was trained on (`runner.engine.data_loader` does both for a prepared loader of one).

    Each loader worker of each process reads a stream of its own, its role among the loader's workers. In
    the process or worker iterating it, `position` is (that role, the state after the last sample it
    yielded); `start_from` tells the next pass where each role resumes, and which role loader worker 0
    takes (the one whose batch is due next).
    """

    num_shards: int
    position: tuple[int, dict[str, Any]] | None

    @abstractmethod
    def shard(self, num_shards: int, index: int) -> Stream:
        """The stream of data-parallel process `index` of `num_shards`."""

    @abstractmethod
    def start_from(self, starts: dict[int, dict[str, Any]], rotation: int) -> None:
        """Resume each role at its state in `starts` (a role not in it: at the start); worker 0 reads role
        `rotation`."""

    @abstractmethod
    def check_readers(self, readers: int) -> None:
        """A ConfigError when `readers` streams (processes x loader workers) cannot each have data."""


class DataSource(ABC):
    """Loads a train and an eval dataset and builds their DataLoaders.

    Samples are dicts with an "inputs" and a "targets" entry. `dims` names the model constructor arguments
    this data determines (e.g. `in_features`, `vocab_size`); the runner fills them into the model config.

    Args:
        batch_size: samples per batch on each process.
        eval_batch_size: samples per eval batch (default: `batch_size`).
        num_workers: DataLoader worker processes.
        drop_last: drop the last incomplete training batch.
        pin_memory: batches in page-locked host memory, copied to the GPU without waiting (null: where
            CUDA is available; `pins_memory`).
    """

    def __init__(
        self,
        batch_size: PositiveInt = 64,
        eval_batch_size: PositiveInt | None = None,
        num_workers: NonNegativeInt = 0,
        drop_last: bool = False,
        pin_memory: bool | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"data.batch_size={batch_size}: must be a positive integer.")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ConfigError(
                f"data.eval_batch_size={eval_batch_size}: must be a positive integer, or null for batch_size."
            )
        if num_workers < 0:
            raise ConfigError(
                f"data.num_workers={num_workers}: must be >= 0 (0 loads in the training process)."
            )
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.pin_memory = pins_memory(pin_memory)
        self.dims: dict[str, int] = {}
        # dims this source's settings withhold, and why (an image source that does not flatten has no
        # `in_features`): what a model that needs one is told
        self.withheld: dict[str, str] = {}
        # A mixture's sources by name, with their shares of the draws (their weights, normalized), once
        # loaded: each sample's `SOURCE` is its source's index in this order. Empty: one source.
        self.mixture: dict[str, float] = {}

    @abstractmethod
    def load(self) -> tuple[Dataset, Dataset, dict[str, int]]:
        """Read the data: (train dataset, eval dataset, dims)."""

    def setup(self) -> None:
        self.train_set, self.eval_set, self.dims = self.load()

    def identity(self) -> str | None:
        """What the data is beyond its settings, once loaded: a fingerprint of its files' contents where the
        source knows one (token shards: their checksums), recorded with each checkpoint so that a resume on
        other contents at the same paths is refused; None: the settings say it all."""
        return None

    def overfit(self, samples: int) -> None:
        """Train and evaluate on the training set's first `samples` samples only (`trainer.overfit_batches`:
        a model that cannot drive their loss to about zero has a bug)."""
        self.train_set = self.eval_set = Subset(self.train_set, range(samples))

    def train_dataloader(self, seed: int) -> DataLoader:
        """Shuffled batches; the order is a function of `seed` (and of the epoch, through the sampler)."""
        return self.loader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=self.drop_last,
            generator=torch.Generator().manual_seed(seed),
        )

    def eval_dataloader(self) -> DataLoader:
        return self.loader(self.eval_set, batch_size=self.eval_batch_size)

    def loader(self, dataset: Dataset, **batching: Any) -> DataLoader:
        """A DataLoader of `dataset` by `batching`, with this source's workers and memory pinning."""
        return DataLoader(dataset, num_workers=self.num_workers, pin_memory=self.pin_memory, **batching)


def pins_memory(setting: bool | None) -> bool:
    """Whether loaders pin their batches: `data.pin_memory`, or (null) whether CUDA is available."""
    return torch.cuda.is_available() if setting is None else setting


def random_split(dataset: Dataset, eval_fraction: float, seed: int) -> tuple[Subset, Subset]:
    """Split `dataset` into train and eval subsets with a fixed permutation."""
    if not 0.0 < eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={eval_fraction}: must be strictly between 0 and 1.")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    num_eval = max(1, round(len(order) * eval_fraction))
    return Subset(dataset, order[num_eval:]), Subset(dataset, order[:num_eval])


def machine_cache(kind: str) -> Path:
    """Where runner keeps what it prepared from data on this machine, by kind: `$RUNNER_CACHE_DIR/<kind>`,
    else `~/.cache/runner/<kind>`."""
    return Path(os.environ.get("RUNNER_CACHE_DIR") or Path.home() / ".cache" / "runner") / kind


def file_stats(paths: Iterable[Path]) -> list[tuple[str, int, int]]:
    """(absolute path, size, modification time in ns) of each file: what a cache entry made from them
    depends on."""
    return [(str(p.resolve()), (stat := p.stat()).st_size, stat.st_mtime_ns) for p in paths]


def tree_stats(root: Path) -> list[tuple[str, int, int]]:
    """`file_stats` of the file `root`, or of every file under the directory `root` (sorted)."""
    return file_stats([root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()))


def fingerprint(content: object) -> str:
    """A short digest of JSON-able `content` (file stats, settings): a cache entry's name."""
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


def read_cache(path: Path) -> dict[str, Any] | None:
    """What `write_cache` kept at `path` (data prepared once a machine: a tokenization), or None when there
    is none or it cannot be read whole (then it is prepared again)."""
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a cut or damaged file: prepared again and replaced
        log.warning("the data cached in %s cannot be read (%s): preparing it again", path, err)
        return None


def write_cache(path: Path, encoded: dict[str, Any]) -> None:
    """Keep `encoded` for the next process, written whole or not at all (several may write at once: the
    last rename wins, with the same content); a cache that cannot be written is only a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as staging:
            torch.save(encoded, staging)
    except OSError as err:
        log.warning("could not cache the prepared data in %s (%s): each process prepares it", path, err)
