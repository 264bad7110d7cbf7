"""Classification with cross-entropy."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.task import Task


class Classification(Task):
    """Loss: cross-entropy (optional label smoothing). Eval metrics: loss and accuracy."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = label_smoothing

    def training_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        logits = model(batch["inputs"])
        return F.cross_entropy(logits, batch["targets"], label_smoothing=self.label_smoothing)

    def evaluation_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        logits = model(batch["inputs"])
        return {
            "loss": F.cross_entropy(logits, batch["targets"], reduction="none"),
            "accuracy": (logits.argmax(-1) == batch["targets"]).float(),
        }
