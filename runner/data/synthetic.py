"""Synthetic regression: a fixed random teacher network with noise."""

from __future__ import annotations

from typing import Any

import torch

from runner.data.base import DataSource, TensorDictDataset, random_split


class SyntheticRegression(DataSource):
    """`targets = sin(inputs @ W1) @ W2 + noise`, with inputs drawn from N(0, I); fully determined by `seed`."""

    def __init__(
        self,
        num_samples: int = 4096,
        num_features: int = 16,
        num_targets: int = 1,
        hidden: int = 32,
        noise: float = 0.05,
        eval_fraction: float = 0.1,
        seed: int = 0,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.num_samples = num_samples
        self.num_features = num_features
        self.num_targets = num_targets
        self.hidden = hidden
        self.noise = noise
        self.eval_fraction = eval_fraction
        self.seed = seed

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        g = torch.Generator().manual_seed(self.seed)
        inputs = torch.randn(self.num_samples, self.num_features, generator=g)
        w1 = torch.randn(self.num_features, self.hidden, generator=g) / self.num_features**0.5
        w2 = torch.randn(self.hidden, self.num_targets, generator=g) / self.hidden**0.5
        targets = torch.sin(inputs @ w1) @ w2 + self.noise * torch.randn(
            self.num_samples, self.num_targets, generator=g
        )
        train, eval_ = random_split(
            TensorDictDataset(inputs=inputs, targets=targets), self.eval_fraction, self.seed
        )
        return train, eval_, {"in_features": self.num_features, "out_features": self.num_targets}
