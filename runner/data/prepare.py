"""Preparing a corpus once: text, jsonl, parquet, a saved `datasets` dir or token-id arrays, tokenized into
token shards (`runner.data.shards`) by several processes. The sources are cut into units (groups of text
files, byte ranges of a jsonl file, row groups of a parquet file, row ranges of a dataset, token ranges of
an array), each unit one shard: a re-run keeps the shards finished before an interruption and writes the
others, byte for byte as one uninterrupted run would."""

from __future__ import annotations

import glob
import json
import logging
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from runner.data.base import file_stats, fingerprint
from runner.data.shards import (
    MANIFEST,
    Manifest,
    Shard,
    finished_shard,
    read_manifest,
    shard_name,
    token_dtype,
    write_shard,
)
from runner.errors import ConfigError, install_command
from runner.files import write_json

log = logging.getLogger(__name__)

JSONL = (".jsonl", ".json")  # one document per line: the `text_column` field of a JSON object
PARQUET = (".parquet",)  # one document per row
IDS = (".npy", ".bin")  # token ids: one document per file
RECORDS = JSONL + PARQUET + IDS  # any other file is plain text: one document per file
SNIFFED_BYTES = 8000  # a file in a directory is text when these first bytes hold no NUL (git's rule)
BYTES_VOCAB = 256
BUILT_IN_TOKENIZERS = ("bytes", "chars", "ids")  # data.tokenizer values that name no tokenizer dir
CHARS_DTYPE = np.dtype("uint16")  # a character-level corpus's ids: up to 65536 distinct characters


def source_files(source: str | list[str]) -> list[Path]:
    """The sources `source` names, in order: files, directories (the files in them, sorted, but hidden
    ones and binary ones of no record suffix: a directory of code or prose is its text; a directory
    `save_to_disk` wrote is one source) and glob patterns; or a ConfigError."""
    found: list[Path] = []
    for entry in [source] if isinstance(source, str) else list(source):
        matches = (
            sorted(glob.glob(os.path.expanduser(entry), recursive=True)) if glob.has_magic(entry) else [entry]
        )
        if not matches:
            raise ConfigError(f"data.source: the pattern {entry!r} matches no file (from {Path.cwd()}).")
        for match in map(Path, matches):
            match = match.expanduser()
            if _is_saved_dataset(match) or match.is_file():
                found.append(match)
            elif match.is_dir():
                inside = _files_in(match)
                if not inside:
                    raise ConfigError(
                        f"data.source: the directory {str(match)!r} holds no text, JSON-lines, parquet or "
                        "token-id file (hidden and binary files are left out) and is not a dataset written by "
                        "save_to_disk."
                    )
                found += inside
            else:
                raise ConfigError(f"data.source: {entry!r}: no such file or directory (from {Path.cwd()}).")
    return found


def _files_in(directory: Path) -> list[Path]:
    """The files under `directory`, sorted, that a source takes: not hidden (nor in a hidden directory:
    `.git/`), and of a record suffix or text (no NUL in their first `SNIFFED_BYTES`)."""
    files = []
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(directory).parts):
            continue
        if path.suffix in RECORDS:
            files.append(path)
            continue
        with open(path, "rb") as f:
            if b"\0" not in f.read(SNIFFED_BYTES):
                files.append(path)
    return files


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def prepare(
    output: Path,
    source: str | list[str],
    tokenizer: str = "bytes",
    text_column: str = "text",
    source_dtype: str | None = None,
    vocab_size: int | None = None,
    shard_mb: float = 64.0,
    workers: int | None = None,
    progress: bool = True,
) -> Manifest:
    """Tokenize `source` into shards in `output` and write their manifest (what `TokenShards` settings
    name; see there). Shards finished by an earlier, interrupted run with the same sources and settings
    are kept; a finished `output` of the same is returned as it is, one of other sources is refused."""
    files = source_files(source)
    ids, chars = tokenizer == "ids", tokenizer == "chars"
    _check_sources(files, ids, tokenizer, source_dtype)
    text_tokenizer, vocab, dtype = _vocabulary(tokenizer, files, source_dtype, vocab_size)
    recipe = {
        "sources": [list(s) for s in source_stats(files)],
        "tokenizer": _tokenizer_record(tokenizer),
        "settings": dict(
            text_column=text_column, source_dtype=source_dtype, vocab_size=vocab_size, shard_mb=shard_mb, dtype=dtype.str
        ),
    }
    output = Path(output).expanduser()
    done = _existing(output, recipe)
    if done is not None:
        log.info("the shards in %s were prepared from these sources and settings already", output)
        return done
    output.mkdir(parents=True, exist_ok=True)
    units = list(_units(files, max(1, int(shard_mb * 2**20)), source_dtype))
    characters = characters_of(units, text_column) if chars else None
    vocab = len(characters) if characters is not None else vocab
    job = {
        "tokenizer": tokenizer,
        "text_column": text_column,
        "dtype": dtype.str,
        "source_dtype": source_dtype,
        "vocab_size": vocab,
        "recipe": fingerprint(recipe),
        "characters": characters,
    }
    made = _shards(output, units, job, dtype, workers, progress)
    if ids and vocab is None:
        vocab = max(s.max_token_id for s in made) + 1
    manifest = Manifest(
        dtype=dtype.str,
        vocab_size=vocab,
        tokenizer=recipe["tokenizer"]["name"],
        eos_token_id=None if text_tokenizer is None else text_tokenizer.eos_token_id,
        characters=characters,
        shards=made,
        sources=recipe["sources"],
        settings=recipe["settings"] | {"recipe": job["recipe"]},
    )
    write_json(output / MANIFEST, manifest.to_json())
    return manifest


