"""`hardware=single_device`: one process on one device."""

from __future__ import annotations

import torch

from runner.config import PositiveFloat, PositiveInt, checked
from runner.errors import ConfigError
from runner.hardware.base import ProcessGroupOptions, Strategy, one_process_state
from runner.hardware.parallelize import DDPOptions
from runner.state import ProcessState


class SingleDevice(Strategy):
    """Train in this process on one device (`cpu` by default; `cuda`, `cuda:1`, `mps` also work).

    Args:
        device: the torch device to train on.
        num_threads: intra-op CPU threads (`torch.set_num_threads`); None keeps torch's default.
        peak_flops: the device's peak FLOP/s that MFU is measured against; None: `runner.perf`'s table.
    """

    @checked("hardware")
    def __init__(
        self,
        device: str = "cpu",
        num_threads: PositiveInt | None = None,
        peak_flops: PositiveFloat | None = None,
    ) -> None:
        self.device = present_device(device)
        self.num_threads = num_threads
        self.peak_flops = peak_flops

    def use_process_group(self, options: ProcessGroupOptions) -> None:
        """Nothing to configure: a one-process job forms no group (Accelerate takes the settings there too,
        so that one script runs alone and launched)."""

    def use_ddp(self, options: DDPOptions) -> None:
        """Nothing to configure: one process has no replicas to keep in sync."""

    def setup_environment(self) -> ProcessState:
        return one_process_state(self.device, self.num_threads)


def present_device(name: str) -> torch.device:
    """`hardware.device=name` as a torch device this machine has; a ConfigError naming what it has
    instead (a device type whose torch module counts its devices: cuda, mps, xpu, mtia)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"hardware.device={name!r}: not a torch device. Use cpu, cuda, cuda:<index>, mps or xpu."
        ) from None
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is None or not hasattr(backend, "device_count"):
        return device
    count = backend.device_count() if backend.is_available() else 0
    if (device.index or 0) >= count:
        raise ConfigError(
            f"hardware.device={name}: this machine has {count} {device.type} device(s) that torch "
            f"{torch.__version__} can use. Use hardware.device=cpu, or run where there is one "
            "(`python -m runner.env` shows the devices torch sees)."
        )
    return device
