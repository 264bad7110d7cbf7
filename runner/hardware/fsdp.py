"""`hardware=fsdp`: fully sharded data parallel (FSDP2, `fully_shard`): each rank holds a shard of every
parameter, gradient and optimizer state."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from runner.errors import ConfigError
from runner.hardware.parallel import ParallelStrategy
from runner.precision import MixedPrecision, Precision, ShardedMixedPrecision


class FSDP(ParallelStrategy):
    """Shard the model over all ranks with `fully_shard`: each module whose class is named in
    `shard_modules` (e.g. the transformer block) is one unit, gathered just before its forward and
    backward; the root module holds the rest.

    Args (beyond `ParallelStrategy`'s):
        shard_modules: class names of the sharding units; None: the root module only.
        reshard_after_forward: free gathered parameters after each unit's forward (saves memory, costs a
            second all-gather in backward).
        cpu_offload: keep parameter shards, gradients and optimizer states in CPU memory.

    bf16 comes from the precision group as FSDP's MixedPrecisionPolicy (parameters gathered in bf16,
    gradients reduced in fp32, outputs fp32). Checkpoints are sharded (torch.distributed.checkpoint);
    `save_model` gathers the full weights on rank 0.
    """

    checkpoint_format = "sharded"
    sharded_states = frozenset({"weights", "gradients", "optimizer"})

    def __init__(
        self,
        num_processes: int | None = None,
        device: str | None = None,
        backend: str | None = None,
        timeout_s: float = 1800.0,
        num_threads: int | None = None,
        shard_modules: list[str] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
    ) -> None:
        super().__init__(num_processes, device, backend, timeout_s, num_threads)
        self.shard_modules = list(shard_modules or [])
        self.reshard_after_forward = reshard_after_forward
        self.offload_policy: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
        self.mp_policy = MixedPrecisionPolicy()
        self._sharded: dict[int, torch.nn.Parameter] = {}  # id of an original parameter -> its shard

    def setup_precision(self, precision: Precision) -> Precision:
        if isinstance(precision, MixedPrecision) and precision.mixed_precision == "fp16":
            raise ConfigError(
                "precision=fp16 with hardware=fsdp: loss scaling of sharded gradients is not supported here. "
                "Use precision=bf16 (no scaling needed) or precision=fp32."
            )
        if isinstance(precision, MixedPrecision):
            self.mp_policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
            return ShardedMixedPrecision(precision.mixed_precision)
        return precision

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        before = dict(module.named_parameters())
        self.shard_fully(module, init_device_mesh(self.device.type, (torch.distributed.get_world_size(),)))
        # fully_shard replaces each parameter by a sharded one: remember which, for the optimizers.
        self._sharded.update({id(before[name]): param for name, param in module.named_parameters()})
        return module

    def shard_fully(self, module: torch.nn.Module, mesh: DeviceMesh) -> None:
        """`fully_shard` each unit named by `shard_modules`, then the root, over `mesh`."""
        options = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self.mp_policy,
            "offload_policy": self.offload_policy,
        }
        units = [m for m in module.modules() if type(m).__name__ in self.shard_modules and m is not module]
        if self.shard_modules and not units:
            classes = sorted({type(m).__name__ for m in module.modules()})
            raise ConfigError(
                f"hardware.shard_modules={self.shard_modules}: {type(module).__name__} has no module of those "
                f"classes. Its classes are: {', '.join(classes)}. Name one of them, or null to shard the root only."
            )
        for unit in units:
            fully_shard(unit, **options)
        # Units hand low-precision activations to each other; the model's outputs are fp32 (as autocast's).
        root_policy = MixedPrecisionPolicy(
            self.mp_policy.param_dtype, self.mp_policy.reduce_dtype, torch.float32
        )
        fully_shard(module, **(options | {"mp_policy": root_policy}))

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["params"] = [self._sharded.get(id(p), p) for p in group["params"]]

    @contextmanager
    def _no_sync(self, module: FSDPModule) -> Iterator[None]:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def no_sync(self, module: torch.nn.Module) -> AbstractContextManager:
        return self._no_sync(module) if isinstance(module, FSDPModule) else super().no_sync(module)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Gather the full weights (a collective); rank 0 gets them on the CPU, the others an empty dict."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(module, options=options)

    def save_checkpoint(
        self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], is_main_process: bool
    ) -> None:
        """Every rank writes its shards (torch.distributed.checkpoint): `model_<i>/`, `optimizer_<i>/`."""
        for i, model in enumerate(models):
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=directory / f"model_{i}")
        for i, optimizer in enumerate(optimizers):
            model = models[min(i, len(models) - 1)]
            state = get_optimizer_state_dict(model, optimizer)
            dcp.save({"optimizer": state}, checkpoint_id=directory / f"optimizer_{i}")

    def load_checkpoint(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any]) -> None:
        for i, model in enumerate(models):
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=directory / f"model_{i}")
            set_model_state_dict(model, state["model"])
        for i, optimizer in enumerate(optimizers):
            model = models[min(i, len(models) - 1)]
            state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=directory / f"optimizer_{i}")
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