def _vocabulary(
    tokenizer: str, files: list[Path], source_dtype: str | None, vocab_size: int | None
) -> tuple[Any, int | None, np.dtype]:
    """(the tokenizer directory's tokenizer or None, the vocabulary if known before reading, the ids'
    dtype): "ids" `vocab_size` (None: the largest id's, read later), "bytes" 256, "chars" up to
    `CHARS_DTYPE`'s (their number is read later), a directory its tokenizer's."""
    if tokenizer == "chars":
        return None, None, CHARS_DTYPE
    ids = tokenizer == "ids"
    text_tokenizer = None if ids else load_tokenizer(tokenizer)
    vocab = vocab_size if ids else (BYTES_VOCAB if text_tokenizer is None else len(text_tokenizer))
    return text_tokenizer, vocab, _ids_dtype(files, source_dtype) if ids and vocab is None else token_dtype(vocab)


def _check_sources(files: list[Path], ids: bool, tokenizer: str, source_dtype: str | None) -> None:
    """A ConfigError for sources the tokenizer cannot read: text with `ids`, ids without, raw .bin
    without a dtype, id files of the wrong dtype."""
    if ids != all(p.suffix in IDS for p in files):
        raise ConfigError(
            f"data.tokenizer={tokenizer!r} and data.source: token-id files ({', '.join(IDS)}) need "
            "data.tokenizer=ids, and data.tokenizer=ids needs only token-id files. Prepare text and ids into "
            "separate data.path directories."
        )
    if any(p.suffix == ".bin" for p in files) and source_dtype is None:
        raise ConfigError(
            "data.source_dtype is null: raw .bin token files hold no dtype; give theirs, e.g. data.source_dtype=uint16."
        )
    if ids:
        check_id_files(files, source_dtype)


def _shards(
    output: Path,
    units: list[dict[str, Any]],
    job: dict[str, Any],
    dtype: np.dtype,
    workers: int | None,
    progress: bool,
) -> list[Shard]:
    """Every unit's shard in `output`, in order: those an earlier run finished as they are, the rest
    tokenized by `workers` processes."""
    tagged = [unit | {"recipe": job["recipe"]} for unit in units]
    shards: list[Shard | None] = [
        finished_shard(output, shard_name(i), u, dtype) for i, u in enumerate(tagged)
    ]
    todo = [(output, i, u, job) for i, u in enumerate(tagged) if shards[i] is None]
    bar = tqdm(
        total=len(units),
        initial=len(units) - len(todo),
        unit="shard",
        disable=not progress,
        desc=f"preparing {output.name}",
    )
    with bar:
        for number, shard in _run(todo, workers):
            shards[number] = shard
            bar.update()
    return [s for s in shards if s is not None]


def _existing(output: Path, recipe: dict[str, Any]) -> Manifest | None:
    """The manifest of `output` when it was prepared by `recipe`; None when it has none; a ConfigError
    when it was prepared from other sources or settings (its shards are not overwritten) or is a file."""
    if output.exists() and not output.is_dir():
        raise ConfigError(
            f"data.path={str(output)!r}: a file is there, not a directory: `runner prepare-data` writes the shards "
            "into a directory of their own. Give another data.path (a new or an empty directory)."
        )
    if not (output / MANIFEST).is_file():
        return None
    manifest = read_manifest(output)
    if manifest.settings.get("recipe") == fingerprint(recipe):
        return manifest
    raise ConfigError(
        f"data.path={str(output)!r}: it holds token shards prepared from other sources or settings (or from "
        "files that changed since). Prepare into another data.path, or delete that directory to prepare it "
        "again."
    )


