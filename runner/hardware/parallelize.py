"""Parallelisms applied to a module, one small named function each (torchtitan's `apply_*`), and what
strategies whose models end up as DTensors share afterwards (`ShardedState`: gradient sync switch, full
weights, the "sharded" checkpoint format of `runner.checkpoint.formats`).

Strategies compose them in a fixed order over one mesh: tensor parallel first (`apply_tp`), then context
parallel (`apply_cp`), then the compute options per block (`apply_ac`, then `apply_compile`), then data
parallel over the rest of the world (`apply_fsdp`, or `apply_ddp` for replicas).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from runner.config import (
    ActivationCheckpointingConfig,
    CheckpointingMode,
    CompileConfig,
    CompileScope,
)
from runner.errors import ConfigError
from runner.hardware.context_parallel import ContextParallel
from runner.models.sequence_shares import share_model
from runner.torch_internals import inductor_modes

# torch.distributed.tensor (under FSDP2, tensor parallel and DCP) takes about 0.5 s to import: only runs
# that shard import it, when they do.
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.tensor.parallel import ParallelStyle


def apply_tp(module: torch.nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """Split the layers `plan` names (patterns of module names -> ParallelStyle) over `mesh`, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(module, mesh, plan)


def apply_cp(module: torch.nn.Module, cp: ContextParallel) -> None:
    """Train `module` on `cp`'s share of each sequence: its positions and attention follow that layout
    (`runner.models.sequence_shares.share_model`; `MeshStrategy.check_model` checks the model before
    launch)."""
    share_model(module, cp)


def apply_fsdp(
    module: torch.nn.Module,
    mesh: DeviceMesh,
    shard_modules: list[str],
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> None:
    """`fully_shard` each submodule whose class is named in `shard_modules` (a unit gathered just before
    its forward and backward), then the root, over `mesh`, in place. Units hand activations to each other
    in `mp_policy`'s dtype, and so does the root: the precision's forward upcasts them (Accelerate's
    outputs) or the training loop's loss does."""
    from torch.distributed.fsdp import fully_shard

    options = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy,
        "offload_policy": offload_policy,
    }
    units = [m for m in module.modules() if type(m).__name__ in shard_modules and m is not module]
    if shard_modules and not units:  # a pipeline stage may hold some of the classes, not none
        check_units(module, shard_modules)
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(module, **options)  # outputs as computed: the precision's forward upcasts them


def check_units(module: torch.nn.Module, shard_modules: list[str]) -> None:
    """ConfigError naming each class of `shard_modules` (`hardware.shard_modules`) that no submodule of
    `module` is an instance of (on meta before launch, as in the ranks)."""
    classes = sorted({type(m).__name__ for m in module.modules() if m is not module})
    missing = [name for name in shard_modules if name not in classes]
    if missing:
        raise ConfigError(
            f"hardware.shard_modules={list(shard_modules)}: {type(module).__name__} has no submodule of class "
            f"{', '.join(missing)}. Its classes are: {', '.join(classes)}. Name the blocks among them, [] to shard "
            "the root module only, or null for the blocks the model declares (_no_split_modules)."
        )


def sharding_units(module: torch.nn.Module, asked: list[str] | None) -> list[str]:
    """The class names of the FSDP units: those `asked` (`hardware.shard_modules`; [] shards the root
    only), else those the model declares indivisible (`_no_split_modules`, transformers' convention: its
    decoder layer; GPT's Block)."""
    return list(asked) if asked is not None else sorted(getattr(module, "_no_split_modules", None) or [])


