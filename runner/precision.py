"""Precision plugins: what the `precision` config group instantiates.

A precision object owns the autocast context, loss scaling and the optimizer step that goes with it.
Strategies and the Accelerator call these hooks and never ask which precision is in use.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from enum import Enum
from typing import Annotated, Any

import torch

from runner.config import Fraction, PositiveFloat, PositiveInt, Range, checked
from runner.errors import ConfigError, install_command
from runner.ops import convert_to_fp32

log = logging.getLogger(__name__)


class PrecisionType(str, Enum):
    """Accelerate's `mixed_precision` names (a plugin's `mixed_precision` is one of them)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


@dataclasses.dataclass(frozen=True)
class Autocast:
    """`torch.autocast`'s switches beside the device and dtype: `enabled` (False: compute in fp32) and
    `cache_enabled` (None: torch's default)."""

    enabled: bool = True
    cache_enabled: bool | None = None

    def arguments(self) -> dict[str, Any]:
        cache = {} if self.cache_enabled is None else {"cache_enabled": self.cache_enabled}
        return {"enabled": self.enabled, **cache}


class Precision:
    """Full fp32 (the `fp32` group): no autocast, no loss scaling."""

    # Whether its optimizer step leaves out a step whose gradients are not finite by itself (fp16's loss
    # scaler): `trainer.on_nonfinite=skip` then counts the steps it skips instead of checking them again.
    skips_nonfinite_steps = False

    mixed_precision = "no"
    autocast_settings = Autocast()

    @property
    def name(self) -> str:
        """How logs and messages name it: the precision group's name ("fp32" for Accelerate's "no")."""
        return "fp32" if self.mixed_precision == "no" else self.mixed_precision

    def setup(self, device: torch.device) -> None:
        """Bind to the device this process trains on."""
        self.check_device(device)
        self.device = device

    def check_device(self, device: torch.device) -> None:
        """ConfigError when this precision cannot compute on `device` (checked before launch too)."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Replace the layers this precision computes its own way (float8 linears), in place."""
        return module

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Prepare a model for this precision (mixed precision runs its forward under autocast)."""
        return self.convert_module(module)

    def use_autocast(self, settings: Autocast) -> None:
        """Compute every autocast of this precision with `settings`."""
        self.autocast_settings = settings

    def use_loss_scaling(self, **scaler: Any) -> None:
        """`torch.amp.GradScaler`'s arguments for fp16's loss scaling (a warning elsewhere: there is no
        scaler to configure)."""
        log.warning(
            "Loss-scaling settings (%s) change nothing: precision %s has no loss scaling.",
            ", ".join(scaler),
            self.name,
        )

    def autocast(self, settings: Autocast | None = None) -> AbstractContextManager:
        """The context that computes in this precision (`settings` for this block only)."""
        return nullcontext()

    def keeping_outputs(self, loss_of: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
        """`loss_of(batch)`, in which a prepared model's forward returns its outputs as computed, not upcast
        to fp32 (for a loss from `upcast_outputs`, which upcasts them itself)."""
        return loss_of

    def upcast_outputs(
        self, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> Callable[[Any, Any], torch.Tensor]:
        """`loss_fn(outputs, batch)` on the outputs upcast to fp32, as the model's forward returns them
        outside `keeping_outputs`: the same loss, and compiled, its first kernel reads the outputs in
        the compute dtype (a language model's fp32 logits, 6.6 GB at 32 x 1024 x 50304, never written)."""
        return loss_fn

    def backward(self, loss: torch.Tensor, options: Mapping[str, Any] | None = None) -> None:
        """`loss.backward(**options)`."""
        loss.backward(**options) if options else loss.backward()

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


class UpcastingPrecision(Precision):
    """A precision whose model computes below fp32 while its prepared model returns fp32 outputs, as
    Accelerate's does (`convert_outputs_to_fp32`): the instance's forward runs in `forward_context` and its
    outputs are upcast, but inside `keeping_outputs`, where the training loop's loss (from
    `upcast_outputs`) upcasts them itself. `Accelerator.unwrap_model(model, keep_fp32_wrapper=False)`
    restores `_original_forward`."""

    keeps_outputs = False  # inside `keeping_outputs`

    def forward_context(self) -> AbstractContextManager:
        """The context the model's forward runs in."""
        return nullcontext()

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = self.convert_module(module)
        if "_original_forward" not in module.__dict__:
            module._original_forward = module.forward
            module.forward = _upcasting_forward(module.forward, self)
        return module

    def keeping_outputs(self, loss_of: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
        @functools.wraps(loss_of)
        def keeping(batch: Any) -> torch.Tensor:
            self.keeps_outputs = True
            try:
                return loss_of(batch)
            finally:
                self.keeps_outputs = False

        return keeping

    def upcast_outputs(
        self, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> Callable[[Any, Any], torch.Tensor]:
        @functools.wraps(loss_fn)
        def on_fp32_outputs(outputs: Any, batch: Any) -> torch.Tensor:
            return loss_fn(convert_to_fp32(outputs), batch)

        return on_fp32_outputs


class MixedPrecision(UpcastingPrecision):
    """Autocast the model's forward to `dtype` (the `bf16` group); weights and optimizer stay fp32."""

    _names = {"bfloat16": "bf16", "float16": "fp16"}

    def __init__(self, dtype: str = "bfloat16") -> None:
        if dtype not in self._names:
            raise ValueError(
                f"precision.dtype={dtype!r} is not supported; expected one of {list(self._names)}."
            )
        self.dtype = getattr(torch, dtype)
        self.mixed_precision = self._names[dtype]

    def forward_context(self) -> AbstractContextManager:
        return self.autocast()

    def autocast(self, settings: Autocast | None = None) -> AbstractContextManager:
        arguments = (settings or self.autocast_settings).arguments()
        return torch.autocast(self.device.type, dtype=self.dtype, **arguments)


class ShardedMixedPrecision(UpcastingPrecision):
    """Mixed precision that the strategy applies itself (FSDP's MixedPrecisionPolicy casts the parameters
    each unit computes with): no autocast here; `precision`'s name and layer conversion (float8), and the
    outputs upcast as every mixed precision's."""

    def __init__(self, precision: Precision) -> None:
        self.mixed_precision = precision.mixed_precision
        self.precision = precision

    def check_device(self, device: torch.device) -> None:
        self.precision.check_device(device)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.precision.convert_module(module)


FP8_REQUIREMENT = f"{install_command('fp8')} (torchao)"


class Float8Precision(MixedPrecision):
    """float8 training with torchao (the `fp8` group): each `nn.Linear` becomes a `Float8Linear` whose
    three matmuls (forward, input and weight gradients) run in float8 with dynamic scales; everything
    else runs under bf16 autocast, weights and optimizer stay fp32. Needs an NVIDIA GPU of compute
    capability 8.9 or newer (Ada, Hopper, Blackwell).

    Args:
        recipe: "tensorwise" (one scale per tensor: fastest) or "rowwise" (one per row: more accurate).
        keep: module names (fnmatch patterns, e.g. "lm_head", "blocks.0.*") kept in bf16 (default: the
            output head). Linear layers whose sizes are not multiples of 16 (what float8 matmuls need) are
            kept too.
        fsdp_float8_all_gather: with hardware=fsdp, all-gather the weights in float8 (tensorwise only).
        emulate: compute the float8 casts and scales, but matmuls in high precision (torchao's emulation):
            float8 numerics on any device, without the speed, for tests on the CPU.
    """

    RECIPES = ("tensorwise", "rowwise")

    def __init__(
        self,
        recipe: str = "tensorwise",
        keep: Sequence[str] = ("lm_head",),
        fsdp_float8_all_gather: bool = False,
        emulate: bool = False,
    ) -> None:
        super().__init__("bfloat16")
        self.mixed_precision = "fp8"
        if recipe not in self.RECIPES:
            raise ConfigError(f"precision.recipe={recipe!r}: expected one of {', '.join(self.RECIPES)}.")
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ConfigError(
                f"precision.fsdp_float8_all_gather=true with precision.recipe={recipe}: torchao gathers float8 "
                "weights with one scale per tensor only. Use precision.recipe=tensorwise, or "
                "precision.fsdp_float8_all_gather=false."
            )
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError(f"precision=fp8 needs torchao, which is not installed here: {FP8_REQUIREMENT}.")
        self.recipe = recipe
        self.keep = list(keep)
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.emulate = emulate

    def check_device(self, device: torch.device) -> None:
        if self.emulate:
            return
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if capability is None or capability < (8, 9):
            found = (
                f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
                if capability
                else f"the {device.type} device"
            )
            raise ConfigError(
                f"precision=fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) "
                f"for its float8 matmuls; this run computes on {found}. Use precision=bf16 here, or "
                "precision.emulate=true to run float8 numerics without float8 matmuls (slower: for tests)."
            )

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The model's linear layers as Float8Linear, in place, but those `keep` names and those whose
        sizes float8 matmuls cannot take."""
        Float8LinearConfig, convert_to_float8_training = _torchao_float8()
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(self.recipe),
            emulate=self.emulate,
            enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather,
        )
        return convert_to_float8_training(module, config=config, module_filter_fn=self.converts)

    def converts(self, module: torch.nn.Module, name: str) -> bool:
        """Whether the linear layer `name` is converted to float8."""
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.keep):
            return False
        return not isinstance(module, torch.nn.Linear) or (
            module.in_features % 16 == 0 and module.out_features % 16 == 0
        )


class Float16MixedPrecision(MixedPrecision):
    """fp16 autocast with dynamic loss scaling through `torch.amp.GradScaler` (the `fp16` group).

    A step whose gradients hold inf/nan is skipped and the scale is multiplied by `backoff_factor`.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: GradScaler's: the loss scale to start
            from; multiplied by `growth_factor` (> 1) after `growth_interval` steps without inf/nan, and by
            `backoff_factor` (between 0 and 1) at a step with them.
    """

    skips_nonfinite_steps = True

    @checked("precision")
    def __init__(
        self,
        init_scale: PositiveFloat = 2.0**16,
        growth_factor: Annotated[float, Range(gt=1)] = 2.0,
        backoff_factor: Fraction = 0.5,
        growth_interval: PositiveInt = 2000,
    ) -> None:
        super().__init__("float16")
        self.scaler_kwargs = dict(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )

    def use_loss_scaling(self, **scaler: Any) -> None:
        self.scaler_kwargs.update(scaler)

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        self.scaler = torch.amp.GradScaler(device.type, **self.scaler_kwargs)

    def backward(self, loss: torch.Tensor, options: Mapping[str, Any] | None = None) -> None:
        self.scaler.scale(loss).backward(**(options or {}))

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


def _torchao_float8() -> tuple[Any, Any]:
    """torchao's `Float8LinearConfig` and `convert_to_float8_training`, imported without the warnings
    logged on import (the CUDA kernels and Triton a CPU build lacks, a deprecation in torch)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return Float8LinearConfig, convert_to_float8_training


def refuse_fp8(precision: Precision, hardware: str, why: str) -> None:
    """ConfigError when `precision` is float8, which `hardware` cannot run (`why` says so)."""
    if isinstance(precision, Float8Precision):
        raise ConfigError(
            f"precision=fp8 with hardware={hardware}: {why}. Use precision=fp8 with hardware=single_device (one GPU), "
            "ddp or fsdp, or precision=bf16 here."
        )


def refuse_fp16(precision: Precision, hardware: str, why: str) -> None:
    """ConfigError when `precision` is fp16 autocast, which `hardware` cannot run (`why` says so)."""
    if isinstance(precision, MixedPrecision) and precision.mixed_precision == "fp16":
        raise ConfigError(
            f"precision=fp16 with hardware={hardware}: {why}. Use precision=bf16 (no loss scaling needed) or "
            "precision=fp32."
        )


def from_name(mixed_precision: str | PrecisionType | None) -> Precision:
    """Accelerate's `mixed_precision` names ("no", "fp16", "bf16", "fp8", or a `PrecisionType`) to a
    precision plugin."""
    factories: dict[str | None, Callable[[], Precision]] = {
        None: Precision,
        "no": Precision,
        "fp32": Precision,
        "bf16": MixedPrecision,
        "fp16": Float16MixedPrecision,
        "fp8": Float8Precision,
    }
    name = getattr(mixed_precision, "value", mixed_precision)
    if name not in factories:
        raise ValueError(f"mixed_precision={mixed_precision!r}: expected one of 'no', 'fp16', 'bf16', 'fp8'.")
    return factories[name]()


def _upcasting_forward(forward: Callable, precision: UpcastingPrecision) -> Callable:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with precision.forward_context():
            outputs = forward(*args, **kwargs)
        return outputs if precision.keeps_outputs else convert_to_fp32(outputs)

    return wrapped
