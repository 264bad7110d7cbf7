"""Streaming a corpus: texts tokenized on the fly into blocks, as they are trained on, with no pass over the
corpus before the first step and memory that does not grow with it (`data=hf data.streaming=true`).

The training part of the source (all but the rows held out for evaluation) is cut into units: byte ranges
of a text or JSON-lines file ending at a line break, row groups of a parquet file, row ranges of a saved
dataset. Each reading stream (one per data-parallel process and loader worker) takes every S-th unit of a
seeded permutation, a new one each pass, and cuts its texts' tokens (the end-of-sequence token after each)
into blocks of `seq_len`, shuffled within windows of `shuffle_blocks`. A position (the pass, unit, row and
token where a window starts, and the blocks taken from it) is what a checkpoint keeps: a resumed stream
reads on from there, without reading what was trained on.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from runner.data.base import Stream
from runner.data.prepare import line_ranges, text_field
from runner.errors import ConfigError

LINES = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json"}
ROWS_PER_CALL = 256  # texts tokenized in one call of the tokenizer
UNIT_BYTES = 8 * 2**20  # the most source bytes in a unit
UNITS_PER_STREAM = 8  # at least, where the source is big enough: passes differ in order


@dataclass(frozen=True)
class Position:
    """Where a stream is: its window starts at token `offset` of the row at `key` (a byte offset in a
    file of lines, a row number otherwise; None: the unit's first) of the `unit`-th unit of `pass_`, and
    `taken` of the window's blocks were handed out."""

    pass_: int = 0
    unit: int = 0
    key: int | None = None
    offset: int = 0
    window: int = 0
    taken: int = 0


class TextStream(Stream):
    """The blocks of `seq_len` tokens of a text source's training part, endless (pass after pass), as
    Hugging Face batches (`input_ids`, `attention_mask`, `labels`).

    Args:
        path: a text, JSON-lines or parquet file, or a directory `save_to_disk` wrote.
        tokenizer: the loaded tokenizer (a transformers one).
        seq_len: tokens per block.
        text_column: the field holding the text (JSON lines, parquet, saved datasets).
        split: the split of a saved DatasetDict.
        held_out: rows at the start of the source that are not trained on (the eval set's).
        seed: what draws each pass's unit order and each window's shuffle.
        shuffle_blocks: blocks shuffled together (1: in order).
    """

    def __init__(
        self,
        path: Path,
        tokenizer: Any,
        seq_len: int,
        text_column: str,
        split: str,
        held_out: int,
        seed: int = 0,
        shuffle_blocks: int = 1,
    ) -> None:
        self.path, self.tokenizer, self.seq_len = path, tokenizer, seq_len
        self.text_column, self.split, self.held_out = text_column, split, held_out
        self.seed, self.shuffle_blocks = seed, shuffle_blocks
        self.separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.num_shards, self.shard_index = 1, 0
        self.starts: dict[int, Position] = {}  # by role: where each reading stream resumes
        self.rotation = 0  # the role of loader worker 0 (a resumed loader's next)
        self.position: tuple[int, dict[str, Any]] | None = None  # this reader's role, after its last block

    def with_seed(self, seed: int) -> TextStream:
        """This stream, its order drawn with `seed`, from the start."""
        copy = TextStream.__new__(TextStream)
        copy.__dict__ = {**self.__dict__, "seed": seed, "starts": {}, "rotation": 0, "position": None}
        return copy

    def held_out_texts(self) -> list[str]:
        """The texts of the first `held_out` rows (the eval set's)."""
        if self.path.is_dir():
            units = [{"kind": "dataset", "start": 0, "stop": len(self._saved())}]
        elif self.path.suffix == ".parquet":
            units = self._parquet_units(0)
        else:
            units = [{"kind": "lines", "start": 0, "stop": self.path.stat().st_size}]
        rows = (text for unit in units for _, text in self._texts(unit, None))
        return list(itertools.islice(rows, self.held_out))

    # ------------------------------------------------------------------ the Stream contract
    def shard(self, num_shards: int, index: int) -> TextStream:
        shard = self.with_seed(self.seed)
        shard.num_shards, shard.shard_index = num_shards, index
        return shard

    def start_from(self, starts: dict[int, dict[str, Any]], rotation: int) -> None:
        self.starts = {int(role): Position(**state) for role, state in starts.items()}
        self.rotation = rotation

    def check_readers(self, readers: int) -> None:
        units = len(self.units(readers))
        if units < readers:
            raise ConfigError(
                f"data.path={str(self.path)!r}: streamed, its training part makes {units} unit(s) (line ranges, "
                f"parquet row groups or dataset rows), fewer than the {readers} streams that read it (one per "
                "process and loader worker): a stream would have nothing to read. Use fewer data.num_workers or "
                "processes, more data, or (parquet) smaller row groups."
            )

    # ------------------------------------------------------------------ reading
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        role = (worker + self.rotation) % workers
        readers = self.num_shards * workers
        self.check_readers(readers)
        units = self.units(readers)
        start = self.starts.get(role, Position())
        blocks = self._blocks(units, self.shard_index * workers + role, readers, start)
        window, taken = start.window, start.taken
        while True:
            chunk = [next(blocks) for _ in range(self.shuffle_blocks)]
            begin = chunk[0][0]
            order = np.random.default_rng([self.seed, self.shard_index * workers + role, window]).permutation(
                len(chunk)
            )
            for index in range(taken, len(chunk)):
                after = Position(begin.pass_, begin.unit, begin.key, begin.offset, window, index + 1)
                self.position = (role, asdict(after))
                ids = torch.from_numpy(chunk[order[index]][1])
                yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
            window, taken = window + 1, 0

    def units(self, readers: int) -> list[dict[str, Any]]:
        """The training part cut into units, at least `UNITS_PER_STREAM` per reader where it is big enough."""
        path, first = self.path, self.held_out
        if path.is_dir():
            rows = len(self._saved())
            step = max(
                1, min((rows - first) // (readers * UNITS_PER_STREAM), _rows_in(UNIT_BYTES, path, rows))
            )
            return [
                {"kind": "dataset", "start": s, "stop": min(s + step, rows)} for s in range(first, rows, step)
            ]
        if path.suffix == ".parquet":
            return self._parquet_units(first)
        begin = _after_lines(path, first, LINES[path.suffix] == "json")
        size = path.stat().st_size - begin
        unit_bytes = max(1, min(UNIT_BYTES, size // (readers * UNITS_PER_STREAM)))
        return [
            {"kind": "lines", "start": start, "stop": stop}
            for start, stop in line_ranges(path, unit_bytes, begin)
        ]

    def _parquet_units(self, first: int) -> list[dict[str, Any]]:
        """The row groups holding rows from row `first` on (the first one from there)."""
        import pyarrow.parquet as pq  # the hf extra's

        metadata, units, row = pq.ParquetFile(self.path).metadata, [], 0
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            if row + rows > first:
                units.append({"kind": "parquet", "group": group, "first": row, "start": max(row, first)})
            row += rows
        return units

    def _blocks(
        self, units: list[dict[str, Any]], reader: int, readers: int, start: Position
    ) -> Iterator[tuple[Position, np.ndarray]]:
        """This reader's blocks from `start` on, each with the position where it begins."""
        block = np.empty(self.seq_len, dtype=np.int64)
        filled, begins = 0, start
        pass_, first, key, skip = start.pass_, start.unit, start.key, start.offset
        while True:
            own = np.random.default_rng([self.seed, pass_]).permutation(len(units))[reader::readers]
            for unit in range(first, len(own)):
                for row_key, ids in self._rows(units[own[unit]], key):
                    at, key = skip, None
                    skip = 0
                    while at < len(ids):
                        if filled == 0:
                            begins = Position(pass_, unit, row_key, at)
                        take = min(self.seq_len - filled, len(ids) - at)
                        block[filled : filled + take] = ids[at : at + take]
                        filled, at = filled + take, at + take
                        if filled == self.seq_len:
                            yield begins, block.copy()
                            filled = 0
                key = None
            pass_, first = pass_ + 1, 0

    def _rows(self, unit: dict[str, Any], key: int | None) -> Iterator[tuple[int, list[int]]]:
        """(key, token ids with the separator) of each row of `unit` from the row at `key` on."""
        texts: list[str] = []
        keys: list[int] = []
        for row_key, text in self._texts(unit, key):
            texts.append(text)
            keys.append(row_key)
            if len(texts) == ROWS_PER_CALL:
                yield from self._tokenized(keys, texts)
                texts, keys = [], []
        yield from self._tokenized(keys, texts)

    def _tokenized(self, keys: list[int], texts: list[str]) -> Iterator[tuple[int, list[int]]]:
        if texts:
            encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
            for row_key, ids in zip(keys, encoded, strict=True):
                yield row_key, ids + self.separator

    def _texts(self, unit: dict[str, Any], key: int | None) -> Iterator[tuple[int, str]]:
        """(key, text) of each row of `unit` from the row at `key` on."""
        column, path = self.text_column, self.path
        if unit["kind"] == "lines":
            json_lines = LINES[path.suffix] == "json"
            at = unit["start"] if key is None else key
            with open(path, "rb") as f:
                f.seek(at)
                while at < unit["stop"]:
                    line = f.readline()
                    row_at, at = at, at + len(line)
                    if json_lines:
                        if line.strip():
                            yield (
                                row_at,
                                text_field(_json(line, path, row_at), column, f"{path} (byte {row_at})"),
                            )
                    else:
                        yield row_at, line.rstrip(b"\r\n").decode("utf-8")
        elif unit["kind"] == "parquet":
            import pyarrow.parquet as pq

            first = unit["start"] if key is None else key
            texts = pq.ParquetFile(path).read_row_group(unit["group"], columns=[column]).column(column)
            for row, text in enumerate(texts.to_pylist()[first - unit["first"] :], first):
                yield row, text_field({column: text}, column, str(path))
        else:
            rows = self._saved()
            for begin in range(unit["start"] if key is None else key, unit["stop"], ROWS_PER_CALL):
                chunk = rows[begin : min(begin + ROWS_PER_CALL, unit["stop"])][column]
                for offset, text in enumerate(chunk):
                    yield begin + offset, text_field({column: text}, column, str(path))

    def _saved(self) -> Any:
        import datasets  # the hf extra (data=hf imports it)

        loaded = datasets.load_from_disk(str(self.path))
        return loaded if isinstance(loaded, datasets.Dataset) else loaded[self.split]


def _json(line: bytes, path: Path, at: int) -> Any:
    try:
        return json.loads(line)
    except ValueError as err:
        raise ConfigError(
            f"data.path={str(path)!r}: the line at byte {at} is not a JSON object ({err}). Streamed, a .json or "
            ".jsonl file holds one JSON object per line."
        ) from err


def _after_lines(path: Path, rows: int, json_lines: bool) -> int:
    """The byte offset after the first `rows` rows of a file of lines (blank lines are no JSON row)."""
    if not rows:
        return 0
    with open(path, "rb") as f:
        while line := f.readline():
            rows -= bool(line.strip()) or not json_lines
            if rows == 0:
                return f.tell()
    return path.stat().st_size


def _rows_in(unit_bytes: int, directory: Path, rows: int) -> int:
    """Rows of a saved dataset in about `unit_bytes` of its arrow files."""
    total = sum(p.stat().st_size for p in directory.rglob("*.arrow")) or 1
    return max(1, rows * unit_bytes // total)
