"""Synthetic data: regression on a fixed random teacher network, and random token sequences."""

from __future__ import annotations

from typing import Annotated, Any

import torch

from runner.config import Fraction, NonNegativeFloat, PositiveInt, Range, Seed
from runner.data.base import DataSource, TensorDictDataset, random_split
from runner.data.text import StridedWindows
from runner.errors import ConfigError


class SyntheticRegression(DataSource):
    """`targets = sin(inputs @ W1) @ W2 + noise`, with inputs drawn from N(0, I); fully determined by `seed`."""

    def __init__(
        self,
        num_samples: PositiveInt = 4096,
        num_features: PositiveInt = 16,
        num_targets: PositiveInt = 1,
        hidden: PositiveInt = 32,
        noise: NonNegativeFloat = 0.05,
        eval_fraction: Fraction = 0.1,
        seed: Seed = 0,
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


class RandomTokens(DataSource):
    """Uniformly random token ids in windows of `seq_len` (inputs and targets shifted by one), fully determined
    by `seed`: language-model-shaped batches of any vocabulary and length, for throughput runs and smoke
    tests. There is nothing to learn beyond the uniform distribution (loss ln(vocab_size))."""

    def __init__(
        self,
        vocab_size: Annotated[int, Range(ge=2)] = 50304,
        seq_len: PositiveInt = 1024,
        num_samples: PositiveInt = 1024,
        eval_samples: PositiveInt = 16,
        seed: Seed = 0,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        sizes = {
            "vocab_size": vocab_size,
            "seq_len": seq_len,
            "num_samples": num_samples,
            "eval_samples": eval_samples,
        }
        small = {key: value for key, value in sizes.items() if value < (2 if key == "vocab_size" else 1)}
        if small:
            raise ConfigError(
                f"data: {', '.join(f'data.{k}={v}' for k, v in small.items())}: vocab_size must be >= 2 and "
                "seq_len, num_samples and eval_samples >= 1."
            )
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_samples, self.eval_samples = num_samples, eval_samples

    def load(self) -> tuple[Any, Any, dict[str, int]]:
        g = torch.Generator().manual_seed(self.seed)
        boundary = self.num_samples * self.seq_len
        tokens = torch.randint(
            self.vocab_size, (boundary + self.eval_samples * self.seq_len + 1,), generator=g
        )
        train = StridedWindows(tokens[: boundary + 1], self.seq_len, self.seq_len)
        eval_ = StridedWindows(tokens[boundary:], self.seq_len, self.seq_len)
        return train, eval_, {"vocab_size": self.vocab_size}
