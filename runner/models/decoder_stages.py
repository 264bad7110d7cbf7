"""Pipeline stages of a transformers decoder-only LM (the Llama family's layout), built from its own
modules: no import of transformers until a stage runs (the `hf` extra is optional)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def is_decoder_lm(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers decoder-only causal LM laid out as the Llama family is (its base
    model's `embed_tokens`, `layers`, `norm` and `rotary_emb`, then `lm_head`): `DecoderStage` splits it."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return hasattr(model, "lm_head") and all(
        hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
    )


class DecoderStage(torch.nn.Module):
    """What one pipeline stage of a transformers decoder LM (`is_decoder_lm`) runs: the token embeddings on
    the first, the decoder layers numbered `blocks`, the final norm and `lm_head` on the last; token ids or
    hidden states in, hidden states or logits out. Its modules keep their names in the model
    (`model.layers.3...`). Attention is causal over the whole sequence: a padding mask is refused."""

    def __init__(self, model: torch.nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        prefix = model.base_model_prefix
        base = getattr(model, prefix)
        inner = torch.nn.Module()
        if first:
            inner.embed_tokens = base.embed_tokens
        inner.layers = torch.nn.ModuleDict({str(i): base.layers[i] for i in blocks})
        inner.rotary_emb = base.rotary_emb
        if last:
            inner.norm = base.norm
            self.lm_head = model.lm_head
        self.add_module(prefix, inner)
        self.prefix, self.config, self.first, self.last = prefix, model.config, first, last

    def forward(
        self,
        hidden_states: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        inner = getattr(self, self.prefix)
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "pipeline parallel runs a transformers model's stages with causal attention over whole sequences: "
                "batches with padding (zeros in attention_mask) are not supported. Pack the sequences, or use "
                "hardware.pp_size=1."
            )
        x = input_ids if hidden_states is None else hidden_states
        assert x is not None, "token ids or hidden states"
        h = inner.embed_tokens(x) if self.first else x
        position_ids = torch.arange(h.shape[1], device=h.device)[None]
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=h,
            attention_mask=None,
            position_ids=position_ids,
            **_no_cache(create_causal_mask),
        )
        rotary = inner.rotary_emb(h, position_ids=position_ids)
        for layer in inner.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        return self.lm_head(inner.norm(h)) if self.last else h


@functools.cache
def _no_cache(create_causal_mask: Any) -> dict[str, None]:
    """No key-value cache, in the name `create_causal_mask` takes: `cache` (transformers 5.x, whose
    `past_key_values` is deprecated) or `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    return {name: None}
