"""Regression with mean squared error."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.task import Task, batch_targets, model_outputs


class Regression(Task):
    """Loss: MSE. Eval metrics: mse and mae."""

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        targets = batch_targets(batch)
        check_shapes(outputs, targets)
        return F.mse_loss(outputs, targets)

    def evaluation_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        error = model_outputs(model, batch) - batch_targets(batch)
        return {"loss": error.pow(2).mean(-1), "mae": error.abs().mean(-1)}


def check_shapes(outputs: torch.Tensor, targets: torch.Tensor) -> None:
    """ValueError unless the model's output and the targets have one shape: MSE would broadcast them
    (a (B, 1) output against (B,) targets trains on B x B differences) and train on nonsense."""
    if outputs.shape == targets.shape:
        return
    if not targets.is_floating_point():
        raise ValueError(
            f"task=regression, but the targets are class indices ({targets.dtype}, shape {tuple(targets.shape)}) "
            f"and the model's output has shape {tuple(outputs.shape)}: for data with classes use "
            "task=classification."
        )
    raise ValueError(
        f"task=regression: the model's output has shape {tuple(outputs.shape)} and the targets "
        f"{tuple(targets.shape)}; they must be equal (MSE would broadcast them). Make the model's output width "
        "the number of target values."
    )
