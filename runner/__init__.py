"""runner: a declarative experiment runner for PyTorch with an Accelerate-compatible `Accelerator`.

The public names are imported on first use, so that a process which needs none of them (the tracker's
sender, `python -m runner.trackers.upload`) does not pay for importing torch. Accelerate's module names
(`runner.utils`, `runner.logging`, ...: what the import rename of a ported script asks for) are the
modules of runner that hold those names, imported under a second name (`PORTING_NAMES`)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
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
    from runner.checkpoint.checkpointer import ProjectConfiguration
    from runner.config import ActivationCheckpointingConfig, CompileConfig
    from runner.engine.data_loader import skip_first_batches
    from runner.hardware.big_modeling import (
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
    from runner.hardware.parallelize import DDPCommunicationHookType
    from runner.launchers.notebook import notebook_launcher
    from runner.rng import set_seed
    from runner.state import DistributedType

# public name -> the module that defines it
EXPORTS = {
    "cpu_offload": "runner.hardware.big_modeling",
    "disk_offload": "runner.hardware.big_modeling",
    "cpu_offload_with_hook": "runner.hardware.big_modeling",
    "skip_first_batches": "runner.engine.data_loader",
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
    "dispatch_model": "runner.hardware.big_modeling",
    "infer_auto_device_map": "runner.hardware.big_modeling",
    "init_empty_weights": "runner.hardware.big_modeling",
    "init_on_device": "runner.hardware.big_modeling",
    "load_checkpoint_and_dispatch": "runner.hardware.big_modeling",
    "load_checkpoint_in_model": "runner.hardware.big_modeling",
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


# Accelerate's module name, renamed (`accelerate.X` -> `runner.X`) -> the module of runner it is
PORTING_NAMES = {
    "runner.accelerator": "runner.accelerate.accelerator",
    "runner.big_modeling": "runner.hardware.big_modeling",
    "runner.data_loader": "runner.engine.data_loader",
    "runner.local_sgd": "runner.accelerate.local_sgd",
    "runner.logging": "runner.accelerate.logging",
    "runner.parallelism_config": "runner.accelerate.parallelism_config",
    "runner.utils": "runner.accelerate.utils",
}


class _PortingNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `PORTING_NAMES`: the module under its second name is the same object (a monkeypatch or a
    module `__getattr__` acts on both)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in PORTING_NAMES else None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(PORTING_NAMES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # imported by create_module


if not any(isinstance(finder, _PortingNames) for finder in sys.meta_path):  # once, however often imported
    sys.meta_path.append(_PortingNames())


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})
