"""Regression with mean squared error."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.task import Task, batch_targets, model_outputs


class Regression(Task):
    """Loss: MSE. Eval metrics: mse and mae."""

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(outputs, batch_targets(batch))

    def evaluation_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        error = model_outputs(model, batch) - batch_targets(batch)
        return {"loss": error.pow(2).mean(-1), "mae": error.abs().mean(-1)}
