"""runner: a declarative experiment runner for PyTorch with an Accelerate-compatible `Accelerator`.

The public names are imported on first use, so that a process which needs none of them (the tracker's
sender, `python -m runner.trackers.upload`) does not pay for importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.accelerate.accelerator import Accelerator
    from runner.accelerate.handlers import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DeepSpeedPlugin,
        DistributedDataParallelKwargs,
        FullyShardedDataParallelPlugin,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
    )
    from runner.accelerate.memory import find_executable_batch_size
    from runner.accelerate.parallelism_config import ParallelismConfig
    from runner.accelerate.partial_state import PartialState
    from runner.accelerate.utils import synchronize_rng_states
    from runner.big_modeling import (
        cpu_offload,
        cpu_offload_with_hook,
        disk_offload,
        dispatch_model,
        infer_auto_device_map,
        init_empty_weights,
        init_on_device,
        load_checkpoint_and_dispatch,
        load_checkpoint_in_model,
    )
    from runner.checkpoint.checkpointer import ProjectConfiguration
    from runner.config import ActivationCheckpointingConfig, CompileConfig
    from runner.data_loader import skip_first_batches
    from runner.hardware.parallelize import DDPCommunicationHookType
    from runner.launchers.notebook import notebook_launcher
    from runner.rng import set_seed
    from runner.state import DistributedType

# public name -> the module that defines it
EXPORTS = {
    "cpu_offload": "runner.big_modeling",
    "disk_offload": "runner.big_modeling",
    "cpu_offload_with_hook": "runner.big_modeling",
    "skip_first_batches": "runner.data_loader",
    "AutocastKwargs": "runner.accelerate.handlers",
    "DDPCommunicationHookType": "runner.hardware.parallelize",
    "DataLoaderConfiguration": "runner.accelerate.handlers",
    "DistributedDataParallelKwargs": "runner.accelerate.handlers",
    "GradScalerKwargs": "runner.accelerate.handlers",
    "InitProcessGroupKwargs": "runner.accelerate.handlers",
    "ProfileKwargs": "runner.accelerate.handlers",
    "GradientAccumulationPlugin": "runner.accelerate.handlers",
    "FullyShardedDataParallelPlugin": "runner.accelerate.handlers",
    "DeepSpeedPlugin": "runner.accelerate.handlers",
    "ParallelismConfig": "runner.accelerate.parallelism_config",
    "DistributedType": "runner.state",
    "find_executable_batch_size": "runner.accelerate.memory",
    "synchronize_rng_states": "runner.accelerate.utils",
    "Accelerator": "runner.accelerate.accelerator",
    "ActivationCheckpointingConfig": "runner.config",
    "CompileConfig": "runner.config",
    "ProjectConfiguration": "runner.checkpoint.checkpointer",
    "dispatch_model": "runner.big_modeling",
    "infer_auto_device_map": "runner.big_modeling",
    "init_empty_weights": "runner.big_modeling",
    "init_on_device": "runner.big_modeling",
    "load_checkpoint_and_dispatch": "runner.big_modeling",
    "load_checkpoint_in_model": "runner.big_modeling",
    "notebook_launcher": "runner.launchers.notebook",
    "PartialState": "runner.accelerate.partial_state",
    "set_seed": "runner.rng",
}

__all__ = [
    "Accelerator",
    "ActivationCheckpointingConfig",
    "AutocastKwargs",
    "CompileConfig",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "ProfileKwargs",
    "ProjectConfiguration",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "set_seed",
    "skip_first_batches",
    "synchronize_rng_states",
]


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})
