"""Models shipped with runner; any `torch.nn.Module` reachable by `_target_` works as well."""

from runner.models.gpt import GPT
from runner.models.mlp import MLP

__all__ = ["GPT", "MLP"]
