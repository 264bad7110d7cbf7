"""Next-token prediction."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from runner.task import Task


class LanguageModeling(Task):
    """Loss: token cross-entropy. Eval metrics: loss (per token) and perplexity."""

    def training_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        logits = model(batch["inputs"])
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    def evaluation_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        logits = model(batch["inputs"])
        token_loss = F.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none")
        return {"loss": token_loss.mean(-1)}  # every sequence has the same length: mean of means is exact

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "perplexity": math.exp(min(means["loss"], 50.0))}
