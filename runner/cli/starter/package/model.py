"""Your model: any torch.nn.Module. Arguments the data determines (in_features, out_features) are filled
in by runner when the config leaves them null."""

from __future__ import annotations

import torch
from torch import nn


class SmallNet(nn.Module):
    """One hidden layer of tanh units, then a linear layer: a score per class.

    Args:
        in_features: inputs per sample (runner fills it in from the data).
        out_features: classes (from the data).
        hidden_size: width of the hidden layer.
    """

    def __init__(self, in_features: int, out_features: int, hidden_size: int = 32) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden_size)
        self.out = nn.Linear(hidden_size, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))
