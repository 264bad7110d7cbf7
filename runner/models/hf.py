"""Hugging Face `transformers` models (the `hf` extra): built from a config with sizes in YAML (random
init) or from a local directory (`from_pretrained`, no network)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runner.config import PositiveInt
from runner.errors import ConfigError

try:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
except ImportError as err:  # the module names the extra to install instead of a bare import error
    raise ImportError(
        f"{err}: Hugging Face models need the `hf` extra: pip install 'runner[hf]' (transformers, datasets)"
    ) from err


def causal_lm(
    pretrained: str | None = None,
    load_weights: bool = True,
    config: Mapping[str, Any] | None = None,
    vocab_size: PositiveInt | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """A causal language model (`AutoModelForCausalLM`); its `logits` feed the language-modeling task.

    Args:
        pretrained: a local model directory (`config.json`, weights; `save_pretrained`'s or a runner run's
            `model/`): its architecture, and its weights unless `load_weights` is False (then randomly
            initialised, or filled from `checkpoint=` as `hardware=big_model` does). `config` is not read.
        config: the architecture of a model built from scratch (random init): `model_type` (llama, gpt2,
            qwen2, ...) and the settings of its config class (`hidden_size`, `num_hidden_layers`, ...).
        vocab_size: the vocabulary; None in YAML: the data's.
        overrides: settings that replace the architecture's either way (`attention_dropout`, ...).
    """
    return _build(AutoModelForCausalLM, pretrained, load_weights, config, vocab_size=vocab_size, **overrides)


def sequence_classification(
    pretrained: str | None = None,
    load_weights: bool = True,
    config: Mapping[str, Any] | None = None,
    vocab_size: PositiveInt | None = None,
    num_labels: PositiveInt | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """A sequence classifier (`AutoModelForSequenceClassification`): a transformer whose `logits` are one
    score per class. `num_labels`: the classes (None in YAML: the data's). The other arguments are
    `causal_lm`'s."""
    return _build(
        AutoModelForSequenceClassification,
        pretrained,
        load_weights,
        config,
        vocab_size=vocab_size,
        num_labels=num_labels,
        **overrides,
    )


def _build(
    auto_class: Any,
    pretrained: str | None,
    load_weights: bool,
    config: Mapping[str, Any] | None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    overrides = {key: value for key, value in overrides.items() if value is not None}
    if pretrained is not None:
        directory = Path(pretrained).expanduser()
        if not (directory / "config.json").is_file():
            raise ConfigError(
                f"model.pretrained={pretrained!r}: not a model directory (no config.json in {directory.resolve()}). "
                "Give a local directory written by save_pretrained or a runner run's model/ (runner never downloads)."
            )
        stored = AutoConfig.from_pretrained(directory, local_files_only=True)
        _check_vocab(stored, overrides)
        _check_settings(stored, overrides, "model")
        stored.update(overrides)
        if (
            load_weights and torch.get_default_device().type != "meta"
        ):  # on meta (runner's checks): the shapes
            return auto_class.from_pretrained(directory, config=stored, local_files_only=True)
        return auto_class.from_config(stored)
    settings = dict(config or {})
    model_type = settings.pop("model_type", None)
    if model_type is None:
        raise ConfigError(
            "model: give model.pretrained (a local model directory) or model.config.model_type (e.g. llama) with "
            "the sizes of a model built from scratch."
        )
    try:
        default = AutoConfig.for_model(model_type)
    except ValueError:
        known = difflib.get_close_matches(model_type, transformers.CONFIG_MAPPING.keys(), n=3)
        raise ConfigError(
            f"model.config.model_type={model_type!r}: not a transformers model type"
            f"{'; did you mean ' + ', '.join(known) + '?' if known else ''}. Use one transformers knows (llama, gpt2, ...)."
        ) from None
    _check_settings(default, settings, "model.config")
    _check_settings(default, overrides, "model")
    return auto_class.from_config(AutoConfig.for_model(model_type, **(settings | overrides)))


def _check_settings(config: Any, settings: Mapping[str, Any], node: str) -> None:
    """transformers keeps any unknown keyword as an attribute: a misspelt size would be silently unused."""
    unknown = [key for key in settings if not hasattr(config, key)]
    if unknown:
        names = sorted(config.to_dict())
        close = difflib.get_close_matches(unknown[0], names, n=1)
        raise ConfigError(
            f"{node}.{unknown[0]}: not a setting of {type(config).__name__}"
            f"{'; did you mean ' + node + '.' + close[0] + '?' if close else ''}. Its settings: {', '.join(names)}."
        )


def _check_vocab(config: Any, settings: dict[str, Any]) -> None:
    """The data's vocabulary must fit the pretrained model's (which may be padded larger)."""
    data_vocab = settings.pop("vocab_size", None)
    if data_vocab is not None and data_vocab > config.vocab_size:
        raise ConfigError(
            f"model.vocab_size: the data has {data_vocab} token ids, the pretrained model {config.vocab_size}: "
            "tokenize the data with the model's own tokenizer."
        )


def is_decoder_lm(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers decoder-only causal LM laid out as the Llama family is (its base
    model's `embed_tokens`, `layers`, `norm` and `rotary_emb`, then `lm_head`): `decoder_stage` splits it."""
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
            past_key_values=None,
            position_ids=position_ids,
        )
        rotary = inner.rotary_emb(h, position_ids=position_ids)
        for layer in inner.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        return self.lm_head(inner.norm(h)) if self.last else h
