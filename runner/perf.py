"""Throughput, model FLOPs utilisation and peak memory (what the loop logs as `perf/*` every `log_every`
steps), the devices' peak FLOP/s that MFU is measured against, the profiler window and the CUDA memory
snapshot on out-of-memory."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.config import ProfileConfig
from runner.errors import ConfigError
from runner.torch_internals import dump_memory_snapshot, record_memory_history, view_base

log = logging.getLogger(__name__)

GB = 1024**3

# Dense peak FLOP/s of one device (vendor data sheets): "bf16" is the 16-bit tensor-core peak, "fp32"
# the one without TF32 (torch's default for fp32 matmuls). Matched in order against the device's name,
# so the more specific names come first. `hardware.peak_flops` overrides it; a device not listed (a CPU)
# reports no MFU.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "GB200": {"bf16": 2.5e15, "fp32": 80e12},
    "B200": {"bf16": 2.25e15, "fp32": 80e12},
    "H100 PCIe": {"bf16": 756e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 60e12},
    "H100": {"bf16": 989.4e12, "fp32": 66.9e12},
    "H200": {"bf16": 989.4e12, "fp32": 66.9e12},
    "H20": {"bf16": 148e12, "fp32": 44e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362.05e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
    "V100": {"bf16": 125e12, "fp32": 15.7e12},  # fp16 tensor cores: fp16's peak
    "TPU v6e": {"bf16": 918e12},
    "TPU v5p": {"bf16": 459e12},
    "TPU v5e": {"bf16": 197e12},
    "TPU v5litepod": {"bf16": 197e12},
    "TPU v4": {"bf16": 275e12},
}
# The peak a precision's MFU is measured against (by its `mixed_precision` name). fp8 runs against the
# 16-bit peak, as torchtitan reports it, so that MFU compares across bf16 and fp8 runs as tokens/s does.
PEAK_OF_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "bf16", "fp8": "bf16"}


def count_text(count: int) -> str:
    """A count of parameters (or tokens) as people write it: 1.23B, 124.4M, 12.3K, 832."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size * 0.9995:  # what rounds to 1 or more of the unit
            return f"{count / size:.3g}{unit}"
    return str(count)


def parameters_text(model: torch.nn.Module) -> str:
    """"45.7K parameters", with how many train where some are frozen: "45.7K parameters, 8.19K trained"
    (tied weights once)."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{count_text(total)} parameters" + (f", {count_text(trained)} trained" if trained < total else "")


def mfu_unknown(device_name: str) -> str:
    """Why perf/mfu is not reported on `device_name`, and the fix."""
    return f"no peak FLOP/s is known for {device_name}; set hardware.peak_flops"


def peak_flops(device_name: str, mixed_precision: str) -> float | None:
    """The table's peak FLOP/s of one `device_name` device in `mixed_precision`, or None if not listed."""
    for name, peaks in PEAK_FLOPS.items():
        if name in device_name:
            return peaks.get(PEAK_OF_PRECISION.get(mixed_precision, "fp32"))
    return None


def count_flops(step: Callable[[], torch.Tensor]) -> int:
    """The FLOPs of `step()` (a forward returning a loss) and of its backward, by torch's FLOP counter:
    run it on meta tensors to count without computing."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step().backward()
    return counter.get_total_flops()


@contextmanager
def kept_for_backward(module: torch.nn.Module) -> Iterator[dict[int, int]]:
    """Inside, the bytes of each tensor autograd keeps for backward (by the tensor's id), `module`'s
    parameters not counted: the activation memory of what runs inside (on meta tensors too)."""
    parameters = {id(p) for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in parameters and id(view_base(tensor)) not in parameters:
            kept[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield kept


def peak_memory_gb(device: torch.device) -> tuple[float, float]:
    """(device, host) peak memory of this process so far, in GiB: the CUDA allocator's peak (the host's
    on a CPU device) and the peak resident set size."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # KiB on Linux
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB, host
    return host, host


@dataclass
class Throughput:
    """Counts what the loop processes between two log lines and turns it into `perf/*` metrics.

    `unit` is "tokens" or "samples"; `flops_per_unit` the model's training FLOPs per unit (None: no
    MFU); `peak_flops` one device's peak (None: no MFU); `devices_per_batch` how many devices share one
    batch (tensor-parallel ranks read the same batch), so that rates are per device.
    """

    unit: str
    flops_per_unit: float | None
    peak_flops: float | None
    devices_per_batch: int = 1
    units: int = 0
    began_at: int = 0  # the optimizer step the count began after
    start: float = field(default_factory=time.perf_counter)

    def restart(self, step: int) -> None:
        """Count from now, `step` optimizer steps done (the loop starts)."""
        self.units, self.began_at, self.start = 0, step, time.perf_counter()

    def add(self, units: int) -> None:
        """A micro-batch of `units` tokens or samples went through this rank."""
        self.units += units

    def read(self, device: torch.device, step: int) -> dict[str, float]:
        """This rank's `perf/*` metrics since the last read (call it where the device was waited for), `step`
        optimizer steps done now, and start counting again."""
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        per_device = self.units / self.devices_per_batch / elapsed
        device_gb, host_gb = peak_memory_gb(device)
        metrics = {
            f"perf/{self.unit}_per_s": per_device,
            "perf/step_time_s": elapsed / max(step - self.began_at, 1),
            "perf/peak_memory_gb": device_gb,
            "perf/peak_host_memory_gb": host_gb,
        }
        if self.flops_per_unit is not None and self.peak_flops:
            metrics["perf/mfu"] = per_device * self.flops_per_unit / self.peak_flops
        self.units, self.began_at, self.start = 0, step, now
        return metrics


class Profiler:
    """torch.profiler over a window of optimizer steps (`trainer.profile`); `step()` after each. When the
    window closes, `<directory>/trace_rank<r>.json` (a Chrome trace: chrome://tracing, Perfetto) and
    `key_averages_rank<r>.txt` (the ops by total time) are written."""

    def __init__(self, config: ProfileConfig, directory: Path, rank: int, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.directory, self.rank, self.device = directory, rank, device
        self.group_by_shape = config.record_shapes
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profile = profile(
            activities=activities,
            schedule=schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=config.record_shapes,
            profile_memory=config.profile_memory,
        )

    def _write(self, profile: torch.profiler.profile) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.directory / f"trace_rank{self.rank}.json"))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = profile.key_averages(group_by_input_shape=self.group_by_shape).table(
            sort_by=sort, row_limit=40
        )
        (self.directory / f"key_averages_rank{self.rank}.txt").write_text(table + "\n")
        log.info("profile of the steps recorded: %s", self.directory)

    def step(self) -> None:
        self.profile.step()


@contextmanager
def memory_snapshot_on_oom(enabled: bool, device: torch.device, path: Path) -> Iterator[None]:
    """With `enabled` (`trainer.memory_snapshot`), record the CUDA allocator's history inside, and on an
    out-of-memory error write it to `path` (load it at pytorch.org/memory_viz) before re-raising."""
    if not enabled:
        yield
        return
    if device.type != "cuda":
        raise ConfigError(
            f"trainer.memory_snapshot=true records the CUDA allocator; this run computes on {device.type}. "
            "Set trainer.memory_snapshot=false, or run on a GPU."
        )
    record_memory_history(True)
    try:
        yield
    except torch.OutOfMemoryError:
        path.parent.mkdir(parents=True, exist_ok=True)
        dump_memory_snapshot(path)
        log.error("out of memory: the allocator's history is in %s (open it at pytorch.org/memory_viz)", path)
        raise
    finally:
        record_memory_history(False)
