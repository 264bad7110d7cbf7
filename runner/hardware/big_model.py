"""`hardware=big_model`: inference in one process with the model's modules placed over the GPUs, CPU memory
and disk by a device map (Accelerate's big model inference)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.config import ActivationCheckpointingConfig, CompileConfig, PositiveInt, checked
from runner.errors import ConfigError
from runner.hardware.base import Strategy, one_process_state
from runner.hardware.big_modeling import AUTO_MAPS, get_max_memory, load_checkpoint_and_dispatch
from runner.hardware.parallelize import refuse_compute
from runner.state import ProcessState


class BigModel(Strategy):
    """Load a checkpoint into a model built on the meta device, each tensor straight onto its device, and
    run it with offloaded weights brought in just in time.

    Args:
        device_map: "auto" / "balanced" (spread over the GPUs, then CPU, then disk), "balanced_low_0",
            "sequential", or a mapping of module names to devices (`{"": "cpu"}`, `{"blocks": "disk", ...}`).
        max_memory: bytes each device may hold (`{"cpu": "200MB", "0": "10GB"}`); a null value: what is free.
        offload_folder: where the weights put on disk are listed; None: `<job dir>/offload`.
        no_split_module_classes: class names of modules kept whole on one device (e.g. `[Block]`); empty:
            the model's own `_no_split_modules` (transformers' convention; GPT declares its Block).
        dtype: load floating point weights in this dtype ("float32", "bfloat16", "float16"); None: as stored.
        offload_buffers: with a GPU, offload the buffers of CPU-placed modules too.
        num_threads: CPU threads (`torch.set_num_threads`); None keeps torch's default.
    """

    @checked("hardware")
    def __init__(
        self,
        device_map: str | Mapping[str, Any] = "auto",
        max_memory: Mapping[str, Any] | None = None,
        offload_folder: str | None = None,
        no_split_module_classes: list[str] | None = None,
        dtype: str | None = None,
        offload_buffers: bool = False,
        num_threads: PositiveInt | None = None,
    ) -> None:
        if isinstance(device_map, str) and device_map not in AUTO_MAPS:
            raise ConfigError(
                f"hardware.device_map={device_map!r}: expected one of {', '.join(AUTO_MAPS)}, or a mapping of module "
                "names to devices such as {'': 'cpu'}."
            )
        self.device_map = device_map if isinstance(device_map, str) else dict(device_map)
        # All null (the default): every device, with what is free on it.
        asked = dict(max_memory or {}) if any(v is not None for v in (max_memory or {}).values()) else None
        try:
            self.max_memory = get_max_memory(asked) if asked else None
        except ValueError as err:
            raise ConfigError(f"hardware.{err}") from None
        self.offload_folder = offload_folder
        self.no_split_module_classes = list(no_split_module_classes or [])
        self.dtype = dtype
        self.offload_buffers = offload_buffers
        self.device = torch.device("cpu")  # where inputs start; the device map places the modules
        self.num_threads = num_threads

    def setup_environment(self) -> ProcessState:
        return one_process_state(self.device, self.num_threads)

    def setup_compute(self, compile: CompileConfig, checkpointing: ActivationCheckpointingConfig) -> None:
        """Inference runs the model as loaded: the training loop's compute options do not apply."""
        refuse_compute(
            compile, checkpointing, "big_model", "training options; it runs a dispatched model as loaded"
        )

    def dispatch(self, model: nn.Module, checkpoint: str | Path, job_dir: Path) -> nn.Module:
        """`model` (built under `init_empty_weights`) loaded from `checkpoint` and dispatched; a checkpoint
        or device map that does not fit the model, or memory too small, is a ConfigError (nothing loaded)."""
        try:
            return load_checkpoint_and_dispatch(
                model,
                checkpoint,
                device_map=self.device_map,
                max_memory=self.max_memory,
                no_split_module_classes=self.no_split_module_classes
                or getattr(model, "_no_split_modules", None),
                offload_folder=self.offload_folder or job_dir / "offload",
                offload_buffers=self.offload_buffers,
                dtype=self.dtype,
                strict=True,  # a checkpoint for another model is bad input here, not a warning
            )
        except (ValueError, FileNotFoundError) as err:
            raise ConfigError(f"hardware=big_model: {err}") from None
