"""What `accelerate launch` (and an Accelerate config) passed to the script in `ACCELERATE_*` variables, as
the Accelerator applies it."""

from __future__ import annotations

import os
from dataclasses import dataclass

# `accelerate launch` (and an Accelerate config) pass settings to the script in these variables.
_ACCELERATE_REFUSED = {
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM: pass strategy=runner.hardware.TensorParallel(...), or run `python -m runner hardware=tensor_parallel`",
    "ACCELERATE_USE_SAGEMAKER": "SageMaker data parallel, which runner does not have",
    "ACCELERATE_DEBUG_MODE": "debug mode (shape checks before every collective), which runner does not have",
}


def env_flag(name: str) -> bool:
    """Whether the variable `name` is set to 1, true or yes."""
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class AccelerateLaunchSettings:
    """What `accelerate launch` set for the script, as the Accelerator applies it."""

    cpu: bool = False  # ACCELERATE_USE_CPU
    mixed_precision: str | None = None  # ACCELERATE_MIXED_PRECISION
    gradient_accumulation_steps: int | None = None  # ACCELERATE_GRADIENT_ACCUMULATION_STEPS
    # ACCELERATE_USE_FSDP: the FSDP_* variables of the launch config, named without the prefix, lowercase
    fsdp: dict[str, str] | None = None
    deepspeed: bool = (
        False  # ACCELERATE_USE_DEEPSPEED (a DeepSpeedPlugin reads the ACCELERATE_DEEPSPEED_* variables)
    )
    # ACCELERATE_USE_PARALLELISM_CONFIG (a ParallelismConfig reads the PARALLELISM_CONFIG_* variables)
    parallelism_config: bool = False


def accelerate_launch_settings() -> AccelerateLaunchSettings:
    """The `ACCELERATE_*` variables of this process's environment that runner applies; ValueError for
    one that selects what runner's Accelerator does not do that way (FSDP, DeepSpeed, ... from a launch
    config: never silently replaced by plain data parallel)."""
    refused = [f"{name}=true asks for {why}" for name, why in _ACCELERATE_REFUSED.items() if env_flag(name)]
    if refused:
        raise ValueError(
            "This process was started with Accelerate launch settings that runner's Accelerator does not read: "
            + "; ".join(refused)
            + ". Unset them (or launch with torchrun / `accelerate launch` without them)."
        )
    steps = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    return AccelerateLaunchSettings(
        cpu=env_flag("ACCELERATE_USE_CPU"),
        mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION") or None,
        gradient_accumulation_steps=int(steps) if steps else None,
        fsdp={
            name.removeprefix("FSDP_").lower(): value
            for name, value in os.environ.items()
            if name.startswith("FSDP_")
        }
        if env_flag("ACCELERATE_USE_FSDP")
        else None,
        deepspeed=env_flag("ACCELERATE_USE_DEEPSPEED"),
        parallelism_config=env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"),
    )
