"""Tabular data from a CSV or JSON-lines file (optionally gzipped)."""

from __future__ import annotations

import csv
import gzip
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Annotated, Any

import torch

from runner.config import Exists, Fraction, Seed, checked
from runner.data.base import DataSource, TensorDictDataset, random_split
from runner.errors import ConfigError


def _open(path: Path) -> IO[str]:
    return gzip.open(path, "rt", newline="") if path.suffix == ".gz" else path.open(newline="")


def _read_csv(path: Path) -> Iterator[dict[str, Any]]:
    with _open(path) as f:
        reader = csv.DictReader(f)
        for row in reader:
            if None in row or None in row.values():  # more fields than the header names, or fewer
                fields = (
                    len(row) - 1 + len(row[None]) if None in row else sum(v is not None for v in row.values())
                )
                raise ConfigError(
                    f"data.path={str(path)!r}: line {reader.line_num} has {fields} field(s) and the header "
                    f"{len(reader.fieldnames or [])}. Fix that line (a value holding a comma must be quoted)."
                )
            yield row


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with _open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


_READERS: dict[str, Callable[[Path], Iterator[dict[str, Any]]]] = {".csv": _read_csv, ".jsonl": _read_jsonl}
_TASKS = ("classification", "regression")
FLOAT32_MAX = torch.finfo(torch.float32).max  # the samples are float32
OUTLIER_STDS = 1e6  # a standardised feature this far out overflows any loss computed from it


