"""Hardware strategies: one class per file, each instantiated by `conf/hardware/<name>.yaml`."""

from __future__ import annotations

import torch

from runner.cluster import launched_environment
from runner.hardware.base import Strategy
from runner.hardware.ddp import DDP
from runner.hardware.deepspeed import DeepSpeed
from runner.hardware.fsdp import FSDP
from runner.hardware.process_group import ParallelStrategy
from runner.hardware.single_device import SingleDevice
from runner.hardware.tensor_parallel import TensorParallel

__all__ = [
    "DDP",
    "FSDP",
    "DeepSpeed",
    "ParallelStrategy",
    "SingleDevice",
    "Strategy",
    "TensorParallel",
    "default_strategy",
]


def default_strategy(cpu: bool = False) -> Strategy:
    """What `Accelerator()` uses without a `strategy`: DDP when a launcher started several ranks (torchrun,
    srun), else one process on CUDA when available, else the CPU; `cpu` forces the CPU."""
    env = launched_environment()
    if env is not None and env.world_size > 1:
        return DDP(num_processes=env.local_world_size, device="cpu" if cpu else None)
    return SingleDevice("cuda" if torch.cuda.is_available() and not cpu else "cpu")
