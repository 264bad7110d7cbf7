"""The task contracts: a training task turns a batch into a loss (training) and per-sample metrics
(evaluation); an inference task runs a loaded model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runner.ops import find_batch_size

HF_LABELS = "labels"  # Hugging Face batches: the targets' key; every other key is a model argument
POSITIONS = "positions"  # in a runner sample: each input's position in its document (`data.document_mask`)
SOURCE = "source"  # in a sample of a data mixture: the index of the source it was drawn from (not a model input)
# What a model whose forward takes `position_ids=` and attends within the documents they restart at has set
# True (runner's GPT; transformers' causal LMs whose attention masks follow them, `runner.models.hf`).
ATTENDS_WITHIN_DOCUMENTS = "attends_within_documents"


class Task:
    """Subclass and implement both steps; see `tasks/` for the shipped ones.

    `evaluation_step` returns per-sample values (first dimension = batch), so that averages over the eval
    set are exact across processes and uneven last batches. `summarize` derives metrics from their means.
    Before launch, `training_step` runs once on meta tensors (the first batch's shapes, no values), so
    that a model, data and task that do not fit together fail there: a step that reads values
    (`.item()`) is skipped there, and side effects should check `loss.device.type != "meta"`.
    """

    def training_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The loss to minimise on `batch`; by default `loss` of the model's outputs."""
        return self.loss(model_outputs(model, batch), batch)

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        """The training loss from the model's output tensor (`model_outputs`) for `batch`. A task that
        defines it can train under pipeline parallel, where the last stage computes it per microbatch
        (a slice of `batch`'s rows); one that only overrides `training_step` cannot."""
        raise NotImplementedError(f"{type(self).__name__} defines no loss(outputs, batch).")

    def evaluation_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        return means


class InferenceTask:
    """Runs a model loaded from `checkpoint=` (by `hardware=big_model`) and returns metrics about the run."""

    def run(self, model: torch.nn.Module) -> dict[str, float]:
        raise NotImplementedError


def trains_by_loss(task: Any) -> bool:
    """Whether `task` trains by its `loss` of the model's outputs (it defines `loss` and keeps Task's
    `training_step`), which lets a backend compute that loss where it needs to (pipeline parallel)."""
    cls = type(task)
    return (
        getattr(cls, "training_step", None) is Task.training_step
        and getattr(cls, "loss", Task.loss) is not Task.loss
    )


def model_inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments the model is called with for `batch`: runner's samples (`{"inputs", "targets"}`) and
    `(inputs, targets)` tuples pass `inputs` (and a sample's `positions` in their documents, as
    `position_ids=`: transformers' name);
    Hugging Face batches (`{"input_ids", "attention_mask", ..., "labels"}`) pass every key but the labels,
    by name. (`(dict, Mapping)`: a dict is answered before the Mapping ABC's check, 0.3 us a micro-batch.)"""
    if not isinstance(batch, (dict, Mapping)):
        return (batch[0],), {}
    if "inputs" not in batch:
        return (), {key: value for key, value in batch.items() if key != HF_LABELS}
    return (batch["inputs"],), ({"position_ids": batch[POSITIONS]} if POSITIONS in batch else {})


def attends_within_documents(model: torch.nn.Module) -> bool:
    """Whether `model` takes each token's position in its document (`position_ids=`) and attends within
    documents by them (`ATTENDS_WITHIN_DOCUMENTS`; a PEFT model answers for the model it wraps)."""
    return bool(getattr(model, ATTENDS_WITHIN_DOCUMENTS, False))


def model_outputs(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The model's output tensor for `batch` (called with `model_inputs`); of a transformers `ModelOutput`,
    the `logits`."""
    args, kwargs = model_inputs(batch)
    outputs = model(*args, **kwargs)
    if isinstance(outputs, torch.Tensor):
        return outputs
    return outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]


def batch_units(batch: Any) -> tuple[str, int]:
    """What throughput counts in `batch`: ("tokens", their number) when the model's input is token ids (an
    integer (batch, seq) tensor: runner's `inputs`, Hugging Face's `input_ids`, a tuple's first item;
    padding included, as the FLOPs are), else ("samples", the batch size)."""
    if isinstance(batch, (dict, Mapping)):
        inputs = batch["inputs"] if "inputs" in batch else batch.get("input_ids")
    else:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(inputs, torch.Tensor) and inputs.ndim:  # every batch: the inputs' rows, without a walk
        if inputs.ndim == 2 and not inputs.is_floating_point():
            return "tokens", inputs.numel()
        return "samples", inputs.shape[0]
    return "samples", find_batch_size(batch) or 1


def batch_targets(batch: Any) -> torch.Tensor:
    """The targets of `batch`: `targets`, Hugging Face's `labels`, or a tuple's second item."""
    if isinstance(batch, (dict, Mapping)):
        return batch["targets"] if "targets" in batch else batch[HF_LABELS]
    return batch[1]
