"""`data=tokens`: language-model samples read from token shards by memory map (`runner prepare-data`
writes them), in an order that takes no memory whatever the corpus' size."""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig
from torch.utils.data import DataLoader, Dataset, Sampler

from runner.config import PositiveFloat, PositiveInt
from runner.data.base import DataSource, fingerprint
from runner.data.prepare import prepare, source_files, source_stats, tokenizer_name
from runner.data.shards import SHARDS, TokenStore
from runner.errors import ConfigError
from runner.task import SOURCE

CHUNK = 1 << 16  # indices computed at once by the shuffled order
NAME = re.compile(r"[\w.-]+", re.ASCII)  # a mixture source's name, as its metrics carry it


class ShardWindows(Dataset):
    """Windows of `seq_len + 1` tokens of `store`, every `stride` tokens (None: `seq_len`) from token
    `first` on: sample i is `{"inputs": tokens[s : s + seq_len], "targets": tokens[s + 1 : s + seq_len +
    1]}` (int64, s = first + i * stride). With
    `positions`, also each input's position in its document, counted from the window's start for the
    document the window starts in (`document_positions`)."""

    def __init__(
        self,
        store: TokenStore,
        seq_len: int,
        first: int,
        count: int,
        positions: bool = False,
        stride: int | None = None,
    ) -> None:
        self.store, self.seq_len, self.first, self.count = store, seq_len, first, count
        self.positions, self.stride = positions, stride or seq_len

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        start = self.first + index * self.stride
        window = torch.from_numpy(self.store.read(start, start + self.seq_len + 1).astype(np.int64))
        sample = {"inputs": window[:-1], "targets": window[1:]}
        if self.positions:
            starts = self.store.document_starts(start + 1, start + self.seq_len) - start
            sample["positions"] = document_positions(self.seq_len, torch.from_numpy(starts))
        return sample


def document_positions(length: int, starts: torch.Tensor) -> torch.Tensor:
    """Each of `length` tokens' position in its document, where documents start at the indices `starts`
    (sorted, > 0; the first document at 0): `[0, 1, 2, 0, 1, ...]`. A causal LM given them attends within
    each document only (`runner.models.gpt.document_mask`)."""
    index = torch.arange(length)
    began = torch.zeros(length, dtype=torch.long)
    began[starts] = starts
    return index - torch.cummax(began, dim=0).values


