"""Your task: how a batch becomes a loss, and which metrics evaluation reports."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.task import Task


class Classify(Task):
    """Cross-entropy on logits divided by `temperature`; evaluation reports loss, accuracy and the mean
    probability given to the right class."""

    def __init__(self, temperature: float = 1.0) -> None:
        if temperature <= 0:
            raise ValueError(f"task.temperature={temperature}: must be > 0")
        self.temperature = temperature

    def training_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(model(batch["inputs"]) / self.temperature, batch["targets"])

    def evaluation_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        log_probs = F.log_softmax(model(batch["inputs"]) / self.temperature, dim=-1)
        right = log_probs.gather(-1, batch["targets"][:, None]).squeeze(-1)
        return {
            "loss": -right,
            "accuracy": (log_probs.argmax(-1) == batch["targets"]).float(),
            "p_right": right.exp(),
        }
