"""PEFT adapters on a transformers model (the `peft` extra): `model.peft` in YAML (`method: lora` and the
settings of that method's PEFT config), the model frozen with PEFT's adapter layers added, and the final
dir in PEFT's own layout (`PeftModel.from_pretrained` loads it) or, with `merge`, the merged model."""

from __future__ import annotations

import dataclasses
import difflib
import sys
import warnings
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError, install_command

# runner's own settings of the `model.peft` node (the others are the method's PEFT config's)
OWN = ("method", "merge")
# set on the adapted model: whether its final dir is the merged model instead of the adapter
MERGE = "merge_adapter_when_saved"
# the PEFT task of each transformers head runner builds
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}


def _peft() -> Any:
    try:
        import peft
    except ImportError as err:
        raise ConfigError(
            f"model.peft: adapters need the `peft` extra ({err}): {install_command('peft')}"
        ) from None
    return peft


def adapter_config(settings: Mapping[str, Any], task_type: str) -> Any:
    """The PEFT config `settings` (`model.peft`) describe for a model of `task_type` (PEFT's TaskType
    name): `method` names a PEFT method that adds layers to the model's modules (lora, loha, lokr, ia3,
    ...), each other key is a setting of that method's config class; ConfigError naming the key otherwise."""
    peft = _peft()
    settings = OmegaConf.to_container(settings) if isinstance(settings, DictConfig) else dict(settings)
    method = str(settings.pop("method", "lora"))
    settings.pop("merge", None)
    methods = {kind.value.lower(): config for kind, config in peft.PEFT_TYPE_TO_CONFIG_MAPPING.items()}
    config_class = methods.get(method.lower())
    if config_class is None or issubclass(config_class, peft.PromptLearningConfig):
        close = difflib.get_close_matches(method.lower(), methods, n=1)
        reason = (
            "a prompt-learning method (it adds virtual tokens, not layers)"
            if config_class
            else f"not a PEFT method{'; did you mean ' + close[0] + '?' if close else ''}"
        )
        raise ConfigError(
            f"model.peft.method={method!r}: {reason}. Use a method that adds layers to the model's modules: "
            "lora (the usual), loha, lokr, ia3, ..."
        )
    fields = {field.name for field in dataclasses.fields(config_class) if field.init}
    fields -= {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode"}
    for key in settings:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            raise ConfigError(
                f"model.peft.{key}: not a setting of PEFT's {config_class.__name__}"
                f"{'; did you mean model.peft.' + close[0] + '?' if close else ''}. Its settings: "
                f"{', '.join(sorted(fields))}."
            )
    try:
        return config_class(task_type=task_type, **settings)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model.peft: PEFT refuses these {method} settings ({err}).") from None


def with_adapter(model: torch.nn.Module, settings: Mapping[str, Any], task_type: str) -> torch.nn.Module:
    """`model` frozen, with the adapter `settings` describe (`adapter_config`) added by PEFT and trained:
    a `PeftModel`. What PEFT refuses on this model is a ConfigError; target modules that match nothing
    list the model's module names."""
    peft = _peft()
    config = adapter_config(settings, task_type)
    try:
        with warnings.catch_warnings():  # PEFT's use of transformers' deprecated names: not the user's
            warnings.simplefilter("ignore", FutureWarning)
            adapted = peft.get_peft_model(model, config)
    except ValueError as err:  # PEFT's refusal of its settings on this model
        reason = " ".join(str(err).split())
        if "target" in reason.lower():
            leaves = {
                name.rpartition(".")[2]
                for name, module in model.named_modules()
                if not list(module.children())
            }
            reason += (
                f" The model's modules are named: {', '.join(sorted(leaves))}. Set model.peft.target_modules to "
                "some of them (or all-linear)."
            )
        raise ConfigError(f"model.peft: {reason}") from None
    setattr(adapted, MERGE, bool(settings.get("merge", False)))
    return adapted


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is a PEFT model (an adapter on a frozen model)."""
    peft = sys.modules.get("peft")  # not imported: no model is one
    return peft is not None and isinstance(model, peft.PeftModel)


def save_adapted(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """Write a PEFT model (`model`, its whole weights in `state_dict`: a sharded run's gathered) into
    `directory`: the adapter in PEFT's layout (`adapter_config.json`, `adapter_model.safetensors`), or
    with `merge` the model with the adapter merged into its weights, in transformers' layout."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # its bar of "Writing model shards": the run logs its own lines
    try:
        if getattr(model, MERGE, False):
            merged_model(model, state_dict).save_pretrained(str(directory))
        else:
            model.save_pretrained(str(directory), state_dict=state_dict)
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def merged_model(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The transformers model `model` adapts, with `state_dict`'s weights and the adapter merged into
    them (PEFT's `merge_and_unload`), built afresh on the CPU: `model` itself may be sharded."""
    peft = _peft()
    base = model.get_base_model()
    with torch.device("meta"):
        copy = peft.get_peft_model(type(base)._from_config(base.config), deepcopy(model.active_peft_config))
    copy.load_state_dict(state_dict, assign=True)
    merged = copy.merge_and_unload()
    merged.tie_weights()
    return merged
