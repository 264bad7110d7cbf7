"""Hugging Face `datasets` (the `hf` extra): local files or a saved dataset, tokenized with a local
tokenizer, as Hugging Face batches (`input_ids`, `attention_mask`, `labels`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import torch
from torch.utils.data import DataLoader

from runner.config import Exists, Fraction, PositiveInt, Seed, TokenizerDir, checked
from runner.data.base import (
    DataSource,
    TensorDictDataset,
    fingerprint,
    machine_cache,
    random_split,
    read_cache,
    tree_stats,
    write_cache,
)
from runner.data.streaming import LINES, TextStream
from runner.data.table import check_class_labels, label_order
from runner.errors import ConfigError, install_command

try:
    import datasets
    import transformers
    from transformers import AutoTokenizer
except ImportError as err:
    raise ImportError(
        f"{err}: data=hf needs the `hf` extra: {install_command('hf')} (transformers, datasets)"
    ) from err

log = logging.getLogger(__name__)

# File suffix -> the `datasets` builder that reads it.
FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}
TASKS = ("language_modeling", "classification")
CACHE_FORMAT = (
    2  # a cached tokenization of another format (layout, or checks made when it was written) is not read
)


def load_tokenizer(name: str) -> Any:
    """The tokenizer saved in the local directory `name` (`data.tokenizer`; never downloaded)."""
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as err:  # a damaged tokenizer.json, a config naming a class that is not there
        raise ConfigError(
            f"data.tokenizer={name!r}: the tokenizer cannot be loaded ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else 'no message'}). Give a directory written "
            "whole by a tokenizer's save_pretrained."
        ) from err


def read_rows(
    path: Path, split: str, eval_split: str | None
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The rows of a data file (`FORMATS`), or of split `split` of a dataset saved with `save_to_disk`
    (and its `eval_split`'s; None: there is none, or it was not asked for), read into memory."""
    if path.is_file():
        if path.stat().st_size == 0:
            raise ConfigError(f"data.path={str(path)!r}: the file is empty.")
        shown = not datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # a bar a file would fill the console
        try:
            loaded = datasets.load_dataset(
                FORMATS[path.suffix], data_files=str(path), split="train", keep_in_memory=True
            )
        except Exception as err:  # datasets' builders raise whatever their parser raised
            raise ConfigError(
                f"data.path={str(path)!r}: cannot be read as {FORMATS[path.suffix]} "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else 'no message'}). "
                "Check that the file is whole and in the format its suffix says."
            ) from err
        finally:
            if shown:
                datasets.enable_progress_bars()
        return loaded, None
    loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    if isinstance(loaded, datasets.Dataset):
        return loaded, None
    for key, name in (("split", split), ("eval_split", eval_split)):
        if name is not None and name not in loaded:
            raise ConfigError(f"data.{key}={name!r}: {path} has the splits {sorted(loaded)}.")
    return loaded[split], loaded[eval_split] if eval_split else None


