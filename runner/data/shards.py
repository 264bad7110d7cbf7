"""Token shards on disk: flat arrays of token ids (uint16 where the vocabulary fits, else uint32), a document
index per shard and a manifest. Each shard is written whole or not at all (its record, written last, says
it is whole); the store reads them by memory map, and checks them from their metadata before any rank
starts: sizes against the manifest, and the checksum of a shard whose file changed since it was written.

A shard `shard_00000` is three files: `.bin` (the token ids), `.idx` (int64: where each document starts in
it) and `.json` (its record: sizes, largest id, checksums, the source it came from)."""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runner.config import Exists
from runner.data.base import fingerprint, machine_cache
from runner.errors import ConfigError
from runner.files import write_bytes, write_json

log = logging.getLogger(__name__)

FORMAT = "runner-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
INDEX_DTYPE = np.dtype("<i8")
# What a setting naming a directory of shards asks for (checked as the command composes: `Exists`).
SHARDS = Exists(
    "shards",
    "a directory of token shards: `runner prepare-data` with this run's data settings (data.source, "
    "data.tokenizer) prepares them there from your text or token files",
)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype holding every id of a vocabulary of `vocab_size` (little-endian on disk)."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(number: int) -> str:
    return f"shard_{number:05d}"


@dataclass
class Shard:
    """One shard's record."""

    name: str
    tokens: int
    documents: int
    max_token_id: int  # -1: no tokens
    sha256: str  # of the .bin
    index_sha256: str  # of the .idx
    mtime_ns: int  # the .bin's when written: a file with another was copied or changed (its checksum is read)
    unit: dict[str, Any] = field(default_factory=dict)  # the part of the sources it holds
    index_mtime_ns: int | None = None  # the .idx's when written (None: a manifest from before it was kept)


@dataclass
class Manifest:
    """What a directory of shards holds and how it was made."""

    dtype: str
    vocab_size: int
    tokenizer: str  # "bytes", "chars", a tokenizer directory, or "ids" (converted token arrays)
    eos_token_id: int | None
    shards: list[Shard]
    sources: list[list[Any]]  # (path, size, mtime_ns) of each source file
    settings: dict[str, Any]  # what else shaped the shards (text_column, shard size, ...)
    characters: str | None = None  # tokenizer "chars": the vocabulary, token id i the i-th character
    format: str = FORMAT
    version: int = VERSION

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def max_token_id(self) -> int:
        return max((s.max_token_id for s in self.shards), default=-1)

    def to_json(self) -> dict[str, Any]:
        summary = {"tokens": self.tokens, "documents": self.documents, "max_token_id": self.max_token_id}
        return {"format": self.format, "version": self.version, **summary} | {
            k: v for k, v in asdict(self).items() if k not in ("format", "version")
        }

    @classmethod
    def from_json(cls, content: dict[str, Any]) -> Manifest:
        fields = {k: content[k] for k in cls.__dataclass_fields__ if k in content}
        fields["shards"] = [Shard(**s) for s in content["shards"]]
        return cls(**fields)


def _write_array(path: Path, array: np.ndarray) -> None:
    write_bytes(path, memoryview(np.ascontiguousarray(array)).cast("B"))


def write_shard(
    directory: Path, name: str, tokens: np.ndarray, starts: np.ndarray, unit: dict[str, Any]
) -> Shard:
    """Write shard `name`: the token ids (already in the manifest's dtype), the document starts, then its
    record, which marks it whole (a shard without a record is written again)."""
    _write_array(directory / f"{name}.bin", tokens)
    index = starts.astype(INDEX_DTYPE)
    _write_array(directory / f"{name}.idx", index)
    shard = Shard(
        name=name,
        tokens=len(tokens),
        documents=len(index),
        max_token_id=int(tokens.max()) if len(tokens) else -1,
        sha256=hashlib.sha256(memoryview(np.ascontiguousarray(tokens)).cast("B")).hexdigest(),
        index_sha256=hashlib.sha256(memoryview(index).cast("B")).hexdigest(),
        mtime_ns=(directory / f"{name}.bin").stat().st_mtime_ns,
        unit=unit,
        index_mtime_ns=(directory / f"{name}.idx").stat().st_mtime_ns,
    )
    write_json(directory / f"{name}.json", asdict(shard))
    return shard


