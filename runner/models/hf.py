"""Hugging Face `transformers` models (the `hf` extra): built from a config with sizes in YAML (random
init) or from a local directory (`from_pretrained`, no network)."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from runner.checkpoint.weights import DamagedFileError, checkpoint_tensors
from runner.config import PositiveInt
from runner.errors import ConfigError, install_command
from runner.models.adapters import TASK_TYPES, with_adapter

try:
    import transformers
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        masking_utils,
    )
except ImportError as err:  # the module names the extra to install instead of a bare import error
    raise ImportError(
        f"{err}: Hugging Face models need the `hf` extra: {install_command('hf')} (transformers, datasets)"
    ) from err


def causal_lm(
    pretrained: str | None = None,
    load_weights: bool = True,
    config: Mapping[str, Any] | None = None,
    vocab_size: PositiveInt | None = None,
    peft: Mapping[str, Any] | None = None,
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
        peft: an adapter trained on the model, which is frozen (`model/peft=lora`; the `peft` extra):
            `method` and the settings of its PEFT config (`runner.models.adapters.adapter_config`), `merge`
            whether the final dir is the merged model instead of the adapter; None: every weight trains.
        overrides: settings that replace the architecture's either way (`attention_dropout`, ...).
    """
    model = _build(AutoModelForCausalLM, pretrained, load_weights, config, vocab_size=vocab_size, **overrides)
    model = attend_within_documents(model)
    return with_adapter(model, peft, TASK_TYPES["causal_lm"]) if peft else model


def sequence_classification(
    pretrained: str | None = None,
    load_weights: bool = True,
    config: Mapping[str, Any] | None = None,
    vocab_size: PositiveInt | None = None,
    num_labels: PositiveInt | None = None,
    peft: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """A sequence classifier (`AutoModelForSequenceClassification`): a transformer whose `logits` are one
    score per class. `num_labels`: the classes (None in YAML: the data's); with `peft` the head trains
    whole beside the adapter (PEFT's SEQ_CLS task). The other arguments are `causal_lm`'s."""
    model = _build(
        AutoModelForSequenceClassification,
        pretrained,
        load_weights,
        config,
        vocab_size=vocab_size,
        num_labels=num_labels,
        **overrides,
    )
    return with_adapter(model, peft, TASK_TYPES["sequence_classification"]) if peft else model


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
        _check_architecture(stored.to_dict() | overrides, {key: f"model.{key}" for key in overrides})
        stored.update(overrides)
        if load_weights:
            check_weight_files(directory, f"model.pretrained={pretrained!r}")
            if torch.get_default_device().type != "meta":  # on meta (runner's checks): the shapes only
                return limit_positions(
                    auto_class.from_pretrained(directory, config=stored, local_files_only=True)
                )
        return limit_positions(auto_class.from_config(stored))
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
    keys = {key: f"model.config.{key}" for key in settings} | {key: f"model.{key}" for key in overrides}
    _check_architecture(default.to_dict() | settings | overrides, keys)
    try:
        built = AutoConfig.for_model(model_type, **(settings | overrides))
    except Exception as err:  # transformers' own validation (huggingface_hub's StrictDataclass errors, ValueError)
        reason = " ".join(str(err).split()) or type(err).__name__
        given = ", ".join(f"{keys[key]}={value}" for key, value in (settings | overrides).items())
        raise ConfigError(
            f"model.config: transformers refuses this {model_type} config ({reason}). Fix the settings ({given})."
        ) from None
    return limit_positions(auto_class.from_config(built))


# The sizes of a transformers architecture, each a count of at least one.
SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "vocab_size",
)


def _check_architecture(values: Mapping[str, Any], keys: Mapping[str, str]) -> None:
    """ConfigError naming the key (`keys`: where each that was set was set) of a size set below one, or
    key/value heads set to a number that does not divide the attention heads: what transformers would
    refuse without naming the key, or only a forward would fail on."""

    def named(key: str) -> str:
        return f"{keys[key]}={values[key]}" if key in keys else f"{key}={values[key]} (transformers' default)"

    for key in SIZES:
        if key in keys and isinstance(values.get(key), int) and values[key] < 1:
            raise ConfigError(f"{named(key)}: must be >= 1.")
    # a default of the key/value heads follows the heads (None, or derived when the config was made)
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    given = "num_key_value_heads" in keys
    if given and isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ConfigError(
            f"{named('num_key_value_heads')} must divide {named('num_attention_heads')}: each key/value head "
            "serves a group of query heads (grouped-query attention). Use a divisor, e.g. "
            f"{max(d for d in range(1, kv_heads + 1) if heads % d == 0)}."
        )


def limit_positions(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """`model`, refusing an input longer than its table of learned positions (GPT-2's `wpe`, BERT's
    `position_embeddings`: an embedding other than the tokens' with `max_position_embeddings` rows), from
    the input's shape: on meta tensors (runner's checks before launch) as in training, instead of an
    IndexError inside the embedding after launch. Rotary positions (Llama) have no such table."""
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    tokens = model.get_input_embeddings()
    tables = [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module is not tokens and module.num_embeddings == limit
    ]
    if not isinstance(limit, int) or not tables:
        return model
    key = config.attribute_map.get("max_position_embeddings", "max_position_embeddings")

    def check(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.shape[-1] > limit:
            raise ValueError(
                f"the sequences are {ids.shape[-1]} tokens long, and the model has {limit} learned positions "
                f"({type(config).__name__}.{key}={limit}): set data.seq_len to at most {limit}, or give the model "
                f"more positions ({key})"
            )

    model.base_model.register_forward_pre_hook(check, with_kwargs=True)  # a PEFT model calls its forward
    return model


def attend_within_documents(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """`model`, taking packed documents (`data.document_mask`, `data.packing`) where its architecture's
    attention masks follow `position_ids` (its modeling module builds them with transformers'
    `create_causal_mask`, which finds the documents where the positions restart): so marked
    (`runner.task.attends_within_documents`), its forward given position_ids and no cache keeps none,
    as transformers only looks for documents then (a cache is of no use in training anyway)."""
    modeling = sys.modules[type(model).__module__]
    if getattr(modeling, "create_causal_mask", None) is not masking_utils.create_causal_mask:
        return model

    def no_cache(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        positions = kwargs.get("position_ids")
        # on meta (the checks, the FLOPs count) the search, which reads values, is left out: same shapes
        if positions is not None and positions.device.type != "meta" and kwargs.get("past_key_values") is None:
            kwargs["use_cache"] = False
        return args, kwargs

    model.base_model.register_forward_pre_hook(no_cache, with_kwargs=True)  # a PEFT model calls its forward
    model.attends_within_documents = True
    return model


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


def check_weight_files(directory: Path, key: str) -> None:
    """ConfigError naming the file when `directory`'s weights are missing, or cut short or damaged
    (from the safetensors headers and file sizes, the torch files' zip directories: nothing is read)."""
    try:
        checkpoint_tensors(directory)
    except DamagedFileError as err:
        raise ConfigError(f"{key}: {err}") from None
    except FileNotFoundError as err:
        raise ConfigError(
            f"{key}: {err} Give a model directory with its weights (save_pretrained's), or "
            "model.load_weights=false to build its architecture only."
        ) from None
