"""`hardware=xla`: torch_xla. One process drives every XLA device of the host; with several, data parallel
through SPMD: each batch is sharded over a ("data",) mesh of the devices and the compiler inserts the
gradient all-reduces."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from runner.config import ActivationCheckpointingConfig, CompileConfig, PositiveFloat, checked
from runner.errors import ConfigError, install_command
from runner.hardware.base import Strategy
from runner.hardware.parallelize import refuse_compute
from runner.ops import apply_to_tensors
from runner.precision import Precision, refuse_fp8, refuse_fp16
from runner.state import DistributedType, ProcessState

XLA_REQUIREMENT = f"{install_command('tpu')} in its own environment (torch_xla 2.9 needs torch 2.9)"


class XLA(Strategy):
    """Train on XLA devices (TPU; `PJRT_DEVICE=CPU` runs the same path on the CPU).

    Each step ends with the optimizer step and a graph sync (`torch_xla.sync()`), so every step runs one
    compiled graph. bf16 runs the forward under `torch.autocast("xla", torch.bfloat16)`; fp16 is refused.

    One process (the collectives are one process's: SPMD's reductions are in the compiled graph).

    Args:
        spmd: shard each batch over all the host's devices (SPMD data parallel); None: when there are
            several devices.
        peak_flops: one device's peak FLOP/s that MFU is measured against; None: `runner.perf`'s table
            (by `TPU_ACCELERATOR_TYPE`, e.g. v5litepod-8).
    """

    distributed_type = DistributedType.XLA

    @checked("hardware")
    def __init__(self, spmd: bool | None = None, peak_flops: PositiveFloat | None = None) -> None:
        try:
            import torch_xla  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"hardware=xla needs torch_xla, which is not installed here: {XLA_REQUIREMENT}."
            ) from None
        self.device = torch.device("cpu")  # the XLA device, once setup_environment has made it
        self.spmd = spmd
        self.peak_flops = peak_flops
        self.mesh: Any = None

    def setup_environment(self) -> ProcessState:
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        devices = xr.global_runtime_device_count()
        if devices > 1 if self.spmd is None else self.spmd:
            xr.use_spmd()  # before the first tensor touches a device
            devices = xr.global_runtime_device_count()
            self.mesh = xs.Mesh(np.arange(devices), (devices,), ("data",))
        self.device = torch_xla.device()
        return ProcessState(device=self.device)

    def setup_compute(self, compile: CompileConfig, checkpointing: ActivationCheckpointingConfig) -> None:
        """torch_xla compiles every step's graph itself; its activation checkpointing is its own."""
        refuse_compute(
            compile,
            checkpointing,
            "xla",
            "torch_xla traces and compiles every step into one XLA graph already, and runner does not apply "
            "torch.utils.checkpoint under XLA",
        )

    def device_name(self) -> str:
        accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")  # set on Cloud TPU VMs: v4-8, v5litepod-8, v6e-8
        return f"TPU {accelerator}" if accelerator else "xla"

    def setup_precision(self, precision: Precision) -> Precision:
        refuse_fp16(precision, "xla", "XLA devices compute in bf16 without loss scaling")
        refuse_fp8(precision, "xla", "torchao's float8 training runs on NVIDIA GPUs")
        return precision

    def device_batches(
        self, batches: Iterator[Any], device: torch.device, non_blocking: bool = False
    ) -> Iterator[Any]:
        """torch_xla's MpDeviceLoader moves the batches to the device in the background, whatever
        `non_blocking` says (and syncs the graph at each); under SPMD each batch is then split along its first dimension over the devices."""
        import torch_xla.distributed.parallel_loader as pl
        import torch_xla.distributed.spmd as xs

        def shard(tensor: torch.Tensor) -> None:
            if tensor.ndim:
                xs.mark_sharding(tensor, self.mesh, ("data", *([None] * (tensor.ndim - 1))))

        for batch in pl.MpDeviceLoader(batches, device):
            if self.mesh is not None:
                apply_to_tensors(shard, batch)
            yield batch

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, precision: Precision, closure: Any = None
    ) -> bool:
        import torch_xla

        stepped = precision.optimizer_step(optimizer, closure)
        torch_xla.sync()
        return stepped

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The weights copied to the CPU (XLA tensors have no storage to compare); tied ones stay one tensor."""
        copies: dict[int, torch.Tensor] = {}
        return {
            name: copies.setdefault(id(tensor), tensor.detach().cpu())
            for name, tensor in self.unwrap_module(module).state_dict(keep_vars=True).items()
        }