def source_stats(files: list[Path]) -> list[tuple[str, int, int]]:
    """(absolute path, size, mtime) of each source; a saved dataset directory's of all its files together."""
    stats = []
    for path in files:
        if path.is_dir():
            inner = file_stats(sorted(p for p in path.rglob("*") if p.is_file()))
            stats.append((str(path.resolve()), sum(s[1] for s in inner), max(s[2] for s in inner)))
        else:
            stats += file_stats([path])
    return stats


def tokenizer_name(tokenizer: str) -> str:
    """How a manifest names `tokenizer`: "bytes", "chars" and "ids" as they are, a directory by its
    absolute path."""
    return tokenizer if tokenizer in BUILT_IN_TOKENIZERS else str(Path(tokenizer).expanduser().resolve())


def _tokenizer_record(tokenizer: str) -> dict[str, Any]:
    """Its name, and for a directory its files' stats (what the shards depend on)."""
    name = tokenizer_name(tokenizer)
    if tokenizer in BUILT_IN_TOKENIZERS:
        return {"name": name}
    return {"name": name, "files": file_stats(sorted(p for p in Path(name).rglob("*") if p.is_file()))}


def check_id_files(files: list[Path], source_dtype: str | None) -> None:
    """ConfigError naming the file unless each token-id source is one flat array of integers: a `.npy` of
    one dimension and an integer dtype, a `.bin` of a whole number of `source_dtype` (an integer dtype)."""
    raw = np.dtype("u1")
    if source_dtype is not None:
        try:
            raw = np.dtype(source_dtype)
        except TypeError as err:
            raise ConfigError(
                f"data.source_dtype={source_dtype!r}: not a numpy dtype ({err}); give one such as uint16."
            ) from err
        if raw.kind not in "ui":
            raise ConfigError(
                f"data.source_dtype={source_dtype!r}: token ids are integers; give an integer dtype (uint16, uint32)."
            )
    for path in files:
        if path.suffix == ".bin":
            size = path.stat().st_size
            if size % raw.itemsize:
                raise ConfigError(
                    f"data.source: {path} has {size} bytes, not a whole number of data.source_dtype={source_dtype} ids "
                    f"({raw.itemsize} bytes each): the file is cut, or holds ids of another dtype."
                )
            continue
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise ConfigError(f"data.source: {path} cannot be read as a .npy array ({err}).") from err
        if array.ndim != 1:
            raise ConfigError(
                f"data.source: {path} is a {array.ndim}-D array {array.shape}: token ids are one flat array per "
                "file (a document each); save each document's ids on its own, or concatenate them (array.ravel())."
            )
        if array.dtype.kind not in "ui":
            raise ConfigError(
                f"data.source: {path} holds {array.dtype} values: token ids are integers; save them as such "
                "(array.astype(np.uint32)) rather than have them truncated."
            )


def _ids_dtype(files: list[Path], source_dtype: str | None) -> np.dtype:
    """Shards of token-id files without a given vocabulary: uint16 where every source's dtype fits it."""
    widths = [
        np.dtype(source_dtype) if p.suffix == ".bin" else np.load(p, mmap_mode="r").dtype for p in files
    ]
    fits = all(d.kind in "ui" and d.itemsize <= 2 for d in widths)
    return np.dtype("<u2") if fits else np.dtype("<u4")


_TOKENIZERS: dict[str, Any] = {}  # loaded once per process


def load_tokenizer(tokenizer: str) -> Any:
    """None for "bytes", else the transformers tokenizer in the local directory `tokenizer`."""
    if tokenizer == "bytes":
        return None
    if tokenizer not in _TOKENIZERS:
        if not (Path(tokenizer).expanduser() / "tokenizer_config.json").is_file():
            raise ConfigError(
                f'data.tokenizer={tokenizer!r}: neither "bytes", "ids" nor a tokenizer directory (no '
                f"tokenizer_config.json in {Path(tokenizer).expanduser().resolve()}). Give a local directory "
                "written by save_pretrained."
            )
        try:
            from transformers import AutoTokenizer  # the hf extra: only for its tokenizers
        except ImportError as err:
            raise ConfigError(
                f"data.tokenizer={tokenizer!r} needs the `hf` extra: {install_command('hf')}"
            ) from err
        _TOKENIZERS[tokenizer] = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    return _TOKENIZERS[tokenizer]


