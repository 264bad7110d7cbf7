"""Chat and instruction data (`data=chat`, the `hf` extra): conversations rendered by the tokenizer's
chat template, the loss on the assistant's tokens only, one conversation a row or several packed into one."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import transformers

from runner.cluster import launched_environment
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
from runner.data.hf import FORMATS, load_tokenizer, read_rows
from runner.errors import ConfigError
from runner.task import POSITIONS

log = logging.getLogger(__name__)

IGNORED = -100  # a target that is not trained on (cross-entropy's ignore_index)
CACHE_FORMAT = 1  # a cached encoding of another layout is not read
Messages = list[dict[str, str]]


@dataclass
class Example:
    """One conversation's tokens: `inputs` and the `targets` they predict (the next token where it is the
    assistant's, else IGNORED); `row` its row in the file, counted from 1."""

    inputs: list[int]
    targets: list[int]
    row: int


class ChatData(DataSource):
    """Conversations from a local `.jsonl`/`.json`/`.parquet` file or a `save_to_disk` directory: a
    `messages_column` of `{role, content}` lists, or a `prompt_column` and a `response_column` (a user's
    turn and the assistant's answer, after `system_column`'s text where one is named). Each conversation
    is rendered by the chat template (`chat_template`, a Jinja file, else the tokenizer's) and tokenized
    once; a token is trained on when one of its characters is in an assistant turn (its text and what the
    template closes it with), every other target is masked.

    Samples are runner's: `inputs`, `targets` (shifted, masked) of `seq_len` tokens, padded at the end.
    `packing`: the training conversations are packed in their shuffled order into as few rows as they
    fit, each row's `positions` restarting at every conversation, so that the model attends within each
    conversation only (`runner.task.attends_within_documents`); evaluation keeps one conversation a row.
    A conversation longer than `seq_len` + 1 tokens is dropped (`overlong="drop"`) or cut
    (`"truncate"`); one left with no trained token is dropped. The counts are in the log.

    Args:
        path: the file or saved dataset directory (relative paths: from the directory you run in).
        tokenizer: a local tokenizer directory (`save_pretrained`'s, a fast tokenizer; never downloaded).
        seq_len: tokens per row.
        chat_template: a Jinja template file used instead of the tokenizer's chat template.
        messages_column, prompt_column, response_column, system_column: the columns read.
        packing: several conversations per training row.
        overlong: "drop" or "truncate" conversations longer than a row.
        split, eval_split: the splits of a saved DatasetDict (eval_split None: `eval_fraction` of `split`).
        eval_fraction, split_seed: the held-out share of the conversations and the seed that draws it.
    """

    @checked("data")
    def __init__(
        self,
        path: Annotated[str, Exists("path", "a file or a dataset directory written by save_to_disk, of conversations")],
        tokenizer: TokenizerDir,
        seq_len: PositiveInt = 512,
        chat_template: Annotated[str, Exists("file", "a Jinja template file, or null for the tokenizer's own")]
        | None = None,
        messages_column: str = "messages",
        prompt_column: str = "prompt",
        response_column: str = "response",
        system_column: str | None = None,
        packing: bool = False,
        overlong: Literal["drop", "truncate"] = "drop",
        split: str = "train",
        eval_split: str | None = None,
        eval_fraction: Fraction = 0.1,
        split_seed: Seed = 0,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.path = Path(path).expanduser()
        if self.path.is_file() and self.path.suffix not in READABLE:
            raise ConfigError(
                f"data.path={path!r}: unsupported file type ({self.path.resolve()}). Give a {', '.join(READABLE)} "
                "file or a dataset directory written by save_to_disk, of conversations."
            )
        self.tokenizer, self.seq_len, self.chat_template = tokenizer, seq_len, chat_template
        self.columns = {
            "messages_column": messages_column,
            "prompt_column": prompt_column,
            "response_column": response_column,
            "system_column": system_column,
        }
        self.packing, self.overlong = packing, overlong
        self.split, self.eval_split = split, eval_split
        self.eval_fraction, self.split_seed = eval_fraction, split_seed

    def load(self) -> tuple[TensorDictDataset, TensorDictDataset, dict[str, int]]:
        """The rows, from this machine's cache when the same files were encoded with the same settings
        before (by the checks before launch, or another rank); their counts in the log, once."""
        cache = machine_cache("chat_data") / f"{self._fingerprint()}.pt"
        encoded = read_cache(cache)
        if encoded is None:
            encoded = self._encode()
            write_cache(cache, encoded)
            log.info("data.path=%s: %s", self.path, encoded["summary"])
        elif launched_environment() is None:  # the checks before launch say it: the ranks read it again
            log.info("data.path=%s: %s", self.path, encoded["summary"])
        return TensorDictDataset(**encoded["train"]), TensorDictDataset(**encoded["eval"]), encoded["dims"]

    def _fingerprint(self) -> str:
        """What the rows depend on: the data, tokenizer and template files and the settings."""

        template = [] if self.chat_template is None else tree_stats(Path(self.chat_template).expanduser())
        return fingerprint(
            {
                "format": CACHE_FORMAT,
                "data": tree_stats(self.path),
                "tokenizer": tree_stats(Path(self.tokenizer).expanduser()),
                "template": template,
                "transformers": transformers.__version__,
                **self.columns,
                **{
                    key: getattr(self, key)
                    for key in (
                        "seq_len",
                        "packing",
                        "overlong",
                        "split",
                        "eval_split",
                        "eval_fraction",
                        "split_seed",
                    )
                },
            }
        )

    def _encode(self) -> dict[str, Any]:
        """Read, render, tokenize, split, fit into rows: the tensors, dims and the log's summary."""
        tokenizer = load_tokenizer(self.tokenizer)
        template = self._template(tokenizer)
        train_rows, eval_rows = read_rows(self.path, self.split, self.eval_split)
        train = encode_conversations(tokenizer, template, self._conversations(train_rows, self.split))
        if eval_rows is None:
            kept, held_out = random_split(train, self.eval_fraction, self.split_seed)
            train, evaluated = [train[i] for i in kept.indices], [train[i] for i in held_out.indices]
        else:
            evaluated = encode_conversations(
                tokenizer, template, self._conversations(eval_rows, self.eval_split)
            )
        pad = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        train_fit, train_counts = self._fit(train, "the training conversations")
        eval_fit, _ = self._fit(evaluated, "the evaluation conversations")
        rows = (
            packed_rows(train_fit, self.seq_len, pad)
            if self.packing
            else padded_rows(train_fit, self.seq_len, pad)
        )
        trained = int((rows["targets"] != IGNORED).sum())
        tokens = sum(len(example.inputs) for example in train_fit)
        summary = (
            f"{len(train_fit)} conversations to train on, {len(eval_fit)} to evaluate"
            + "".join(f"; {count} {what}" for what, count in train_counts.items() if count)
            + f"; training tokens {tokens:,}: {trained:,} trained (the assistant's), {tokens - trained:,} masked; "
            + f"{len(rows['inputs'])} rows of {self.seq_len}"
            + (f" (packed, {tokens / rows['inputs'].numel():.0%} filled)" if self.packing else "")
        )
        return {
            "train": rows,
            "eval": padded_rows(eval_fit, self.seq_len, pad),
            "dims": {"vocab_size": len(tokenizer)},
            "summary": summary,
        }

    def _template(self, tokenizer: Any) -> str:
        """The chat template: `chat_template`'s file, else the tokenizer's; a fast tokenizer (its offsets
        say which tokens are the assistant's)."""
        if not tokenizer.is_fast:
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r}: {type(tokenizer).__name__} is not a fast tokenizer (no "
                "tokenizer.json), which data=chat needs to find the assistant's tokens. Save a fast tokenizer."
            )
        if self.chat_template is not None:
            return Path(self.chat_template).expanduser().read_text()
        if not isinstance(tokenizer.chat_template, str):
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r}: the tokenizer has no chat template (one template is needed; "
                f"it has {'several' if tokenizer.chat_template else 'none'}). Give one: data.chat_template=<a Jinja file>."
            )
        return tokenizer.chat_template

    def _conversations(self, rows: Any, split: str) -> list[tuple[int, Messages]]:
        """(row number, messages) of each row: its messages column, or its prompt and response."""
        names = self.columns
        where = f"{self.path}" + (f" (split {split!r})" if self.path.is_dir() else "")
        if len(rows) == 0:
            raise ConfigError(f"data.path={str(self.path)!r}: {where} holds no conversations.")
        if names["messages_column"] in rows.column_names:
            conversations = list(enumerate(rows[names["messages_column"]], start=1))
        elif names["prompt_column"] in rows.column_names and names["response_column"] in rows.column_names:
            conversations = list(enumerate(self._turns(rows), start=1))
        else:
            raise ConfigError(
                f"data.path={str(self.path)!r}: {where} has neither a messages column "
                f"(data.messages_column={names['messages_column']!r}: a list of {{role, content}} turns) nor prompt and "
                f"response columns (data.prompt_column={names['prompt_column']!r}, data.response_column="
                f"{names['response_column']!r}); its columns: {rows.column_names}. Name the columns it has."
            )
        for row, messages in conversations:
            check_messages(messages, f"data.path={str(self.path)!r}: row {row} of {where}")
        return conversations

    def _turns(self, rows: Any) -> list[Messages]:
        """The conversations of prompt and response columns (after a system column's text)."""
        names = self.columns
        system = rows[names["system_column"]] if names["system_column"] else [None] * len(rows)
        return [
            ([{"role": "system", "content": text}] if text is not None else [])
            + [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            for text, prompt, response in zip(
                system, rows[names["prompt_column"]], rows[names["response_column"]], strict=True
            )
        ]

    def _fit(self, examples: list[Example], which: str) -> tuple[list[Example], dict[str, int]]:
        """The examples that fit a row (`overlong`: longer ones dropped or cut) with a trained token left,
        and how many were dropped or cut."""
        overlong = (
            f"longer than data.seq_len={self.seq_len} {'dropped' if self.overlong == 'drop' else 'truncated'}"
        )
        counts = {overlong: 0, "without a trained token dropped": 0}
        kept = []
        for example in examples:
            if len(example.inputs) > self.seq_len:
                counts[overlong] += 1
                if self.overlong == "drop":
                    continue
                example = Example(
                    example.inputs[: self.seq_len], example.targets[: self.seq_len], example.row
                )
            if all(target == IGNORED for target in example.targets):
                counts["without a trained token dropped"] += 1
                continue
            kept.append(example)
        if not kept:
            raise ConfigError(
                f"data.seq_len={self.seq_len}: none of {which} ({len(examples)}) of {self.path} fits a row with an "
                "assistant token in it. Give a longer seq_len, or data.overlong=truncate."
            )
        return kept, counts


READABLE = [suffix for suffix in FORMATS if suffix not in (".txt", ".text")]


def check_messages(messages: Any, where: str) -> None:
    """ConfigError saying `where` when `messages` is not a list of `{role, content}` turns of text with
    an assistant turn among them."""
    turns = messages if isinstance(messages, list) else None
    if not turns or not all(
        isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
        for turn in turns
    ):
        raise ConfigError(
            f"{where} holds {str(messages)[:120]!r}, not a list of turns of {{'role': <text>, 'content': <text>}}. "
            "Fix the row, or drop it."
        )
    if not any(turn["role"] == "assistant" for turn in turns):
        raise ConfigError(
            f"{where} has no assistant turn, so nothing of it would be trained on. Fix the row, or drop it."
        )


def encode_conversations(
    tokenizer: Any, template: str, conversations: list[tuple[int, Messages]]
) -> list[Example]:
    """Each conversation rendered by `template` and tokenized once (a fast tokenizer's offsets); its
    targets the next tokens where one of their characters is in an assistant turn (the text the template
    adds with that turn, its header aside when the template has a generation prompt), else IGNORED."""
    texts, spans = [], []
    for row, messages in conversations:
        text, assistant = _rendered(tokenizer, template, messages, row)
        texts.append(text)
        spans.append(assistant)
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    examples = []
    for (row, _), ids, offsets, assistant in zip(
        conversations, encoded["input_ids"], encoded["offset_mapping"], spans, strict=True
    ):
        trained = [any(first < end and last > start for start, end in assistant) for first, last in offsets]
        targets = [token if keep else IGNORED for token, keep in zip(ids[1:], trained[1:], strict=True)]
        examples.append(Example(ids[:-1], targets, row))
    return examples


def _rendered(
    tokenizer: Any, template: str, messages: Messages, row: int
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans of its assistant turns: what rendering up to and
    with a turn adds to the rendering of the turns before it and the generation prompt."""

    def render(turns: Messages, prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                turns, chat_template=template, tokenize=False, add_generation_prompt=prompt
            )
        except Exception as err:  # the template's own raise_exception, a Jinja error
            raise ConfigError(
                f"row {row}: the chat template refuses the conversation ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200] if str(err) else 'no message'}). Fix the row, or give a template "
                "that takes it (data.chat_template)."
            ) from None

    text, spans = render(messages, False), []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = render(messages[:turn], True), render(messages[: turn + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ConfigError(
                f"row {row}: the chat template renders the turns before assistant turn {turn + 1} differently once "
                "it follows, so its tokens cannot be told apart. Give a template that renders each turn after "
                "the ones before it (data.chat_template)."
            )
        spans.append((len(before), len(upto)))
    return text, spans


def padded_rows(examples: list[Example], seq_len: int, pad: int) -> dict[str, torch.Tensor]:
    """One example a row, padded at the end (inputs `pad`, targets IGNORED: attention is causal, so no
    real token attends to the padding)."""
    inputs = torch.full((len(examples), seq_len), pad, dtype=torch.int64)
    targets = torch.full((len(examples), seq_len), IGNORED, dtype=torch.int64)
    for i, example in enumerate(examples):
        inputs[i, : len(example.inputs)] = torch.tensor(example.inputs)
        targets[i, : len(example.targets)] = torch.tensor(example.targets)
    return {"inputs": inputs, "targets": targets}


def packed_rows(examples: list[Example], seq_len: int, pad: int) -> dict[str, torch.Tensor]:
    """The examples in their order, each row holding as many as fit whole, the padding after them a
    document of its own; `positions`: each token's in its example."""
    rows: list[list[Example]] = [[]]
    used = 0
    for example in examples:
        if used + len(example.inputs) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(example)
        used += len(example.inputs)
    packed = [
        Example(
            [*chain.from_iterable(e.inputs for e in row)],
            [*chain.from_iterable(e.targets for e in row)],
            row[0].row,
        )
        for row in rows
    ]
    fitted = padded_rows(packed, seq_len, pad)
    positions = torch.empty_like(fitted["inputs"])
    for i, row in enumerate(rows):
        lengths = [len(e.inputs) for e in row]
        positions[i] = torch.cat([torch.arange(n) for n in [*lengths, seq_len - sum(lengths)]])
    return {**fitted, POSITIONS: positions}
