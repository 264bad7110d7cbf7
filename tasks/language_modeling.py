"""Next-token prediction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from runner.task import HF_LABELS, Task, batch_targets, model_outputs


class LanguageModeling(Task):
    """Loss: token cross-entropy (positions labelled -100 ignored). Eval metrics: loss (per token) and
    perplexity.

    Batches are runner's (`inputs`, and `targets` already shifted by one) or Hugging Face's (`input_ids`,
    `attention_mask`, `labels` equal to the inputs: shifted here, as transformers' causal LMs do).
    """

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        logits, targets = _next_token(outputs, batch)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def evaluation_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        logits, targets = _next_token(model_outputs(model, batch), batch)
        token_loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        counted = (targets != IGNORED).sum(-1).clamp(min=1)
        return {
            "loss": token_loss.sum(-1) / counted
        }  # per sequence; equal lengths: the mean of means is exact

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "perplexity": math.exp(min(means["loss"], 50.0))}


IGNORED = -100  # cross-entropy's ignore_index: padding in Hugging Face labels


def _next_token(logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets) aligned so that position t predicts token t + 1."""
    targets = batch_targets(batch)
    if isinstance(batch, Mapping) and HF_LABELS in batch:
        return logits[:, :-1], targets[:, 1:]
    return logits, targets
