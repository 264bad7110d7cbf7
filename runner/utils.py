"""Accelerate's `accelerate.utils` names, for scripts that import them from here (`from runner.utils import
set_seed`): re-exported from the modules that hold them, and the few that only a script calls."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from runner.big_modeling import load_checkpoint_in_model
from runner.checkpoint import ProjectConfiguration
from runner.cluster import patch_environment
from runner.memory import find_executable_batch_size, release_memory
from runner.ops import apply_to_tensors, concatenate, find_batch_size, send_to_device
from runner.precision import PrecisionType
from runner.rng import RNGType, set_seed
from runner.state import DistributedType

__all__ = [
    "DistributedType",
    "PrecisionType",
    "ProjectConfiguration",
    "RNGType",
    "concatenate",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_executable_batch_size",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_mlflow_available",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_transformers_available",
    "load_checkpoint_in_model",
    "patch_environment",
    "recursively_apply",
    "release_memory",
    "send_to_device",
    "set_seed",
]


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = lambda data: isinstance(data, torch.Tensor),
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Accelerate's signature over `runner.ops.apply_to_tensors`: `func(tensor, *args, **kwargs)` for every
    tensor in the nested `data`; TypeError for anything else with `error_on_other_type`. Only tensors are
    visited: another `test_type` is refused."""
    if test_type(torch.empty(0)) is not True or test_type(0) is not False:
        raise ValueError(
            "recursively_apply: runner applies functions to tensors only (test_type must pick tensors)."
        )
    return apply_to_tensors(lambda tensor: func(tensor, *args, **kwargs), data, strict=error_on_other_type)


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> torch.nn.Module:
    """The user's model inside DDP, a DeepSpeed engine or `torch.compile`'s wrapper (kept with
    `keep_torch_compile`); `keep_fp32_wrapper=False` also removes a mixed-precision autocast forward."""
    from torch._dynamo.eval_frame import OptimizedModule  # torch._dynamo takes a second to import

    compiled = model if isinstance(model, OptimizedModule) else None
    inner = compiled._orig_mod if compiled is not None else model
    while isinstance(inner, DistributedDataParallel) or type(inner).__name__ == "DeepSpeedEngine":
        inner = inner.module
    if not keep_fp32_wrapper and "_original_forward" in inner.__dict__:
        inner.forward = inner.__dict__.pop("_original_forward")
    if compiled is not None and keep_torch_compile:
        compiled._orig_mod = inner
        return compiled
    return inner


def _installed(module: str) -> Callable[[], bool]:
    def available() -> bool:
        return importlib.util.find_spec(module) is not None

    available.__doc__ = f"Whether `{module}` can be imported here."
    return available


is_deepspeed_available = _installed("deepspeed")
is_torch_xla_available = _installed("torch_xla")
is_transformers_available = _installed("transformers")
is_datasets_available = _installed("datasets")
is_mlflow_available = _installed("mlflow")
is_torchao_available = _installed("torchao")
