"""How a model takes part in context parallel (`hardware.cp_size`, `runner.hardware.context_parallel`): the
share of each sequence a rank trains on (`SequenceShare`), and setting a model up for it (`share_model`):
runner's GPT declares `context_parallel(share)` itself; a transformers causal LM is set up from outside,
through transformers' own extension points (its AttentionInterface and `position_ids`)."""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch


class SequenceShare(Protocol):
    """Which tokens of each sequence this rank holds (of `size` equal shares), and attention over the
    whole sequences (`runner.hardware.context_parallel.ContextParallel`)."""

    size: int

    def applies(self, training: bool) -> bool:
        """Whether a forward in this mode runs on the share: in training, and in evaluation while the
        sequences are cut (Accelerate's `maybe_context_parallel`); else on whole sequences."""
        ...

    def positions(self, local_length: int, device: torch.device) -> torch.Tensor: ...

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        dropout_p: float = 0.0,
        scale: float | None = None,
    ) -> torch.Tensor: ...


def is_transformers_model(model: torch.nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.")


def share_problem(model: torch.nn.Module) -> str | None:
    """Why `model` cannot train on shares of its sequences (None: it can): it declares
    `context_parallel(share)` (runner.models.GPT), or is a transformers causal LM that can
    (`transformers_problem`)."""
    if callable(getattr(model, "context_parallel", None)):
        return None
    if is_transformers_model(model):
        return transformers_problem(model)
    return (
        f"{type(model).__name__} does not declare context parallel (a `context_parallel(share)` method that puts "
        "its positions and attention in the share's layout, as runner.models.GPT has)"
    )


def share_model(model: torch.nn.Module, share: SequenceShare) -> None:
    """Set `model` up to train on `share` of each sequence: its own `context_parallel`, or
    `share_transformers_model`; ValueError with `share_problem`'s reason for a model that cannot (a script
    that prepares it under `ParallelismConfig(cp_size=...)` learns it at `prepare`)."""
    if problem := share_problem(model):
        raise ValueError(
            f"context parallel: {problem}. Use a model that can (runner.models.GPT, a transformers causal LM "
            "such as Llama), or cp_size=1."
        )
    if callable(getattr(model, "context_parallel", None)):
        model.context_parallel(share)
    else:
        share_transformers_model(model, share)


def transformers_problem(model: torch.nn.Module) -> str | None:
    """Why the transformers `model` cannot train on a share of each sequence (`context_parallel`); None:
    it can (a causal LM that takes `position_ids` and computes its attention through transformers'
    AttentionInterface, without a sliding window)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) != name:
        return f"{name} is not a transformers causal language model"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"{name} takes no position_ids (its share's tokens need their positions in the whole sequence)"
    if not model._can_set_attn_implementation():
        return f"{name} computes its attention itself, not through transformers' AttentionInterface"
    if getattr(model.config, "sliding_window", None) is not None:
        return (
            f"{name} attends within a sliding window (sliding_window={model.config.sliding_window}), which the "
            "gathered attention does not apply (built from scratch, +model.config.sliding_window=null turns it off)"
        )
    return None


def share_transformers_model(model: torch.nn.Module, share: SequenceShare) -> None:
    """Train the transformers causal LM `model` on `share` of each sequence (context parallel): in training
    its attention runs over the keys and values of the whole sequences (`share.attention`, registered as an
    attention implementation of its own, grouped-query heads as they are) and its tokens take their
    positions in the whole sequence (`position_ids`, passed by a forward pre-hook where the caller gives
    none); in `eval()` (outside `maybe_context_parallel`) it
    attends as sdpa does. ValueError with `transformers_problem`'s reason for another model."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if problem := transformers_problem(model):
        raise ValueError(problem)

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if not share.applies(module.training):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        return share.attention(query, key, value, dropout, scale=scaling).transpose(1, 2).contiguous(), None

    def positions(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not share.applies(module.training):
            return None
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        positions = share.positions(ids.shape[1], ids.device)  # refuses sequences that were not cut
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        # A share's tokens are in their order in the whole sequence: a kept token after a masked one is
        # left padding or a gap, which the gathered (causal, unmasked) attention would attend to.
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and (mask[:, 1:] > mask[:, :-1]).any():
            raise ValueError(
                "context parallel: the attention_mask masks tokens that come before tokens it keeps (left "
                "padding, or gaps); each rank attends causally over the whole sequences and applies no padding "
                "mask (Accelerate's context parallel drops it too), so those tokens would be attended to. Pad on "
                "the right (labels -100 there), or pack the sequences without padding."
            )
        if kwargs.get("position_ids") is None:  # given ones were cut with the inputs
            kwargs["position_ids"] = positions.unsqueeze(0)
        return args, kwargs

    implementation = f"runner_context_parallel_{id(share)}"
    AttentionInterface.register(implementation, attention)
    AttentionMaskInterface.register(implementation, sdpa_mask)  # evaluation's mask, as sdpa's
    model.set_attn_implementation(implementation)
    model.register_forward_pre_hook(positions, with_kwargs=True)
