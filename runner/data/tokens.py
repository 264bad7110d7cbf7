"""`data=tokens`: language-model samples read from token shards by memory map (`runner prepare-data`
writes them), in an order that takes no memory whatever the corpus' size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from runner.config import PositiveFloat, PositiveInt
from runner.data.base import DataSource
from runner.data.prepare import prepare, source_files
from runner.data.shards import TokenStore
from runner.errors import ConfigError

CHUNK = 1 << 16  # indices computed at once by the shuffled order


class TokenWindows(Dataset):
    """Windows of `seq_len + 1` tokens of `store`, every `seq_len` tokens from token `first` on: sample i
    is `{"inputs": tokens[s : s + seq_len], "targets": tokens[s + 1 : s + seq_len + 1]}` (int64)."""

    def __init__(self, store: TokenStore, seq_len: int, first: int, count: int) -> None:
        self.store, self.seq_len, self.first, self.count = store, seq_len, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        start = self.first + index * self.seq_len
        window = torch.from_numpy(self.store.read(start, start + self.seq_len + 1).astype(np.int64))
        return {"inputs": window[:-1], "targets": window[1:]}


def windows_in(tokens: int, seq_len: int) -> int:
    """How many windows of `seq_len + 1` tokens, `seq_len` apart, `tokens` tokens hold."""
    return max(0, (tokens - 1) // seq_len)


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


class TokenShards(DataSource):
    """Token shards (a directory `runner prepare-data` wrote) as windows of `seq_len + 1` tokens, read by
    memory map: each process reads only the windows of its batches, and memory does not grow with the
    corpus. The training order is a fixed function of the seed and the epoch; the eval set is `eval_path`'s
    shards, else the last `eval_samples` windows of `path`, held out.

    The settings under "what `runner prepare-data` reads" make the shards; a run checks that the shards in
    `path` were made from them (when `source` is given), and never tokenizes.

    Args:
        path: the shards' directory (where `runner prepare-data` writes).
        seq_len: tokens per training sequence.
        eval_path: a shards directory to evaluate on (e.g. prepared from a validation file); null: hold
            out the end of `path`.
        eval_samples: windows to evaluate on (null with eval_path: all of them).
        source: files, directories or glob patterns to prepare from (text, jsonl, parquet, a saved
            `datasets` dir, .npy or .bin token ids); null: the shards are taken as they are.
        tokenizer: "bytes" (one token per byte, vocabulary 256), a local tokenizer directory, or "ids"
            (the sources are token ids already).
        text_column: the field holding the text (jsonl, parquet, datasets).
        source_dtype: the dtype of raw `.bin` token ids (e.g. uint16).
        vocab_size: the vocabulary of token-id sources (null: the largest id + 1).
        shard_mb: source megabytes per shard (a shard is what one preparing process works on).
        prepare_workers: processes that prepare shards (null: one per CPU core).
    """

    def __init__(
        self,
        path: str,
        seq_len: PositiveInt = 256,
        eval_path: str | None = None,
        eval_samples: PositiveInt | None = 64,
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
        if eval_path is None and eval_samples is None:
            raise ConfigError(
                "data.eval_samples=null: without data.eval_path the eval set is the last eval_samples windows of "
                "data.path; give their number, or a data.eval_path to evaluate on."
            )
        self.path, self.eval_path = Path(path).expanduser(), eval_path
        self.seq_len, self.eval_samples = seq_len, eval_samples
        self.source, self.tokenizer, self.text_column = source, tokenizer, text_column
        self.source_dtype, self.vocab_size = source_dtype, vocab_size
        self.shard_mb, self.prepare_workers = shard_mb, prepare_workers

    def prepare(self, progress: bool = True) -> Any:
        """Write the shards of `source` to `path` (`runner prepare-data`); finished shards are kept."""
        if self.source is None:
            raise ConfigError(
                "data.source is null: name the files to prepare, e.g. data.source=corpus.txt or "
                "data.source='[a.jsonl,b.jsonl]' (directories and glob patterns too)."
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
        store = self._store(self.path, "data.path")
        windows = windows_in(len(store), self.seq_len)
        if self.eval_path is None:
            train_count = windows - self.eval_samples
            eval_store, eval_first, eval_count = store, train_count * self.seq_len, self.eval_samples
        else:
            eval_store = self._store(self.eval_path, "data.eval_path")
            if eval_store.manifest.vocab_size != store.manifest.vocab_size:
                raise ConfigError(
                    f"data.eval_path={self.eval_path!r}: its shards have a vocabulary of "
                    f"{eval_store.manifest.vocab_size}, data.path's {store.manifest.vocab_size}: prepare both "
                    "with the same tokenizer."
                )
            train_count, eval_first = windows, 0
            eval_count = min(windows_in(len(eval_store), self.seq_len), self.eval_samples or windows)
            if eval_count < 1:
                raise ConfigError(
                    f"data.eval_path={self.eval_path!r}: {len(eval_store)} tokens make no window of "
                    f"data.seq_len={self.seq_len} + 1 tokens. Use more data or a shorter seq_len."
                )
        if train_count < 1:
            raise ConfigError(
                f"data.path={str(self.path)!r}: {len(store)} tokens make {windows} window(s) of data.seq_len="
                f"{self.seq_len} + 1 tokens, none left to train on with data.eval_samples={self.eval_samples} "
                "held out. Use more data, a shorter seq_len, fewer eval samples, or a data.eval_path."
            )
        train = TokenWindows(store, self.seq_len, 0, train_count)
        eval_ = TokenWindows(eval_store, self.seq_len, eval_first, eval_count)
        return train, eval_, {"vocab_size": store.manifest.vocab_size}

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
        named = sorted(str(p.resolve()) for p in source_files(self.source))
        if made_from != named or store.manifest.tokenizer != _tokenizer_name(self.tokenizer):
            raise ConfigError(
                f"data.path={str(self.path)!r}: its shards were prepared from {len(made_from)} file(s) "
                f"({', '.join(made_from[:2])}{' ...' if len(made_from) > 2 else ''}) with tokenizer "
                f"{store.manifest.tokenizer!r}; data.source and data.tokenizer name {len(named)} file(s) "
                f"({', '.join(named[:2])}{' ...' if len(named) > 2 else ''}) and {_tokenizer_name(self.tokenizer)!r}. "
                "Prepare them again into another data.path, or set data.source=null to train on the shards as "
                "they are."
            )

    def train_dataloader(self, seed: int) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=ShuffledOrder(len(self.train_set), seed),
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(seed),
        )


def _tokenizer_name(tokenizer: str) -> str:
    """How a manifest names `tokenizer`: "bytes" and "ids" as they are, a directory by its absolute path."""
    return tokenizer if tokenizer in ("bytes", "ids") else str(Path(tokenizer).expanduser().resolve())