class TableFile(DataSource):
    """Rows of a `.csv` or `.jsonl` file (`.gz` too): numeric feature columns and one target column.

    Args:
        path: the file.
        target: the target column.
        features: feature columns (default: every column but the target).
        task: "classification" (targets become class indices, sorted by label) or "regression".
        normalize: standardise features with the training split's mean and std.
        eval_fraction: share of rows held out for evaluation.
        split_seed: seed of the train/eval split.
    """

    @checked("data")
    def __init__(
        self,
        path: Annotated[str, Exists("file", "a .csv or .jsonl file (or one gzipped)")],
        target: str,
        features: list[str] | None = None,
        task: str = "classification",
        normalize: bool = True,
        eval_fraction: Fraction = 0.2,
        split_seed: Seed = 0,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.path = Path(path).expanduser()
        suffix = self.path.suffixes[-2] if self.path.suffix == ".gz" else self.path.suffix
        if suffix not in _READERS:
            raise ConfigError(
                f"data.path={str(path)!r}: unsupported file type {suffix!r}; expected one of "
                f"{sorted(_READERS)} (optionally gzipped)."
            )
        if task not in _TASKS:
            raise ConfigError(f"data.task={task!r}: expected one of {list(_TASKS)}.")
        self.reader = _READERS[suffix]
        self.target = target
        self.features = list(features) if features is not None else None
        self.task = task
        self.normalize = normalize
        self.eval_fraction = eval_fraction
        self.split_seed = split_seed

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        rows = list(self.reader(self.path))
        if not rows:
            raise ConfigError(f"data.path={str(self.path)!r}: the file holds no rows.")
        columns = list(rows[0])
        if self.target not in columns:
            raise ConfigError(
                f"data.target={self.target!r}: no such column in {self.path}; columns: {columns}."
            )
        features = self.features or [c for c in columns if c != self.target]
        missing = [c for c in features if c not in columns]
        if missing:
            raise ConfigError(f"data.features: columns {missing} are not in {self.path}; columns: {columns}.")
        inputs = torch.tensor([[_number(row, c, i) for c in features] for i, row in enumerate(rows)])
        labels = [row[self.target] for row in rows]
        if self.task == "classification":
            check_class_labels(
                labels,
                f"data.target={self.target!r} of {self.path}",
                ", or data.task=regression to predict the number",
            )
            classes = sorted(set(labels), key=label_order)
            if len(classes) < 2:
                raise ConfigError(
                    f"data.target={self.target!r}: every row of {self.path} has the class {classes[0]!r}; a "
                    "classifier needs at least two. Choose another target column, or data.task=regression."
                )
            index = {label: i for i, label in enumerate(classes)}
            targets = torch.tensor([index[label] for label in labels])
            out_features = len(classes)
        else:
            targets = torch.tensor([[_number(row, self.target, i)] for i, row in enumerate(rows)])
            peak = targets.abs().max().item()
            if peak**2 > FLOAT32_MAX:
                raise ConfigError(
                    f"data.target={self.target!r}: values reach {peak:.3g}, whose squared error overflows float32 "
                    f"(the largest is {FLOAT32_MAX:.3g}): the loss would be inf at once. Scale the target (e.g. "
                    "divide the column by its largest value) or predict its logarithm."
                )
            out_features = 1
        train, eval_ = random_split(
            TensorDictDataset(inputs=inputs, targets=targets), self.eval_fraction, self.split_seed
        )
        if self.normalize:
            train_inputs = inputs[train.indices].double()  # float32's variance of large values overflows
            mean, std = train_inputs.mean(0), train_inputs.std(0)
            std[std < 1e-6] = 1.0  # constant columns (e.g. always-blank pixels) are only centred
            standardized = (inputs.double() - mean) / std
            beyond = (standardized.abs() > OUTLIER_STDS).nonzero()
            if len(beyond):
                row, column = beyond[0].tolist()
                raise ConfigError(
                    f"data: column {features[column]!r} holds {rows[row][features[column]]!r} on data row {row + 1}, "
                    f"{standardized[row, column].abs().item():.3g} standard deviations from the training rows' mean "
                    f"({mean[column]:.3g}, std {std[column]:.3g}): a model's output and loss on it overflow float32. "
                    "Remove or clip the outlier, or scale the column."
                )
            inputs.copy_(standardized)  # the subsets index this tensor: both splits change
        return train, eval_, {"in_features": len(features), "out_features": out_features}


def _number(row: dict[str, Any], column: str, index: int) -> float:
    try:
        value = float(row[column])
    except (TypeError, ValueError):
        raise ConfigError(
            f"data: column {column!r} holds the non-numeric value {row[column]!r} on data row {index + 1}; "
            "feature columns (and a regression target) must be numbers: choose them with data.features."
        ) from None
    if math.isfinite(value) and abs(value) > FLOAT32_MAX:
        raise ConfigError(
            f"data: column {column!r} holds {row[column]!r} on data row {index + 1}, beyond float32's range "
            f"(+-{FLOAT32_MAX:.3g}), where it would be inf. Scale the column, or leave it out with data.features."
        )
    if not math.isfinite(value):
        raise ConfigError(
            f"data: column {column!r} holds {row[column]!r} on data row {index + 1}; a NaN or infinite value makes "
            "every loss NaN. Fill or drop those rows, or leave the column out with data.features."
        )
    return value


def label_order(label: Any) -> tuple[int, Any]:
    """Numeric labels in numeric order ("2" before "10"), then the others alphabetically."""
    try:
        return (0, float(label))
    except (TypeError, ValueError):
        return (1, str(label))


def check_class_labels(labels: list[Any], where: str, instead: str = "") -> None:
    """ConfigError for a label column that is not classes: a row without a label (null, or an empty CSV
    field), or numbers with fractions (a regression target), which would make each distinct value a class."""
    missing = [row + 1 for row, label in enumerate(labels) if label is None or label == ""]
    if missing:
        raise ConfigError(
            f"{where}: {len(missing)} row(s) have no label, e.g. data row(s) {missing[:5]}. Fill or drop them: a "
            "missing label is not a class."
        )
    fractions = sorted(
        {value for value in map(_as_number, labels) if value is not None and not value.is_integer()}
    )
    if fractions:
        raise ConfigError(
            f"{where}: holds numbers with fractions ({', '.join(f'{v:g}' for v in fractions[:3])}, ...: "
            f"{len(set(map(str, labels)))} distinct values in {len(labels)} rows), which classification would take "
            f"as that many classes. Give class labels (names or integers){instead}."
        )


def _as_number(label: Any) -> float | None:
    try:
        return float(label) if not isinstance(label, bool) else None
    except (TypeError, ValueError):
        return None
