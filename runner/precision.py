"""Precision plugins: what the `precision` config group instantiates.

A precision object owns the autocast context, loss scaling and the optimizer step that goes with it.
Strategies and the Accelerator call these hooks and never ask which precision is in use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from runner.errors import ConfigError
from runner.ops import convert_to_fp32


class Precision:
    """Full fp32 (the `fp32` group): no autocast, no loss scaling."""

    mixed_precision = "no"

    def setup(self, device: torch.device) -> None:
        """Bind to the device this process trains on."""
        self.device = device

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Prepare a model for this precision (mixed precision runs its forward under autocast)."""
        return module

    def autocast(self) -> AbstractContextManager:
        return nullcontext()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before clipping (no-op without loss scaling)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable | None = None) -> bool:
        """Step `optimizer`; return False when the step was skipped (fp16 overflow)."""
        optimizer.step() if closure is None else optimizer.step(closure)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


class MixedPrecision(Precision):
    """Autocast the model's forward to `dtype` (the `bf16` group); weights and optimizer stay fp32."""

    _names = {"bfloat16": "bf16", "float16": "fp16"}

    def __init__(self, dtype: str = "bfloat16") -> None:
        if dtype not in self._names:
            raise ValueError(
                f"precision.dtype={dtype!r} is not supported; expected one of {list(self._names)}."
            )
        self.dtype = getattr(torch, dtype)
        self.mixed_precision = self._names[dtype]

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # As Accelerate does: the instance's forward runs under autocast and returns fp32 outputs;
        # `Accelerator.unwrap_model(model, keep_fp32_wrapper=False)` restores `_original_forward`.
        if "_original_forward" not in module.__dict__:
            module._original_forward = module.forward
            module.forward = _autocast_forward(module.forward, self.autocast)
        return module

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.dtype)


class ShardedMixedPrecision(Precision):
    """Mixed precision that the strategy applies itself (FSDP's MixedPrecisionPolicy casts parameters and
    outputs): no autocast here, only the name."""

    def __init__(self, mixed_precision: str) -> None:
        self.mixed_precision = mixed_precision


class Float16MixedPrecision(MixedPrecision):
    """fp16 autocast with dynamic loss scaling through `torch.amp.GradScaler` (the `fp16` group).

    A step whose gradients hold inf/nan is skipped and the scale is multiplied by `backoff_factor`.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        super().__init__("float16")
        self.scaler_kwargs = dict(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        self.scaler = torch.amp.GradScaler(device.type, **self.scaler_kwargs)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scaler.scale(loss).backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable | None = None) -> bool:
        if closure is not None:
            raise ValueError("fp16 loss scaling cannot step an optimizer with a closure.")
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale_before

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["scaler"])


def refuse_fp16(precision: Precision, hardware: str, why: str) -> None:
    """ConfigError when `precision` is fp16 autocast, which `hardware` cannot run (`why` says so)."""
    if isinstance(precision, MixedPrecision) and precision.mixed_precision == "fp16":
        raise ConfigError(
            f"precision=fp16 with hardware={hardware}: {why}. Use precision=bf16 (no loss scaling needed) or "
            "precision=fp32."
        )


def from_name(mixed_precision: str | None) -> Precision:
    """Accelerate's `mixed_precision` strings ("no", "fp16", "bf16") to a precision plugin."""
    factories: dict[str | None, Callable[[], Precision]] = {
        None: Precision,
        "no": Precision,
        "fp32": Precision,
        "bf16": MixedPrecision,
        "fp16": Float16MixedPrecision,
    }
    if mixed_precision not in factories:
        raise ValueError(f"mixed_precision={mixed_precision!r}: expected one of 'no', 'fp16', 'bf16'.")
    return factories[mixed_precision]()


def _autocast_forward(forward: Callable, autocast: Callable[[], AbstractContextManager]) -> Callable:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with autocast():
            outputs = forward(*args, **kwargs)
        return convert_to_fp32(outputs)

    return wrapped
