"""Classification with cross-entropy."""

from __future__ import annotations

from typing import Annotated, Any

import torch
import torch.nn.functional as F

from runner.config import Range
from runner.task import Task, batch_targets, model_outputs


class Classification(Task):
    """Loss: cross-entropy (optional label smoothing). Eval metrics: loss and accuracy. Batches are
    runner's (`inputs`, `targets`), `(inputs, targets)` tuples or Hugging Face's (`input_ids`, ..., `labels`);
    the model's output is the logits, or a transformers output's `logits`."""

    def __init__(self, label_smoothing: Annotated[float, Range(ge=0, le=1)] = 0.0) -> None:
        self.label_smoothing = label_smoothing

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, batch_targets(batch), label_smoothing=self.label_smoothing)

    def evaluation_step(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        logits, targets = model_outputs(model, batch), batch_targets(batch)
        return {
            "loss": F.cross_entropy(logits, targets, reduction="none"),
            "accuracy": (logits.argmax(-1) == targets).float(),
        }