def declared_tp_plan(module: torch.nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan a transformers model declares (`_tp_plan`: module name patterns ->
    "colwise" / "rowwise"; embeddings and the head stay replicated) as ParallelStyles. ValueError if
    `tp_size` does not divide the heads or a split width: each rank computes whole heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {pattern: styles[style]() for pattern, style in module._tp_plan.items() if style in styles}
    config = getattr(module, "config", None)
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        size = getattr(config, name, None)
        if isinstance(size, int) and size % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the model's {name}={size}.")
    return plan


def compute_settings(
    compile: CompileConfig, checkpointing: ActivationCheckpointingConfig, per_block: bool = False
) -> list[str]:
    """The compute options that are on, as `trainer.<key>=<value>`; with `per_block`, only those that act
    on the model's blocks (regional compilation, activation checkpointing)."""
    compiled = compile.scope == CompileScope.regional or (
        not per_block and compile.scope != CompileScope.none
    )
    settings = [f"trainer.compile.scope={CompileScope(compile.scope).value}"] if compiled else []
    if checkpointing.mode != CheckpointingMode.none:
        settings.append(
            f"trainer.activation_checkpointing.mode={CheckpointingMode(checkpointing.mode).value}"
        )
    return settings


def refuse_compute(
    compile: CompileConfig, checkpointing: ActivationCheckpointingConfig, hardware: str, why: str
) -> None:
    """ConfigError when a compute option is on, which `hardware` cannot apply (`why` says so)."""
    asked = compute_settings(compile, checkpointing)
    if asked:
        raise ConfigError(
            f"{' and '.join(asked)} with hardware={hardware}: {why}. Leave trainer.compile.scope and "
            f"trainer.activation_checkpointing.mode at none with hardware={hardware}."
        )


def blocks_of(module: torch.nn.Module, classes: list[str]) -> list[torch.nn.Module]:
    """The submodules of `module` whose class is named in `classes`, in order: the repeated blocks that
    activation checkpointing and regional compilation act on (the FSDP units, the decoder layers)."""
    return [m for m in module.modules() if type(m).__name__ in classes and m is not module]


# The ops whose outputs `save_matmuls` keeps: recomputing them is most of a block's FLOPs.
MATMULS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def apply_ac(blocks: list[torch.nn.Module], config: ActivationCheckpointingConfig) -> None:
    """Checkpoint the forward of each block `config` selects (non-reentrant `torch.utils.checkpoint`), in
    place: the module keeps its class, hooks and state-dict keys; only its input is kept for backward
    (with `save_matmuls`, its matmul outputs too), the rest is recomputed. `full`: every block;
    `selective`: blocks every_n_blocks - 1, 2 * every_n_blocks - 1, ..."""
    if config.mode == CheckpointingMode.none:
        return
    every = config.every_n_blocks if config.mode == CheckpointingMode.selective else 1
    save_matmuls = config.mode == CheckpointingMode.selective and config.save_matmuls
    for index, block in enumerate(blocks):
        if (index + 1) % every == 0 and "_unchecked_forward" not in block.__dict__:
            block._unchecked_forward = block.forward
            block.forward = _checkpointed(block.forward, save_matmuls)


def _checkpointed(forward: Callable, save_matmuls: bool) -> Callable:
    options: dict[str, Any] = {"use_reentrant": False}
    if save_matmuls:
        options["context_fn"] = _save_matmuls_context

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, **kwargs, **options)

    return wrapped


def _save_matmuls_context() -> Any:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def check_compile(config: CompileConfig) -> None:
    """ConfigError for a `trainer.compile` that torch.compile would refuse only at the first step: a
    backend it does not know, a mode inductor does not know, a mode given to another backend, or a mode
    and options both."""
    if config.scope == CompileScope.none:
        return
    if config.options is not None and not isinstance(config.options, Mapping):
        raise ConfigError(
            f"trainer.compile.options={config.options!r}: expected a mapping of the backend's options, e.g. "
            "{max_autotune: true} for inductor."
        )
    if config.mode is not None and config.options:
        raise ConfigError(
            f"trainer.compile.mode={config.mode} and trainer.compile.options: torch.compile takes one of them "
            "(a mode is a preset of options). Drop one."
        )
    backends = torch.compiler.list_backends(exclude_tags=())
    if config.backend not in backends:
        raise ConfigError(
            f"trainer.compile.backend={config.backend}: not a torch.compile backend of this torch "
            f"({torch.__version__}). Use one of {', '.join(backends)} (inductor generates kernels; aot_eager "
            "traces without them)."
        )
    modes = inductor_modes()
    if config.mode is not None and config.backend == "inductor" and config.mode not in modes:
        raise ConfigError(
            f"trainer.compile.mode={config.mode}: not a mode of the inductor backend. Use one of "
            f"{', '.join(modes)}, or null for the default."
        )
    if config.mode not in (None, "default") and config.backend != "inductor":
        raise ConfigError(
            f"trainer.compile.mode={config.mode}: modes are the inductor backend's, and "
            f"trainer.compile.backend={config.backend}. Set trainer.compile.mode=null, or "
            "trainer.compile.backend=inductor."
        )