class HFDataset(DataSource):
    """A `datasets` dataset from a local file (`.json`/`.jsonl`, `.csv`, `.parquet`, `.txt`) or a directory
    written by `save_to_disk`, its `text_column` tokenized by the tokenizer in a local directory.

    `task="language_modeling"`: the texts joined (the tokenizer's end-of-sequence token between them) and
    cut into blocks of `seq_len` tokens, `labels` equal to `input_ids` (the task shifts them); `streaming`:
    tokenized as they are trained on (`runner.data.streaming`: no pass over the data first, memory that does
    not grow with it, a position of its own in checkpoints), the first `eval_rows` rows held out. `task=
    "classification"`: each text truncated and padded to `seq_len`, `labels` the class index of
    `label_column` (class labels sorted; numbers in numeric order). The eval split is `eval_split` of a
    saved DatasetDict, else `eval_fraction` of the samples, drawn with `split_seed`.

    Args:
        path: the file or saved dataset directory (relative paths: from the directory you run in).
        tokenizer: a local tokenizer directory (`save_pretrained`'s; never downloaded).
        task: "language_modeling" or "classification".
        seq_len: tokens per sample.
        text_column, label_column: the columns read.
        split, eval_split: the splits of a saved DatasetDict (eval_split None: `eval_fraction` of `split`).
        eval_fraction, split_seed: the held-out share and the seed that draws it.
        streaming: tokenize while training, endlessly (trainer.max_steps says how long), instead of once.
        eval_rows: streaming: rows held out from the start of `split` (or taken from `eval_split`).
        shuffle_blocks: streaming: blocks shuffled together (1: in the order of the text).
    """

    @checked("data")
    def __init__(
        self,
        path: Annotated[str, Exists("path", "a data file or a dataset directory written by save_to_disk")],
        tokenizer: TokenizerDir,
        task: str = "language_modeling",
        seq_len: PositiveInt = 128,
        text_column: str = "text",
        label_column: str = "label",
        split: str = "train",
        eval_split: str | None = None,
        eval_fraction: Fraction = 0.1,
        split_seed: Seed = 0,
        streaming: bool = False,
        eval_rows: PositiveInt = 1000,
        shuffle_blocks: PositiveInt = 1024,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.path = Path(path).expanduser()
        if self.path.is_file() and self.path.suffix not in FORMATS:
            raise ConfigError(
                f"data.path={path!r}: unsupported file type {self.path.suffix!r}; expected one of "
                f"{sorted(FORMATS)}, or a dataset directory written by save_to_disk."
            )
        if task not in TASKS:
            raise ConfigError(f"data.task={task!r}: expected one of {list(TASKS)}.")
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len}: must be >= 1.")
        self.tokenizer = tokenizer
        self.task = task
        self.seq_len = seq_len
        self.text_column, self.label_column = text_column, label_column
        self.split, self.eval_split = split, eval_split
        self.eval_fraction, self.split_seed = eval_fraction, split_seed
        self.streaming, self.eval_rows, self.shuffle_blocks = streaming, eval_rows, shuffle_blocks
        if streaming:
            self._check_streamable()

    def _check_streamable(self) -> None:
        """ConfigError for settings a stream cannot follow."""
        if self.task != "language_modeling":
            raise ConfigError(
                f"data.streaming=true with data.task={self.task!r}: streaming makes blocks of tokens for language "
                "modeling; a classification set is read whole (data.streaming=false)."
            )
        if self.path.is_file() and self.path.suffix not in (*LINES, ".parquet"):
            raise ConfigError(
                f"data.path={str(self.path)!r}: a {self.path.suffix} file is not streamed (a quoted field may span "
                f"lines); streaming reads {', '.join(sorted((*LINES, '.parquet')))} files and save_to_disk "
                "directories. Convert it, e.g. to parquet, or set data.streaming=false."
            )

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        """The tokenized samples, from this machine's cache when the same files were tokenized with the
        same settings before (by the launching process's checks, or another rank): tokenized once per
        machine, not once per process. Streaming: the stream, and the held-out rows' blocks."""
        if self.streaming:
            return self._stream()
        cache = machine_cache("hf_data") / f"{self._fingerprint()}.pt"
        encoded = read_cache(cache)
        if encoded is None:
            encoded = self._encode()
            write_cache(cache, encoded)
        train = TensorDictDataset(**encoded["train"])
        if encoded["eval"] is None:
            train, eval_ = random_split(train, self.eval_fraction, self.split_seed)
        else:
            eval_ = TensorDictDataset(**encoded["eval"])
        return train, eval_, encoded["dims"]

    def train_dataloader(self, seed: int) -> DataLoader:
        if not self.streaming:
            return super().train_dataloader(seed)
        return self.loader(self.train_set.with_seed(seed), batch_size=self.batch_size)

    def _stream(self) -> tuple[TextStream, TensorDictDataset, dict[str, int]]:
        tokenizer = load_tokenizer(self.tokenizer)
        if self.path.is_dir():
            columns = self._saved_split(self.split).column_names
            if self.eval_split is not None:
                self._saved_split(self.eval_split, "data.eval_split")
        elif self.path.suffix == ".parquet":
            import pyarrow.parquet as pq  # the hf extra's

            columns = pq.ParquetFile(self.path).schema_arrow.names
        else:
            columns = [self.text_column]  # a JSON line's fields are checked as it is read
        if self.text_column not in columns:
            raise ConfigError(
                f"data.text_column={self.text_column!r}: no such column in {self.path}; columns: {columns}."
            )

        def stream(split: str, held_out: int) -> TextStream:
            return TextStream(
                self.path,
                tokenizer,
                self.seq_len,
                self.text_column,
                split,
                held_out,
                shuffle_blocks=self.shuffle_blocks,
            )

        train = stream(self.split, 0 if self.eval_split else self.eval_rows)
        held_out = (stream(self.eval_split, self.eval_rows) if self.eval_split else train).held_out_texts()
        input_ids = self._token_blocks(tokenizer, held_out)
        if len(input_ids) == 0:
            raise ConfigError(
                f"data.eval_rows={self.eval_rows}: the {len(held_out)} row(s) held out for evaluation make no block "
                f"of data.seq_len={self.seq_len} tokens. Hold out more rows, or use a shorter seq_len."
            )
        eval_ = TensorDictDataset(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids.clone()
        )
        return train, eval_, {"vocab_size": len(tokenizer)}

    def _saved_split(self, split: str, key: str = "data.split") -> datasets.Dataset:
        """The split `split` of the saved dataset (a saved Dataset: all of it)."""
        loaded = datasets.load_from_disk(str(self.path))
        if isinstance(loaded, datasets.Dataset):
            return loaded
        if split not in loaded:
            raise ConfigError(f"{key}={split!r}: {self.path} has the splits {sorted(loaded)}.")
        return loaded[split]

    def _encode(self) -> dict[str, Any]:
        """Read and tokenize: the train (and eval split's) tensors and the dims they give the model."""
        tokenizer = load_tokenizer(self.tokenizer)
        train_rows, eval_rows = self._read()
        encode = self._blocks if self.task == "language_modeling" else self._classified
        train, dims = encode(tokenizer, train_rows, None)
        eval_ = None if eval_rows is None else encode(tokenizer, eval_rows, dims.get("classes"))[0]
        dims.pop("classes", None)
        return {
            "train": train.tensors,
            "eval": None if eval_ is None else eval_.tensors,
            "dims": {"vocab_size": len(tokenizer), **dims},
        }

    def _fingerprint(self) -> str:
        """What the tokenized samples depend on: the data and tokenizer files (names, sizes, times) and
        the settings that shape the samples."""

        settings = {
            "format": CACHE_FORMAT,
            "data": tree_stats(self.path),
            "tokenizer": tree_stats(Path(self.tokenizer).expanduser()),
            "transformers": transformers.__version__,
            **{
                k: getattr(self, k)
                for k in ("task", "seq_len", "text_column", "label_column", "split", "eval_split")
            },
        }
        return fingerprint(settings)

    def _read(self) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        train, eval_ = read_rows(self.path, self.split, self.eval_split)
        return self._columns(train), None if eval_ is None else self._columns(eval_)

    def _columns(self, rows: datasets.Dataset) -> datasets.Dataset:
        wanted = [self.text_column] + ([self.label_column] if self.task == "classification" else [])
        for key, column in zip(("text_column", "label_column"), wanted, strict=False):
            if column not in rows.column_names:
                raise ConfigError(
                    f"data.{key}={column!r}: no such column in {self.path}; columns: {rows.column_names}."
                )
        if len(rows) == 0:
            raise ConfigError(f"data.path={str(self.path)!r}: the dataset holds no rows.")
        texts = rows[self.text_column]
        missing = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
        if missing is not None:
            raise ConfigError(
                f"data.text_column={self.text_column!r}: row {missing + 1} of {self.path} holds "
                f"{texts[missing]!r}, not a text (a null or missing value, or another type). Give every row a text, "
                "or drop the rows without one."
            )
        return rows

    def _blocks(self, tokenizer: Any, rows: datasets.Dataset, _: Any) -> tuple[TensorDictDataset, dict]:
        """Every text's tokens, joined by the end-of-sequence token, cut into `seq_len` blocks."""
        input_ids = self._token_blocks(tokenizer, list(rows[self.text_column]))
        if len(input_ids) < 2:
            raise ConfigError(
                f"data.path={str(self.path)!r}: its tokens make {len(input_ids)} block(s) of data.seq_len={self.seq_len}; "
                "at least 2 are needed (one to train, one to evaluate). Use more text or a shorter seq_len."
            )
        dataset = TensorDictDataset(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids.clone()
        )
        return dataset, {}

    def _token_blocks(self, tokenizer: Any, texts: list[str]) -> torch.Tensor:
        """The texts' tokens, each text's followed by the end-of-sequence token, in rows of `seq_len` (the
        rest dropped)."""
        separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids: list[int] = []
        for text_ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
            ids += text_ids + separator
        blocks = len(ids) // self.seq_len
        return torch.tensor(ids[: blocks * self.seq_len], dtype=torch.int64).view(blocks, self.seq_len)

    def _classified(
        self, tokenizer: Any, rows: datasets.Dataset, classes: list[Any] | None
    ) -> tuple[TensorDictDataset, dict]:
        """Each text padded or cut to `seq_len` tokens, with its class index."""
        if tokenizer.pad_token_id is None:
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r}: the tokenizer has no padding token, which classification "
                "needs to batch texts of different lengths. Save the tokenizer with a pad_token."
            )
        encoded = tokenizer(
            list(rows[self.text_column]),
            padding="max_length",
            truncation=True,
            max_length=self.seq_len,
            return_tensors="pt",
        )
        labels = list(rows[self.label_column])
        check_class_labels(labels, f"data.label_column={self.label_column!r} of {self.path}")
        classes = classes or sorted(set(labels), key=label_order)
        if len(classes) < 2:
            raise ConfigError(
                f"data.label_column={self.label_column!r}: every row of {self.path} has the class {classes[0]!r}; a "
                "classifier needs at least two."
            )
        index = {label: i for i, label in enumerate(classes)}
        unknown = sorted({str(label) for label in labels if label not in index})
        if unknown:
            raise ConfigError(
                f"data.eval_split={self.eval_split!r}: classes {unknown} are not in the training split {classes}."
            )
        dataset = TensorDictDataset(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            labels=torch.tensor([index[label] for label in labels]),
        )
        return dataset, {"num_labels": len(classes), "classes": classes}