def finished_shard(directory: Path, name: str, unit: dict[str, Any], dtype: np.dtype) -> Shard | None:
    """The record of shard `name` when it is whole, of `dtype` and holds `unit` (a re-run keeps it), else
    None."""
    try:
        shard = Shard(**json.loads((directory / f"{name}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if shard.unit != unit or _size_problem(directory, shard, dtype.itemsize) is not None:
        return None
    return shard


def _size_problem(directory: Path, shard: Shard, token_itemsize: int) -> str | None:
    """What is wrong with the sizes of `shard`'s files (None: nothing)."""
    for suffix, count, itemsize in (
        (".bin", shard.tokens, token_itemsize),
        (".idx", shard.documents, INDEX_DTYPE.itemsize),
    ):
        path = directory / f"{shard.name}{suffix}"
        if not path.is_file():
            return f"{path.name} is missing"
        size = path.stat().st_size
        if size != count * itemsize:
            return f"{path.name} has {size} bytes where its {count} entries take {count * itemsize}"
    return None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _content_problem(directory: Path, shard: Shard) -> str | None:
    """Whether `shard`'s token file and document index still hold what was written (`_file_problem`)."""
    return _file_problem(directory / f"{shard.name}.bin", shard.mtime_ns, shard.sha256) or _file_problem(
        directory / f"{shard.name}.idx", shard.index_mtime_ns, shard.index_sha256
    )


def _file_problem(path: Path, mtime_ns: int | None, sha256: str) -> str | None:
    """Whether `path` still holds what was written (its checksum `sha256`), without reading it where its time
    is the one recorded (`mtime_ns`): a file copied or touched since is read once, and remembered on this
    machine as checked."""
    stat = path.stat()
    if stat.st_mtime_ns == mtime_ns:
        return None
    checked = machine_cache("token_shards") / fingerprint(
        [str(path.resolve()), stat.st_size, stat.st_mtime_ns, sha256]
    )
    if checked.exists():
        return None
    log.info("%s changed or was copied since it was written: reading its checksum", path)
    if _file_sha256(path) != sha256:
        return f"{path.name} holds other data than was written (its checksum differs from the manifest's)"
    try:
        checked.parent.mkdir(parents=True, exist_ok=True)
        checked.touch()
    except OSError:
        pass  # checked again next time
    return None


class TokenStore:
    """The token ids of a directory of shards, as one sequence read by memory map (opened in each process
    when first read: a loader worker never receives the data through a pickle).

    Args:
        directory: the shards' directory (its `manifest.json`).
        key: the config key that named it, for the errors.
    """

    def __init__(self, directory: str | Path, key: str = "data.path") -> None:
        self.directory = Path(directory).expanduser()
        self.key = key
        self.manifest = read_manifest(self.directory, key)
        self.dtype = np.dtype(self.manifest.dtype)
        self.starts = [0]
        for shard in self.manifest.shards:
            self.starts.append(self.starts[-1] + shard.tokens)
        self._maps: list[np.ndarray | None] = [None] * len(self.manifest.shards)
        self._index_maps: list[np.ndarray | None] = [None] * len(self.manifest.shards)  # document starts

    def __len__(self) -> int:
        return self.starts[-1]

    def check(self) -> None:
        """ConfigError naming the key when a shard's files are missing, cut or changed, or hold ids the
        manifest's dtype or vocabulary cannot."""
        manifest, problems = self.manifest, []
        if manifest.vocab_size > np.iinfo(self.dtype).max + 1:
            problems.append(f"its dtype {manifest.dtype} cannot hold a vocabulary of {manifest.vocab_size}")
        if manifest.max_token_id >= manifest.vocab_size:
            problems.append(
                f"it holds token id {manifest.max_token_id}, beyond its vocabulary of {manifest.vocab_size}"
            )
        for shard in manifest.shards:
            problem = _size_problem(self.directory, shard, self.dtype.itemsize) or _content_problem(
                self.directory, shard
            )
            if problem:
                problems.append(problem)
        if problems:
            raise ConfigError(
                f"{self.key}={str(self.directory)!r}: the token shards there are not as their manifest says: "
                f"{'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}. Prepare them again "
                "(`runner prepare-data` with this run's data settings; finished shards that are whole are kept)."
            )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Token ids [start, stop) of the sequence (across shards)."""
        pieces = []
        while start < stop:
            number = bisect.bisect_right(self.starts, start) - 1
            end = min(stop, self.starts[number + 1])
            offset = self.starts[number]
            pieces.append(self._map(number)[start - offset : end - offset])
            start = end
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Where the documents that start in [start, stop) start, in the sequence (across shards)."""
        found = []
        number = bisect.bisect_right(self.starts, start) - 1
        while number < len(self.manifest.shards) and self.starts[number] < stop:
            offset = self.starts[number]
            index = self._index(number)
            first, last = np.searchsorted(index, [start - offset, stop - offset])
            found.append(index[first:last] + offset)
            number += 1
        return np.concatenate(found) if found else np.empty(0, dtype=INDEX_DTYPE)

    def _map(self, number: int) -> np.ndarray:
        mapped = self._maps[number]
        if mapped is None:
            path = self.directory / f"{self.manifest.shards[number].name}.bin"
            mapped = self._maps[number] = np.memmap(path, dtype=self.dtype, mode="r")
        return mapped

    def _index(self, number: int) -> np.ndarray:
        """Shard `number`'s document starts (within it)."""
        mapped = self._index_maps[number]
        if mapped is None:
            path = self.directory / f"{self.manifest.shards[number].name}.idx"
            mapped = self._index_maps[number] = np.memmap(path, dtype=INDEX_DTYPE, mode="r")
        return mapped

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_maps": [None] * len(self._maps), "_index_maps": [None] * len(self._maps)}


def read_manifest(directory: Path, key: str = "data.path") -> Manifest:
    """The manifest in `directory`, or a ConfigError naming `key` when there is none that can be read."""
    path = directory / MANIFEST
    if (problem := SHARDS.problem(key, directory)) is not None:
        raise ConfigError(problem)
    try:
        content = json.loads(path.read_text())
        if content.get("format") != FORMAT or content.get("version") != VERSION:
            raise ValueError(f"format {content.get('format')!r} version {content.get('version')!r}")
        return Manifest.from_json(content)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{key}={str(directory)!r}: {path.name} there cannot be read as a manifest of {FORMAT} version "
            f"{VERSION} ({type(err).__name__}: {err}). Prepare the shards again with `runner prepare-data`."
        ) from err