def apply_compile(module: torch.nn.Module, blocks: list[torch.nn.Module], config: CompileConfig) -> None:
    """`torch.compile` in place (`Module.compile`: the module stays the user's, its state-dict keys have
    no `_orig_mod.`): the whole `module` (`model`), or each of `blocks` (`regional`: one compilation
    that the identical blocks reuse)."""
    if config.scope == CompileScope.none:
        return
    for target in [module] if config.scope == CompileScope.model else blocks:
        target.compile(**compile_options(config))


def compile_loss(loss_fn: Callable[..., torch.Tensor], config: CompileConfig) -> Callable[..., torch.Tensor]:
    """`loss_fn` compiled as the model is (`trainer.compile.loss`: with a language model's vocabulary the
    cross-entropy over its logits is a large share of the step, fused only when compiled), else itself."""
    if config.scope == CompileScope.none or not config.loss:
        return loss_fn
    return torch.compile(loss_fn, **compile_options(config))


def compile_options(config: CompileConfig) -> dict[str, Any]:
    """`torch.compile`'s arguments for `config`."""
    return {
        "backend": config.backend,
        "mode": config.mode,
        "fullgraph": config.fullgraph,
        "dynamic": config.dynamic,
        "options": dict(config.options or {}) or None,
    }


class DDPCommunicationHookType(str, Enum):
    """How DDP compresses gradients before its all-reduce (`DDPOptions.comm_hook`)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass(frozen=True)
class DDPOptions:
    """DistributedDataParallel's own arguments (`module`) and a communication hook: `comm_hook`, optionally
    wrapped by `comm_wrapper` (an fp16/bf16 cast of what PowerSGD sends); `comm_state`: PowerSGDState's
    arguments."""

    module: dict[str, Any] = field(default_factory=dict)
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state: dict[str, Any] = field(default_factory=dict)


def apply_ddp(module: torch.nn.Module, device: torch.device, **options: Any) -> DistributedDataParallel:
    """A replica of `module` per rank whose gradients are averaged during backward (DDP's `options`)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, **options)


def register_comm_hook(
    module: DistributedDataParallel,
    hook: DDPCommunicationHookType,
    wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO,
    state_options: dict[str, Any] | None = None,
) -> None:
    """Compress `module`'s gradients before DDP's all-reduce: fp16 or bf16 casts, or PowerSGD's low-rank
    approximation (`state_options`: PowerSGDState's arguments), optionally wrapped by an fp16/bf16 cast of
    what PowerSGD sends."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
        DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
        DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
    }
    wrappers = {
        DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
        DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
    }
    hook, wrapper = DDPCommunicationHookType(hook), DDPCommunicationHookType(wrapper)
    if hook is DDPCommunicationHookType.NO:
        return
    if wrapper is not DDPCommunicationHookType.NO and wrapper not in wrappers:
        raise ValueError(f"DDP's comm_wrapper={wrapper.value!r}: expected 'no', 'fp16' or 'bf16'.")
    function = hooks[hook]
    if wrapper in wrappers:
        function = wrappers[wrapper](function)
    state = None
    if hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD):
        state = powerSGD_hook.PowerSGDState(process_group=None, **(state_options or {}))
    module.register_comm_hook(state=state, hook=function)


def fsdp_no_sync(module: torch.nn.Module) -> AbstractContextManager:
    """Skip FSDP's gradient reduction inside (gradient accumulation); nothing for a module FSDP did not
    shard."""
    from torch.distributed.fsdp import FSDPModule

    return _without_gradient_sync(module) if isinstance(module, FSDPModule) else nullcontext()


@contextmanager
def _without_gradient_sync(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


class ShardedState:
    """What a strategy whose model ends up as DTensors (FSDP, tensor parallel) answers alike: gradient sync
    through FSDP's switch, the full weights gathered on rank 0, DCP checkpoints (every rank writes its
    shards: `runner.checkpoint.formats.Sharded`). Listed first among a strategy's bases."""

    checkpoint_format = "sharded"
    reshards_checkpoints = True  # DCP loads a checkpoint onto any layout of the same model
    sharded_states = frozenset({"weights", "gradients", "optimizer"})

    def no_sync(self, module: torch.nn.Module) -> AbstractContextManager:
        return fsdp_no_sync(module)

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Gather the full weights (a collective); rank 0 gets them on the CPU, the others an empty dict."""
        return gather_full_state_dict(module)


def gather_full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a DTensor-sharded model (a collective): rank 0 gets them on the CPU, the others an
    empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
