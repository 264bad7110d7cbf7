"""Data sources on their own: the samples they make and the sizes they give the model."""

from __future__ import annotations

import pytest
import torch

from runner.data import RandomTokens
from runner.errors import ConfigError


def loaded(**options) -> RandomTokens:
    data = RandomTokens(**options)
    data.setup()
    return data


def test_random_tokens_are_windows_of_their_vocabulary_fixed_by_the_seed():
    data = loaded(vocab_size=7, seq_len=5, num_samples=30, eval_samples=4, seed=1, batch_size=8)
    assert (len(data.train_set), len(data.eval_set), data.dims) == (30, 4, {"vocab_size": 7})
    tokens = torch.stack([data.train_set[i]["inputs"] for i in range(30)])
    assert tokens.shape == (30, 5) and tokens.min() == 0 and tokens.max() == 6
    first, second = data.train_set[0], data.train_set[1]
    assert torch.equal(first["targets"][:-1], first["inputs"][1:])  # targets are the inputs shifted by one
    assert first["targets"][-1] == second["inputs"][0]  # consecutive windows of one stream
    assert torch.equal(
        loaded(vocab_size=7, seq_len=5, num_samples=30, seed=1).train_set[3]["inputs"], tokens[3]
    )
    assert not torch.equal(
        loaded(vocab_size=7, seq_len=5, num_samples=30, seed=2).train_set[3]["inputs"], tokens[3]
    )
    assert next(iter(data.train_dataloader(seed=0)))["inputs"].shape == (8, 5)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"vocab_size": 1}, "data.vocab_size=1"),
        ({"seq_len": 0, "eval_samples": 0}, "data.seq_len=0, data.eval_samples=0"),
    ],
)
def test_random_tokens_refuse_empty_sizes(options, named):
    with pytest.raises(ConfigError, match=named):
        RandomTokens(**options)
