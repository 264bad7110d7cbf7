"""What a run's final `model/` holds: the weights as safetensors (shards with an index when large) and,
beside them, a transformers model's config, so that `from_pretrained` loads the dir; for a PEFT model its
adapter in PEFT's layout, or the merged model (`runner.models.adapters`)."""

from __future__ import annotations

from pathlib import Path

import torch

from runner.checkpoint.files import atomic_directory
from runner.checkpoint.weights import write_weights
from runner.models.adapters import is_adapted, save_adapted


def write_model_dir(
    model: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    directory: Path,
    max_shard_size: int | str = "10GB",
) -> None:
    """Write the (unwrapped) `model`, whose whole weights are `state_dict`, into `directory`, whole or not
    at all (from one process)."""
    with atomic_directory(directory) as staging:
        if is_adapted(model):
            save_adapted(model, state_dict, staging)
            return
        write_weights(state_dict, staging, max_shard_size, safe_serialization=True)
        config = getattr(model, "config", None)
        if hasattr(config, "save_pretrained"):  # a transformers model's
            config.save_pretrained(staging)
