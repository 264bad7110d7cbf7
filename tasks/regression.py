"""Regression with mean squared error."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.task import Task


class Regression(Task):
    """Loss: MSE. Eval metrics: mse and mae."""

    def training_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return F.mse_loss(model(batch["inputs"]), batch["targets"])

    def evaluation_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        error = model(batch["inputs"]) - batch["targets"]
        return {"loss": error.pow(2).mean(-1), "mae": error.abs().mean(-1)}