def windows_in(tokens: int, seq_len: int, stride: int | None = None) -> int:
    """How many windows of `seq_len + 1` tokens, `stride` apart (None: `seq_len`), `tokens` tokens hold."""
    return max(0, (tokens - seq_len - 1) // (stride or seq_len) + 1)


class ShuffledOrder(Sampler[int]):
    """The indices 0 .. n-1 in a pseudo-random order drawn from (`seed`, epoch): a Feistel network over the
    next power of 4 with cycle walking, computed index by index, so it takes no memory whatever n is and
    every process draws the same order from the same seed (`set_epoch` draws the next epoch's)."""

    ROUNDS = 4

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0
        self.half_bits = max(1, (max(size - 1, 1).bit_length() + 1) // 2)

    def __len__(self) -> int:
        return self.size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        keys = torch.randint(
            0,
            2**31,
            (self.ROUNDS,),
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch),
        ).tolist()
        for start in range(0, self.size, CHUNK):
            yield from self.permute(torch.arange(start, min(start + CHUNK, self.size)), keys).tolist()

    def permute(self, indices: torch.Tensor, keys: list[int]) -> torch.Tensor:
        """Where `indices` go: the network applied until every value is below `size` (a bijection of
        0 .. size-1, since the network is one of 0 .. 4**half_bits - 1)."""
        values = self._network(indices, keys)
        outside = values >= self.size
        while outside.any():
            values[outside] = self._network(values[outside], keys)
            outside = values >= self.size
        return values

    def _network(self, values: torch.Tensor, keys: list[int]) -> torch.Tensor:
        mask = (1 << self.half_bits) - 1
        left, right = values >> self.half_bits, values & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << self.half_bits) | right


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (multiply and xor-shift; no int64 overflow)."""
    x = ((x & 0xFFFFFFFF) * 0x45D9F3B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = ((x & 0xFFFFFFFF) * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


class MixedWindows(Dataset):
    """`counts[s]` windows of each `parts[s]` in turn: index k of part s's range is its window
    (k + epoch * counts[s]) mod len(part), so that a part drawn less than it holds continues where the last
    epoch stopped, and one drawn more repeats. The sampler's shuffle mixes them. Each sample says which part
    it is from (`SOURCE`: s)."""

    def __init__(self, parts: list[Dataset], counts: list[int]) -> None:
        self.parts, self.counts, self.epoch = parts, counts, 0
        self.starts = list(itertools.accumulate(counts, initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        part = bisect.bisect_right(self.starts, index) - 1
        within = index - self.starts[part]
        sample = self.parts[part][(within + self.epoch * self.counts[part]) % len(self.parts[part])]
        return sample | {SOURCE: part}


def shares(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights`, in whole numbers that add up to it (largest remainders)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def check_mixture(sources: Any) -> None:
    """ConfigError unless `sources` is a non-empty list of {path, weight} (and an optional name) with
    positive weights and names (`source_name`) that differ."""
    entries = list(sources) if isinstance(sources, (list, tuple, ListConfig)) else None
    named: dict[str, int] = {}
    for i, entry in enumerate(entries or []):
        keys = set(entry) if isinstance(entry, (dict, DictConfig)) else None
        weight = entry.get("weight") if keys else None
        if keys not in ({"path", "weight"}, {"path", "weight", "name"}) or not isinstance(entry["path"], str):
            problem = f"data.sources[{i}]={entry!r}: expected {{path: <shards dir>, weight: <number>}}"
        elif isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            problem = f"data.sources[{i}].weight={weight!r}: a weight must be a positive finite number"
        elif not NAME.fullmatch(name := source_name(entry)):
            problem = (
                f"data.sources[{i}]: its name {name!r} is not one metrics can carry (letters, digits, '_', '-', "
                "'.')"
            )
        elif name in named:
            problem = (
                f"data.sources[{i}] and data.sources[{named[name]}] are both named {name!r} (their directories' "
                "name): each source's metrics carry its name"
            )
        else:
            named[name] = i
            continue
        raise ConfigError(
            f"{problem}. Give each source of the mixture its shards directory, a weight > 0 and, where "
            "directories share a name, a name of its own ({path: a/, weight: 0.7, name: web})."
        )
    if not entries:
        raise ConfigError(
            f"data.sources={sources!r}: expected a list of {{path, weight}}, e.g. "
            "data.sources='[{path: a/, weight: 0.7}, {path: b/, weight: 0.3}]'."
        )


def source_name(entry: Any) -> str:
    """A mixture source's name in its metrics (`eval/loss/<name>`): its `name`, else its directory's."""
    return str(entry.get("name") or Path(entry["path"]).name)


class TokenShards(DataSource):
    """Token shards (a directory `runner prepare-data` wrote) as windows of `seq_len + 1` tokens, read by
    memory map: each process reads only the windows of its batches, and memory does not grow with the
    corpus; or a weighted mixture of several such directories (`sources`). The training order is a fixed
    function of the seed and the epoch; the eval set is `eval_path`'s shards, else the last `eval_samples`
    windows of `path` (of each source, its share), held out.

    The settings under "what `runner prepare-data` reads" make the shards; a run checks that the shards in
    `path` were made from them (when `source` is given), and never tokenizes.

    Args:
        path: the shards' directory (where `runner prepare-data` writes).
        seq_len: tokens per training sequence.
        sources: a mixture instead of `path`: shards directories with weights (`[{path: a/, weight: 0.7},
            {path: b/, weight: 0.3}]`). An epoch is as many windows as they hold together, drawn from each
            in proportion to its weight (a small source repeats, a large one continues in the next epoch);
            each holds out its share of `eval_samples`.
        eval_path: a shards directory to evaluate on (e.g. prepared from a validation file); null: hold
            out the end of `path`.
        eval_samples: windows to evaluate on (null with eval_path: all of them).
        window_stride: tokens between the starts of consecutive training windows (null: seq_len, windows
            that do not overlap; 1: a window at every token, as nanoGPT's random offsets can draw), shuffled
            alike; the eval windows stay seq_len apart.
        document_mask: each token attends only to the tokens before it in its own document (windows still
            run across documents): every sample also gives the model each input's position in its
            document (`positions`), which restarts at each document's first token.
        source: files, directories or glob patterns to prepare from (text, jsonl, parquet, a saved
            `datasets` dir, .npy or .bin token ids); null: the shards are taken as they are.
        tokenizer: "bytes" (one token per byte, vocabulary 256), "chars" (one token per character, the
            vocabulary the sources' own characters, kept in the manifest), a local tokenizer directory, or
            "ids" (the sources are token ids already).
        text_column: the field holding the text (jsonl, parquet, datasets).
        source_dtype: the dtype of raw `.bin` token ids (e.g. uint16).
        vocab_size: the vocabulary of token-id sources (null: the largest id + 1).
        shard_mb: source megabytes per shard (a shard is what one preparing process works on).
        prepare_workers: processes that prepare shards (null: one per CPU core).
    """

    def __init__(  # not `checked`: `runner prepare-data` builds it to write data.path
        self,
        path: Annotated[str, SHARDS] | None = None,
        seq_len: PositiveInt = 256,
        sources: list[dict[str, Any]] | None = None,
        eval_path: Annotated[str, SHARDS] | None = None,
        eval_samples: PositiveInt | None = 64,
        window_stride: PositiveInt | None = None,
        document_mask: bool = False,
        source: str | list[str] | None = None,
        tokenizer: str = "bytes",
        text_column: str = "text",
        source_dtype: str | None = None,
        vocab_size: PositiveInt | None = None,
        shard_mb: PositiveFloat = 64.0,
        prepare_workers: PositiveInt | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        if (path is None) == (sources is None):
            raise ConfigError(
                f"data.path={path!r}, data.sources={sources!r}: give one, the shards directory to train on "
                "(data.path=shards/) or a mixture of several (data.sources='[{path: a/, weight: 0.7}, {path: b/, "
                "weight: 0.3}]', with data.path=null)."
            )
        if sources is not None:
            check_mixture(sources)
            if source is not None:
                raise ConfigError(
                    "data.source with data.sources: `runner prepare-data` prepares one directory (data.path); "
                    "prepare each of a mixture's directories on its own, then train with data.source=null."
                )
        if eval_path is None and eval_samples is None:
            raise ConfigError(
                "data.eval_samples=null: without data.eval_path the eval set is the last eval_samples windows of "
                "data.path; give their number, or a data.eval_path to evaluate on."
            )
        if window_stride is not None and window_stride > seq_len:
            raise ConfigError(
                f"data.window_stride={window_stride}: above data.seq_len={seq_len}, the tokens between windows would "
                "never be trained on. Give a stride of at most seq_len, or null (seq_len)."
            )
        self.window_stride = window_stride
        self.path = None if path is None else Path(path).expanduser()
        self.sources, self.eval_path = sources, eval_path
        self.seq_len, self.eval_samples, self.document_mask = seq_len, eval_samples, document_mask
        self.source, self.tokenizer, self.text_column = source, tokenizer, text_column
        self.source_dtype, self.vocab_size = source_dtype, vocab_size
        self.shard_mb, self.prepare_workers = shard_mb, prepare_workers

    def prepare(self, progress: bool = True) -> Any:
        """Write the shards of `source` to `path` (`runner prepare-data`); finished shards are kept."""
        if self.source is None or self.path is None:
            raise ConfigError(
                f"data.source={self.source!r}, data.path={self.path}: `runner prepare-data` needs both; name the files to prepare, e.g. data.source=corpus.txt or "
                "data.source='[a.jsonl,b.jsonl]' (directories and glob patterns too), and data.path, the "
                "directory it writes."
            )
        return prepare(
            self.path,
            self.source,
            tokenizer=self.tokenizer,
            text_column=self.text_column,
            source_dtype=self.source_dtype,
            vocab_size=self.vocab_size,
            shard_mb=self.shard_mb,
            workers=self.prepare_workers,
            progress=progress,
        )

    def load(self) -> tuple[Dataset, Dataset, dict[str, int]]:
        named = self._named_sources()
        stores = [self._store(path, key) for path, _, key in named]
        weights = [weight for _, weight, _ in named]
        eval_store = None if self.eval_path is None else self._store(self.eval_path, "data.eval_path")
        vocab = stores[0].manifest.vocab_size
        for store, (_, _, key) in zip(
            [*stores, eval_store], [*named, (None, 0, "data.eval_path")], strict=True
        ):
            if store is not None and store.manifest.vocab_size != vocab:
                raise ConfigError(
                    f"{key}={str(store.directory)!r}: its shards have a vocabulary of {store.manifest.vocab_size}, "
                    f"{named[0][2]}'s {vocab}: prepare them all with the same tokenizer."
                )
        held = [0] * len(stores) if eval_store else [max(1, n) for n in shares(self.eval_samples, weights)]
        train_parts, eval_parts = [], []
        for store, kept, (_, _, key) in zip(stores, held, named, strict=True):
            windows = windows_in(len(store), self.seq_len)
            if windows - kept < 1:
                raise ConfigError(
                    f"{key}={str(store.directory)!r}: {len(store)} tokens make {windows} window(s) of "
                    f"data.seq_len={self.seq_len} + 1 tokens, none left to train on with {kept} held out for "
                    "evaluation (data.eval_samples). Use more data, a shorter seq_len, fewer eval samples, or a "
                    "data.eval_path."
                )
            held_out = (windows - kept) * self.seq_len  # the eval windows' first token
            train = windows_in(held_out + 1, self.seq_len, self.window_stride)  # ending where they start
            train_parts.append(self._windows(store, 0, train, self.window_stride))
            eval_parts.append(self._windows(store, held_out, kept))
        if eval_store is not None:
            windows = windows_in(len(eval_store), self.seq_len)
            if windows < 1:
                raise ConfigError(
                    f"data.eval_path={self.eval_path!r}: {len(eval_store)} tokens make no window of "
                    f"data.seq_len={self.seq_len} + 1 tokens. Use more data or a shorter seq_len."
                )
            eval_parts = [self._windows(eval_store, 0, min(windows, self.eval_samples or windows))]
        self._identity = fingerprint(
            [[shard.sha256 for shard in store.manifest.shards] for store in [*stores, eval_store] if store]
        )
        if len(train_parts) == 1:
            return train_parts[0], eval_parts[0], {"vocab_size": vocab}
        self.mixture = {source_name(e): w / sum(weights) for e, w in zip(self.sources, weights, strict=True)}
        total = sum(len(part) for part in train_parts)
        if len(eval_parts) > 1:  # each source's held-out windows, each sample saying which
            eval_parts = [MixedWindows(eval_parts, [len(part) for part in eval_parts])]
        return MixedWindows(train_parts, shares(total, weights)), eval_parts[0], {"vocab_size": vocab}

    def identity(self) -> str | None:
        """The checksums of the shards trained and evaluated on (`DataSource.identity`)."""
        return getattr(self, "_identity", None)

    def _windows(self, store: TokenStore, first: int, count: int, stride: int | None = None) -> ShardWindows:
        return ShardWindows(store, self.seq_len, first, count, positions=self.document_mask, stride=stride)

    def _named_sources(self) -> list[tuple[str, float, str]]:
        """(directory, weight, config key) of each shards directory trained on."""
        if self.sources is None:
            return [(str(self.path), 1.0, "data.path")]
        return [
            (entry["path"], float(entry["weight"]), f"data.sources[{i}].path")
            for i, entry in enumerate(self.sources)
        ]

    def _store(self, path: str | Path, key: str) -> TokenStore:
        store = TokenStore(path, key)
        store.check()
        if key == "data.path":
            self._check_made_from_settings(store)
        return store

    def _check_made_from_settings(self, store: TokenStore) -> None:
        """ConfigError when `source` or `tokenizer` are given and the shards were made from others."""
        if self.source is None:
            return
        made_from = sorted(path for path, *_ in store.manifest.sources)
        files = source_files(self.source)
        named = sorted(str(p.resolve()) for p in files)
        if made_from != named or store.manifest.tokenizer != tokenizer_name(self.tokenizer):
            raise ConfigError(
                f"data.path={str(self.path)!r}: its shards were prepared from {len(made_from)} file(s) "
                f"({', '.join(made_from[:2])}{' ...' if len(made_from) > 2 else ''}) with tokenizer "
                f"{store.manifest.tokenizer!r}; data.source and data.tokenizer name {len(named)} file(s) "
                f"({', '.join(named[:2])}{' ...' if len(named) > 2 else ''}) and {tokenizer_name(self.tokenizer)!r}. "
                "Prepare them again into another data.path, or set data.source=null to train on the shards as "
                "they are."
            )
        then = {path: (size, mtime) for path, size, mtime in store.manifest.sources}
        for path, size, mtime in source_stats(files):
            if then[path] != (size, mtime):
                raise ConfigError(
                    f"data.source: {path} changed since the shards in {str(self.path)!r} were prepared from it "
                    f"({then[path][0]} bytes then, {size} now; modified {'then' if then[path][1] == mtime else 'since'}): "
                    "the run would train on its old contents. Prepare it again (`runner prepare-data` with these "
                    "settings, into another data.path or after deleting that one), or set data.source=null to train "
                    "on the shards as they are."
                )

    def train_dataloader(self, seed: int) -> DataLoader:
        return self.loader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=ShuffledOrder(len(self.train_set), seed),
            drop_last=self.drop_last,
            generator=torch.Generator().manual_seed(seed),
        )
