"""`python -m runner plan=true ...`: what the run would do, printed without starting anything."""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from runner.build import Blueprint, build_data, build_on_meta
from runner.cluster import available_cores
from runner.config import CheckpointingMode, CompileScope
from runner.hardware.base import Strategy
from runner.hardware.parallelize import apply_ac, blocks_of
from runner.perf import kept_for_backward, mfu_unknown, parameters_text, peak_flops

MB = 1024**2


def describe(
    cfg: DictConfig,
    strategy: Strategy,
    world_size: int,
    launcher: str,
    resume_from: str | None,
    blueprint: Blueprint | None = None,
) -> str:
    """The plan of one job, one line per aspect: `strategy` is the validated hardware, `launcher` the
    launcher's own line; `blueprint` the one the checks read, else built here (an inference task's)."""
    plugin = strategy.setup_precision(instantiate(cfg.precision))
    precision = plugin.mixed_precision
    if blueprint is None:
        data = build_data(cfg)
        per_device = strategy.data_parallel_size(world_size) if cfg.trainer.split_batches else 1
        blueprint = Blueprint(cfg, data, build_on_meta(cfg, data), per_device)
    model = blueprint.model
    parameters = sum(p.numel() for p in model.parameters())  # tied weights once
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer = cfg.trainer
    peak = strategy.peak_flops or peak_flops(strategy.device_name(), precision)
    batch = cfg.data.get("batch_size")
    if batch and trainer.split_batches:
        batch //= world_size
    hardware = {
        k: v for k, v in OmegaConf.to_container(cfg.hardware, resolve=True).items() if k != "_target_"
    }
    lines = {
        "launcher": launcher,
        "devices": f"{world_size} x {strategy.device.type} ({available_cores()} CPU cores on this machine)",
        "hardware": f"{cfg.hardware._target_} {hardware}",
        "layout": strategy.layout(world_size),
        "stages": strategy.describe_stages(model),
        "precision": plugin.name,
        "batch": (
            f"{batch} per device x {world_size} device(s) x {trainer.gradient_accumulation_steps} accumulation "
            f"step(s) = {batch * world_size * trainer.gradient_accumulation_steps} samples per optimizer step"
            if batch
            else "set by the data source"
        ),
        "steps": (
            f"{trainer.max_steps} optimizer steps" if trainer.max_steps else f"{trainer.max_epochs} epoch(s)"
        )
        + f"; evaluate every {trainer.eval_every or 'run end'}, log every {trainer.log_every}",
        "checkpoints": (
            " and ".join(checkpoint_periods(trainer))
            or "only when stopped (Ctrl-C, SIGTERM, SIGUSR1, SIGUSR2)"
        )
        + f", keep {trainer.keep_checkpoints}; resume from {resume_from or 'nothing (a fresh start)'}",
        "failure": loss_per_failure(trainer),
        "tracker": _tracker(cfg),
        "model": _model(cfg.model._target_, model),
        "perf/mfu": None if peak else f"not reported: {mfu_unknown(strategy.device_name())}",
        "memory/device": _memory(parameters, trained, strategy, world_size, cfg.optimizer),
        "compute": _compute(strategy),
        "activations": _activations(blueprint, strategy),
    }
    lines = {k: v for k, v in lines.items() if v is not None}
    width = max(map(len, lines))
    return "plan (nothing was started):\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in lines.items())


