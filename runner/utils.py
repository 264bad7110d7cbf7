"""Accelerate's `accelerate.utils` names, for scripts that import them from here (`from runner.utils import
set_seed`): re-exported from the modules that hold them, and the few that only a script calls."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import runner.collectives as collectives
from runner.big_modeling import load_checkpoint_in_model
from runner.checkpoint.checkpointer import ProjectConfiguration
from runner.cluster import patch_environment
from runner.handlers import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DummyOptim,
    DummyScheduler,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from runner.memory import find_executable_batch_size, release_memory
from runner.ops import apply_to_tensors, concatenate, find_batch_size, send_to_device
from runner.parallelism_config import ParallelismConfig, TorchContextParallelConfig
from runner.precision import PrecisionType
from runner.process_control import PartialState, active_strategy
from runner.rng import RNGType, set_seed
from runner.state import DistributedType
from runner.trackers import LoggerType

__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "DynamoBackend",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "ParallelismConfig",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_mlflow_available",
    "is_schedulefree_available",
    "is_tensorboard_available",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_transformers_available",
    "load_checkpoint_in_model",
    "pad_across_processes",
    "patch_environment",
    "recursively_apply",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "wait_for_everyone",
    "write_basic_config",
]


# The collectives, as functions over the process's `PartialState` (the group an Accelerator set up, else
# one set up as `Accelerator()` would).
def gather(tensor: Any) -> Any:
    """Tensors (nested structures too) from all processes, concatenated along the first dimension."""
    return collectives.gather(active_strategy(), tensor)


def gather_object(object: Any) -> list[Any]:
    """Every process's picklable `object`, in process order (lists and tuples concatenated)."""
    return collectives.gather_object(active_strategy(), object)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Tensors (nested too) reduced across processes: "mean" (the default here, as in Accelerate),
    "sum", "max", "min", "none"; times `scale`."""
    return collectives.reduce(active_strategy(), tensor, reduction, scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Tensors (nested too) overwritten in place with process `from_process`'s."""
    return collectives.broadcast(active_strategy(), tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """The picklable objects of `object_list` replaced in place by process `from_process`'s."""
    return collectives.broadcast_object_list(active_strategy(), object_list, from_process)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Tensors (nested too) padded along `dim` to the largest size any process has."""
    return collectives.pad_across_processes(active_strategy(), tensor, dim, pad_index, pad_first)


def wait_for_everyone() -> None:
    """Block until every process reaches this line."""
    active_strategy().barrier()


def synchronize_rng_states(rng_types: list[str | RNGType], generator: torch.Generator | None = None) -> None:
    """Give every process process 0's state of the RNGs `rng_types` names ("torch", "cuda", and
    "generator": `generator`)."""
    state = PartialState()
    generators = collectives.rng_generators(rng_types, state.device, [generator] if generator else [])
    collectives.synchronize_rng_states(state.strategy, generators)


def synchronize_rng_state(
    rng_type: str | RNGType | None = None, generator: torch.Generator | None = None
) -> None:
    """`synchronize_rng_states` for one RNG type."""
    synchronize_rng_states([rng_type] if rng_type is not None else [], generator)


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None) -> Path | bool:
    """Write Accelerate's minimal launch config (a `default_config.yaml` for `accelerate launch`) for this
    machine: one process per visible GPU, else one on the CPU. Returns False, writing nothing, when the
    file exists (as Accelerate does). Default place: `$HF_HOME/accelerate/default_config.yaml`."""
    precision = PrecisionType(mixed_precision)  # a ValueError for an unknown name
    path = Path(save_location) if save_location else _accelerate_config_home() / "default_config.yaml"
    if path.exists():
        return False
    gpus = torch.cuda.device_count()
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": DistributedType.MULTI_GPU.value if gpus > 1 else DistributedType.NO.value,
        "mixed_precision": precision.value,
        "num_machines": 1,
        "num_processes": max(gpus, 1),
        "use_cpu": gpus == 0,
        "debug": False,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML, which accelerate's loader reads
    return path


def _accelerate_config_home() -> Path:
    hf_home = (
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    )
    return Path(hf_home) / "accelerate"


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
is_schedulefree_available = _installed("schedulefree")
is_torchao_available = _installed("torchao")
is_tensorboard_available = _installed("tensorboard")
