"""A plain multi-layer perceptron."""

from __future__ import annotations

import torch
from torch import nn

from runner.config import PositiveInt, Probability
from runner.models.checks import check_sizes


class MLP(nn.Module):
    """`num_layers` hidden layers of `hidden_size` units, then a linear head.

    `in_features` and `out_features` are usually left null in YAML: the data source provides them.
    """

    def __init__(
        self,
        in_features: PositiveInt,
        out_features: PositiveInt,
        hidden_size: PositiveInt = 256,
        num_layers: PositiveInt = 4,
        dropout: Probability = 0.0,
    ) -> None:
        super().__init__()
        check_sizes(
            dropout,
            in_features=in_features,
            out_features=out_features,
            hidden_size=hidden_size,
            num_layers=num_layers,
        )
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_size), nn.GELU(), nn.Dropout(dropout)]
            width = hidden_size
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)
