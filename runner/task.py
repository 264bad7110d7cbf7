"""The task contracts: a training task turns a batch into a loss (training) and per-sample metrics
(evaluation); an inference task runs a loaded model."""

from __future__ import annotations

from typing import Any

import torch


class Task:
    """Subclass and implement both steps; see `tasks/` for the shipped ones.

    `evaluation_step` returns per-sample values (first dimension = batch), so that averages over the eval
    set are exact across processes and uneven last batches. `summarize` derives metrics from their means.
    Before launch, `training_step` runs once on meta tensors (the first batch's shapes, no values), so
    that a model, data and task that do not fit together fail there: a step that reads values
    (`.item()`) is skipped there, and side effects should check `loss.device.type != "meta"`.
    """

    def training_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def evaluation_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        return means


class InferenceTask:
    """Runs a model loaded from `checkpoint=` (by `hardware=big_model`) and returns metrics about the run."""

    def run(self, model: torch.nn.Module) -> dict[str, float]:
        raise NotImplementedError