def _units(files: list[Path], unit_bytes: int, source_dtype: str | None) -> Iterator[dict[str, Any]]:
    """The sources cut into units of about `unit_bytes` of source each, in order."""
    texts: list[str] = []
    texts_size = 0
    for path in files:
        if not path.is_dir() and path.suffix not in RECORDS:
            texts.append(str(path.resolve()))
            texts_size += path.stat().st_size
            if texts_size >= unit_bytes:
                yield {"kind": "text", "files": texts}
                texts, texts_size = [], 0
            continue
        if texts:
            yield {"kind": "text", "files": texts}
            texts, texts_size = [], 0
        yield from _file_units(path, unit_bytes, source_dtype)
    if texts:
        yield {"kind": "text", "files": texts}


def _file_units(path: Path, unit_bytes: int, source_dtype: str | None) -> Iterator[dict[str, Any]]:
    """The units of one source that is not plain text: a saved dataset, JSONL, Parquet or token ids."""
    name = str(path.resolve())
    if path.is_dir():
        yield from _dataset_units(name, unit_bytes)
    elif path.suffix in JSONL:
        for start, stop in line_ranges(path, unit_bytes):
            yield {"kind": "jsonl", "file": name, "start": start, "stop": stop}
    elif path.suffix in PARQUET:
        yield from _parquet_units(name, unit_bytes)
    else:
        array = np.load(path, mmap_mode="r") if path.suffix == ".npy" else np.memmap(path, source_dtype, "r")
        step = max(1, unit_bytes // array.dtype.itemsize)
        for start in range(0, len(array), step):
            yield {"kind": "ids", "file": name, "start": start, "stop": min(start + step, len(array))}


def line_ranges(path: Path, unit_bytes: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """Byte ranges of `path` from byte `start` on, of about `unit_bytes`, each ending after a newline (or at
    the end)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(size, start + unit_bytes))
            f.readline()
            stop = min(size, f.tell())
            yield start, stop
            start = stop


def _parquet_units(name: str, unit_bytes: int) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq  # the hf extra's; only for parquet sources

    metadata = pq.ParquetFile(name).metadata
    groups: list[int] = []
    size = 0
    for group in range(metadata.num_row_groups):
        groups.append(group)
        size += metadata.row_group(group).total_byte_size
        if size >= unit_bytes:
            yield {"kind": "parquet", "file": name, "row_groups": groups}
            groups, size = [], 0
    if groups:
        yield {"kind": "parquet", "file": name, "row_groups": groups}


def _dataset_units(name: str, unit_bytes: int) -> Iterator[dict[str, Any]]:
    rows = _load_dataset(name)
    total = sum(p.stat().st_size for p in Path(name).glob("*.arrow")) or 1
    step = max(1, len(rows) * unit_bytes // total)
    for start in range(0, len(rows), step):
        yield {"kind": "dataset", "dir": name, "start": start, "stop": min(start + step, len(rows))}


def _load_dataset(name: str) -> Any:
    try:
        import datasets  # the hf extra; only for saved datasets
    except ImportError as err:
        raise ConfigError(
            f"data.source={name!r} is a saved dataset, which needs the `hf` extra: {install_command('hf')}"
        ) from err
    return datasets.load_from_disk(name)


def _run(
    todo: list[tuple[Path, int, dict[str, Any], dict[str, Any]]], workers: int | None
) -> Iterator[tuple[int, Shard]]:
    """Make the shards of `todo` (in this process, or in `workers` processes), as each is finished. The
    workers fork from a server that imported this module only (not from this process, whose threads a fork
    would copy mid-lock, nor by a fresh import of the whole command each), and tokenize on one thread each."""
    workers = min(len(todo), workers or os.cpu_count() or 1)
    if workers <= 1:
        yield from map(_make_shard, todo)
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with context.Pool(workers, initializer=_one_thread) as pool:  # its exit terminates: on a failure
        yield from pool.imap_unordered(_make_shard, todo)
        pool.close()  # done: the workers exit by themselves, no SIGTERM sent
        pool.join()


def _one_thread() -> None:
    """In a worker: the tokenizer's own thread pool off (the workers are the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _make_shard(task: tuple[Path, int, dict[str, Any], dict[str, Any]]) -> tuple[int, Shard]:
    output, number, unit, job = task
    dtype = np.dtype(job["dtype"])
    documents = list(_ids(unit, job, dtype) if unit["kind"] == "ids" else _encode(unit, job, dtype))
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = np.concatenate(documents) if documents else np.zeros(0, dtype)
    return number, write_shard(output, shard_name(number), tokens, starts, unit)


def _ids(unit: dict[str, Any], job: dict[str, Any], dtype: np.dtype) -> Iterator[np.ndarray]:
    """A token-id unit as one document, its ids checked against the vocabulary."""
    path = Path(unit["file"])
    array = (
        np.load(path, mmap_mode="r") if path.suffix == ".npy" else np.memmap(path, job["source_dtype"], "r")
    )
    ids = np.asarray(array[unit["start"] : unit["stop"]])
    limit = job["vocab_size"] or np.iinfo(dtype).max + 1
    if len(ids) and (ids.min() < 0 or ids.max() >= limit):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise ConfigError(
            f"data.source: {path} holds token id {bad}, outside the vocabulary [0, {limit}) "
            f"({'data.vocab_size' if job['vocab_size'] else f'what the shards dtype {dtype} holds'}). Give the "
            "vocabulary the ids come from."
        )
    yield ids.astype(dtype)


def _encode(unit: dict[str, Any], job: dict[str, Any], dtype: np.dtype) -> Iterator[np.ndarray]:
    """The token ids of each text of `unit` (the tokenizer's end-of-sequence token after each)."""
    texts = list(_texts(unit, job["text_column"]))
    if job["characters"] is not None:  # character-level: each character's index in the corpus' own
        index = {character: i for i, character in enumerate(job["characters"])}
        for text in texts:
            yield np.fromiter((index[c] for c in text), dtype=dtype, count=len(text))
        return
    loaded = load_tokenizer(job["tokenizer"])
    if loaded is None:
        for text in texts:
            yield np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
        return
    end = [] if loaded.eos_token_id is None else [loaded.eos_token_id]
    for ids in loaded(texts, add_special_tokens=False)["input_ids"]:
        yield np.array(ids + end, dtype=dtype)


def characters_of(units: list[dict[str, Any]], column: str) -> str:
    """Every character the text units hold, sorted (a character-level vocabulary: nanoGPT's
    shakespeare_char), read in one pass; a ConfigError where they are more than the ids' dtype holds."""
    found: set[str] = set()
    for unit in units:
        for text in _texts(unit, column):
            found.update(text)
    if len(found) > np.iinfo(CHARS_DTYPE).max + 1:
        raise ConfigError(
            f"data.tokenizer=chars: the sources hold {len(found)} distinct characters, more than a character-level "
            f"vocabulary of {CHARS_DTYPE} ids holds. Use data.tokenizer=bytes or a tokenizer directory."
        )
    return "".join(sorted(found))


def _texts(unit: dict[str, Any], column: str) -> Iterator[str]:
    """The texts of one unit, in order."""
    kind = unit["kind"]
    if kind == "text":
        yield from _file_texts(unit["files"])
    elif kind == "jsonl":
        yield from _jsonl_texts(unit, column)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(unit["file"]).read_row_groups(unit["row_groups"], columns=[column])
        for text in table.column(column).to_pylist():
            yield text_field({column: text}, column, unit["file"])
    else:
        for row in _load_dataset(unit["dir"]).select(range(unit["start"], unit["stop"])):
            yield text_field(row, column, unit["dir"])


def _file_texts(names: list[str]) -> Iterator[str]:
    """Each plain-text file whole, or a ConfigError naming one that is not UTF-8."""
    for name in names:
        content = Path(name).read_bytes()
        try:
            yield content.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"data.source: {name} is not UTF-8 text (byte {err.start}: {content[err.start : err.start + 4]!r}). "
                "Convert it to UTF-8, or leave it out of data.source."
            ) from err


def _jsonl_texts(unit: dict[str, Any], column: str) -> Iterator[str]:
    """The texts of a JSONL unit's lines (blank lines skipped), or a ConfigError naming a bad line."""
    with open(unit["file"], "rb") as f:
        f.seek(unit["start"])
        lines = f.read(unit["stop"] - unit["start"]).splitlines()
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{unit['file']} (line {number + 1} after byte {unit['start']})"
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ConfigError(
                f"data.source: {where} is not a JSON object ({err}). Give one JSON object per line "
                "(jsonl), each holding its text under data.text_column."
            ) from err
        yield text_field(row, column, where)


def text_field(row: Any, column: str, where: str) -> str:
    """The text under `column` of a record of `where`, or a ConfigError naming it."""
    text = row.get(column) if isinstance(row, dict) else None
    if not isinstance(text, str):
        raise ConfigError(
            f"data.text_column={column!r}: a record of {where} holds {text!r} there, not a text (fields: "
            f"{sorted(row) if isinstance(row, dict) else type(row).__name__}). Name the field that holds the text."
        )
    return text