def _model(target: str, model: Any) -> str:
    """The model's line: its target and parameters, how many train where some are frozen (an adapter's)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return f"{target}, {parameters_text(model)}" + (
        f" ({type(model).__name__}: the others frozen)" if frozen else ""
    )


def checkpoint_periods(trainer: DictConfig) -> list[str]:
    return [
        *([f"every {trainer.checkpoint_every} steps"] if trainer.checkpoint_every else []),
        *(
            [f"every {trainer.checkpoint_every_s:g} s (at a logging step)"]
            if trainer.checkpoint_every_s
            else []
        ),
    ]


def loss_per_failure(trainer: DictConfig) -> str:
    """What a failure costs in steps trained again: those since the last periodic checkpoint."""
    lost = []
    if trainer.checkpoint_every:
        every = trainer.checkpoint_every
        lost.append(f"up to {every} steps ({every / 2:g} on average)")
    if trainer.checkpoint_every_s:
        every_s = trainer.checkpoint_every_s
        lost.append(
            f"up to {every_s:g} s of steps and {trainer.log_every} more ({every_s / 2:g} s on average)"
        )
    if not lost:
        return (
            "every step since the start is trained again (no periodic checkpoint: set trainer.checkpoint_every "
            "or trainer.checkpoint_every_s)"
        )
    return f"{' or '.join(lost)} trained again, whichever is less, plus the restart"


def _compute(strategy: Strategy) -> str:
    """The compute options the strategy applies to the model."""
    compile = strategy.compile_config
    compiled = (
        f"torch.compile {CompileScope(compile.scope).value} (backend {compile.backend}, mode {compile.mode or 'default'}"
        f"{', fullgraph' if compile.fullgraph else ''})"
        if compile.scope != CompileScope.none
        else "eager"
    )
    checkpointing = strategy.activation_checkpointing
    recomputed = {
        CheckpointingMode.none: "no activation checkpointing",
        CheckpointingMode.full: "activation checkpointing of every block",
        CheckpointingMode.selective: f"activation checkpointing of one block in {checkpointing.every_n_blocks}"
        + (" (matmul outputs kept)" if checkpointing.save_matmuls else ""),
    }[CheckpointingMode(checkpointing.mode)]
    return f"{compiled}; {recomputed}"


def _tracker(cfg: DictConfig) -> str:
    if not cfg.tracker._target_:
        return "none"
    return instantiate(cfg.tracker).describe()


def optimizer_states(optimizer: DictConfig) -> int:
    """Values the optimizer keeps per parameter: SGD one with momentum (else none); Adam-like ones (and
    those not known here) two moments."""
    if "sgd" in optimizer._target_.lower():
        return int(bool(optimizer.get("momentum")))
    return 2


def state_memory(
    parameters: int,
    bytes_per_value: float,
    states: int,
    sharded: frozenset[str],
    world_size: int,
    trained: int | None = None,
) -> dict[str, float]:
    """Bytes on one device of the weights, gradients and optimizer states, those in `sharded` split over
    `world_size` devices; gradients and optimizer states for the `trained` parameters only (None: all)."""
    trained = parameters if trained is None else trained
    sizes = {
        "weights": parameters * bytes_per_value,
        "gradients": trained * bytes_per_value,
        "optimizer": trained * bytes_per_value * states,
    }
    return {k: v / (world_size if k in sharded else 1) for k, v in sizes.items()}


def _activations(blueprint: Blueprint, strategy: Strategy) -> str:
    """What autograd keeps for the backward pass in one training step of a per-device batch, run on meta
    tensors with the strategy's activation checkpointing applied (fp32; bf16/fp16 autocast halves the
    matmul ones); and the FLOPs of that step (the blueprint's count, forward and backward)."""
    model = blueprint.model
    try:
        flops = blueprint.flops
        apply_ac(blocks_of(model, strategy.block_classes(model)), strategy.activation_checkpointing)
        with kept_for_backward(model) as kept:
            blueprint.training_step()
    except Exception as err:  # a task that reads values (`.item()`) cannot run on meta tensors
        return f"not estimated (the task's training_step cannot run on meta tensors: {str(err).splitlines()[0][:120]})"
    checkpointing = strategy.activation_checkpointing
    checkpointed = ", with activation checkpointing" if checkpointing.mode != CheckpointingMode.none else ""
    if checkpointing.mode == CheckpointingMode.selective and checkpointing.save_matmuls:
        checkpointed += ", plus the matmul outputs it keeps, not counted here"
    kept_bytes = sum(kept.values()) * strategy.activation_share()
    return (
        f"about {kept_bytes / MB:.1f} MB per device for one micro-batch (tensors kept for backward"
        f"{checkpointed}); the step computes {flops / 1e9:.3g} GFLOP (forward and backward, recomputation not counted)"
    )


def _memory(parameters: int, trained: int, strategy: Strategy, world_size: int, optimizer: DictConfig) -> str:
    """Weights, gradients and optimizer states in fp32 on one device (gradients and states of the
    `trained` parameters), after the backend's sharding; activations are the `activations` line's."""
    sharded = strategy.sharded_states
    per_device = state_memory(parameters, 4, optimizer_states(optimizer), sharded, world_size, trained)
    parts = ", ".join(
        f"{k} {v / MB:.1f} MB" + (" (sharded)" if k in sharded else "") for k, v in per_device.items()
    )
    return f"{parts}; total {sum(per_device.values()) / MB:.1f} MB, plus activations"
