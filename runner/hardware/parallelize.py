"""Parallelisms applied to a module, one small named function each (torchtitan's `apply_*`), and what
strategies whose models end up as DTensors share afterwards (`ShardedState`: gradient sync switch, full
weights, DCP checkpoints).

Strategies compose them in a fixed order over one mesh: tensor parallel first (`apply_tp`), then data
parallel over the rest of the world (`apply_fsdp`, or `apply_ddp` for replicas).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from runner.errors import ConfigError

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
    in `mp_policy`'s dtype; the model's outputs are fp32 (as autocast's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy,
        "offload_policy": offload_policy,
    }
    units = [m for m in module.modules() if type(m).__name__ in shard_modules and m is not module]
    if shard_modules and not units:
        classes = sorted({type(m).__name__ for m in module.modules()})
        raise ConfigError(
            f"hardware.shard_modules={shard_modules}: {type(module).__name__} has no module of those "
            f"classes. Its classes are: {', '.join(classes)}. Name one of them, or null to shard the root only."
        )
    for unit in units:
        fully_shard(unit, **options)
    root_policy = MixedPrecisionPolicy(mp_policy.param_dtype, mp_policy.reduce_dtype, torch.float32)
    fully_shard(module, **(options | {"mp_policy": root_policy}))


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


def apply_ddp(module: torch.nn.Module, device: torch.device, **options: Any) -> DistributedDataParallel:
    """A replica of `module` per rank whose gradients are averaged during backward (DDP's `options`)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, **options)


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
    shards). Listed first among a strategy's bases."""

    checkpoint_format = "sharded"
    sharded_states = frozenset({"weights", "gradients", "optimizer"})

    def no_sync(self, module: torch.nn.Module) -> AbstractContextManager:
        return fsdp_no_sync(module)

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Gather the full weights (a collective); rank 0 gets them on the CPU, the others an empty dict."""
        return gather_full_state_dict(module)

    def save_checkpoint(
        self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], is_main_process: bool
    ) -> None:
        save_sharded(directory, models, optimizers)

    def load_checkpoint(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any]) -> None:
        load_sharded(directory, models, optimizers)


def gather_full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a DTensor-sharded model (a collective): rank 0 gets them on the CPU, the others an
    empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(directory: Path, models: list[torch.nn.Module], optimizers: list[Any]) -> None:
    """Every rank writes its shards (torch.distributed.checkpoint): `model_<i>/`, `optimizer_<i>/`. Each
    optimizer belongs to the model of its index (the last model for any beyond)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for i, model in enumerate(models):
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=directory / f"model_{i}")
    for i, optimizer in enumerate(optimizers):
        model = models[min(i, len(models) - 1)]
        dcp.save(
            {"optimizer": get_optimizer_state_dict(model, optimizer)},
            checkpoint_id=directory / f"optimizer_{i}",
        )


def load_sharded(directory: Path, models: list[torch.nn.Module], optimizers: list[Any]) -> None:
    """Load what `save_sharded` wrote into the (sharded) models and optimizers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for i, model in enumerate(models):
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=directory / f"model_{i}")
        set_model_state_dict(model, state["model"])
    for i, optimizer in enumerate(optimizers):
        model = models[min(i, len(models) - 1)]
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=directory / f"optimizer_{i}")
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
