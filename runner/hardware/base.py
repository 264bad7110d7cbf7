"""The contract every hardware backend implements."""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from runner.config import ActivationCheckpointingConfig, CompileConfig
from runner.errors import ConfigError
from runner.hardware.parallelize import (
    DDPOptions,
    apply_ac,
    apply_compile,
    blocks_of,
    check_compile,
    compile_loss,
    compute_settings,
    sharding_units,
)
from runner.ops import on_device
from runner.precision import Precision
from runner.state import DistributedType, ProcessState
from runner.task import model_outputs

NOTHING = nullcontext()  # the context of what a backend need not do (reusable: it holds no state)


@dataclass(frozen=True)
class ProcessGroupOptions:
    """Settings of the process group a strategy forms (None: the strategy's own): torch.distributed's
    `backend`, where the ranks meet (`init_method`) and how long a collective waits (`timeout`)."""

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


class DummyOptim:
    """Accelerate's stand-in for the optimizer a DeepSpeed config declares (its `optimizer` block): under a
    `DeepSpeedPlugin`, `prepare` has the engine build that optimizer over `params` (parameters or groups),
    the block's "auto" `lr` and `weight_decay` taken from here, and returns it prepared."""

    def __init__(self, params: Any, lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        params = list(params)
        self.params = params
        self.lr, self.weight_decay, self.kwargs = lr, weight_decay, kwargs
        grouped = bool(params) and isinstance(params[0], dict)
        self.param_groups = [dict(g) for g in params] if grouped else [{"params": params}]
        self.scheduler: DummyScheduler | None = None  # the DummyScheduler over this one, if any


class DummyScheduler:
    """Accelerate's stand-in for the learning-rate schedule a DeepSpeed config declares (its `scheduler`
    block; "auto" `warmup_min_lr` 0, `warmup_max_lr` the optimizer's lr, `warmup_num_steps`,
    `total_num_steps` per process, from here), or for `lr_scheduler_callable(optimizer)`: the engine builds
    it over its optimizer and steps it with each optimizer step. Prepare it with its `DummyOptim`."""

    def __init__(
        self,
        optimizer: DummyOptim,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable | None = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps, self.warmup_num_steps = total_num_steps, warmup_num_steps
        self.lr_scheduler_callable, self.kwargs = lr_scheduler_callable, kwargs
        if isinstance(optimizer, DummyOptim):
            optimizer.scheduler = self  # the engine, built with the optimizer, needs the schedule then


def one_process_state(device: torch.device, num_threads: int | None) -> ProcessState:
    """The place of a process that is the whole job, on `device` (`num_threads`: intra-op CPU threads;
    None keeps torch's default)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return ProcessState(device=device)


class ParameterMap:
    """Which parameter object replaced which when a model was prepared (device placement that makes new
    ones on XLA, sharding, tensor parallel, this rank's pipeline stages), so that optimizers built over
    the user's parameters follow them: the one remapping path. The replaced parameters are kept alive
    (their ids are the keys)."""

    def __init__(self) -> None:
        self._replacements: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter | None]] = {}

    def record(
        self, before: dict[str, torch.nn.Parameter], after: dict[str, torch.nn.Parameter | None]
    ) -> None:
        """Each parameter of `before` is now the one of the same name in `after`; None: this rank no
        longer holds it. A tied weight becomes whichever of its names is held here."""
        for name, param in before.items():
            new = after.get(name)
            if new is param:
                continue
            if new is not None or id(param) not in self._replacements:
                self._replacements[id(param)] = (param, new)

    def current(self, param: torch.nn.Parameter) -> torch.nn.Parameter | None:
        """What `param` is now, through every replacement since (None: no longer held here)."""
        while param is not None and id(param) in self._replacements:
            param = self._replacements[id(param)][1]
        return param

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Point `optimizer` at the current parameters, in place (dropping those no longer held here)."""
        for group in optimizer.param_groups:
            params = [self.current(p) for p in group["params"]]
            group["params"] = [p for p in params if p is not None]


class Strategy(ABC):
    """How one process joins its job, places and wraps the model, and talks to its peers.

    Subclasses implement the process set-up; the other hooks have defaults, the collectives those of one
    process, that a backend overrides only where it differs (DDP skips gradient sync, DeepSpeed owns
    backward, multi-process backends exchange tensors, ...).
    A launcher reads `num_processes` (how many ranks to start on this machine) and `start_method`.
    """

    num_processes: int = 1
    start_method: str = "spawn"
    oversubscribe: bool = False  # run more CPU ranks than this machine has cores

    def cpu_ranks(self) -> int:
        """How many of the ranks a launcher starts on this machine compute on its CPU cores."""
        return 0

    distributed_type: DistributedType = DistributedType.NO
    # How its checkpoints hold models and optimizers: "full", "sharded" or "deepspeed", each written by
    # `runner.checkpoint.formats`; whether they load onto another number of ranks; whether they can be
    # staged into host memory and written in the background.
    checkpoint_format: str = "full"
    reshards_checkpoints: bool = False
    async_checkpoints: bool = True
    # Whether the loop may leave out an optimizer step (`trainer.on_nonfinite=skip`, `gradients_finite`).
    skips_steps: bool = True
    # Which of "weights", "gradients", "optimizer" each rank holds only a 1/world_size share of.
    sharded_states: frozenset[str] = frozenset()
    # The compute options (trainer.compile, trainer.activation_checkpointing) `setup_module` applies.
    compile_config: CompileConfig = CompileConfig()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    peak_flops: float | None = None  # hardware.peak_flops: one device's peak FLOP/s, over runner.perf's table

    @classmethod
    def states_sharded_by(cls, settings: Mapping[str, Any]) -> frozenset[str]:
        """What `sharded_states` is for these settings (the hardware group's), read without building the
        strategy, whose backend need not be installed (`runner estimate-memory`)."""
        return cls.sharded_states

    def device_name(self) -> str:
        """The name of this process's device, as `runner.perf.PEAK_FLOPS` knows devices."""
        device = getattr(self, "device", torch.device("cpu"))
        return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type

    def setup_compute(self, compile: CompileConfig, checkpointing: ActivationCheckpointingConfig) -> None:
        """Keep the compute options that `setup_module` applies per block; ConfigError for one this
        backend cannot run."""
        check_compile(compile)
        self.compile_config, self.activation_checkpointing = compile, checkpointing

    def block_classes(self, module: torch.nn.Module) -> list[str]:
        """The class names of the model's repeated blocks, which activation checkpointing and regional
        compilation act on: those it declares indivisible (`_no_split_modules`)."""
        return sharding_units(module, None)

    def check_compute(self, module: torch.nn.Module) -> None:
        """Before launch, on the meta model: ConfigError when the compute options need blocks that the
        model does not declare."""
        needs = compute_settings(self.compile_config, self.activation_checkpointing, per_block=True)
        if needs and not blocks_of(module, self.block_classes(module)):
            raise ConfigError(
                f"{' and '.join(needs)}: they act on the model's repeated blocks, and {type(module).__name__} "
                f"declares none (classes named in hardware.shard_modules, else its `_no_split_modules`; found "
                f'{self.block_classes(module) or "none"}). Add `_no_split_modules = ["MyBlock"]` to the model '
                "class (transformers models and runner.models.GPT have it), or use trainer.compile.scope=model."
            )

    def apply_compute(self, module: torch.nn.Module) -> None:
        """Activation checkpointing, then compilation, of the model's blocks (in place): after tensor
        parallel, before the data-parallel wrapper, as torchtitan orders them."""
        blocks = blocks_of(module, self.block_classes(module))
        apply_ac(blocks, self.activation_checkpointing)
        apply_compile(module, blocks, self.compile_config)

    def compile_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`loss_fn` compiled with the model's settings (`trainer.compile.loss`), else itself."""
        return compile_loss(loss_fn, self.compile_config)

    def use_process_group(self, options: ProcessGroupOptions) -> None:
        """Apply `options` to the process group this strategy forms (before `setup_environment`);
        ConfigError where it forms none that takes them."""
        self._refuse(options)

    def use_ddp(self, options: DDPOptions) -> None:
        """Apply DistributedDataParallel's `options` (before `prepare`); ConfigError where this strategy
        does not wrap models in DDP."""
        self._refuse(options)

    def _refuse(self, options: object) -> None:
        raise ConfigError(
            f"{type(options).__name__} configures what {type(self).__name__} "
            f"(DistributedType.{self.distributed_type.value}) does not use: remove it, or run the backend it "
            "is meant for."
        )

    @abstractmethod
    def setup_environment(self) -> ProcessState:
        """Join the job (process group, device selection) and say where this process sits in it."""

    # The collectives, as one process has them (nothing to exchange); multi-process backends override all.
    def barrier(self) -> None:
        """Block until every process reaches this point."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` over all processes (`op`: "sum", "mean", "max", "min" or "product")."""
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate `tensor` from all processes along the first dimension."""
        return tensor

    def all_gather_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate `tensor` from every process, in rank order, along the first dimension: the ranks that
        share a batch (tensor, context or pipeline parallel) too, which `all_gather` leaves out."""
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` (in place) with process `src`'s and return it."""
        return tensor

    def broadcast_object_list(self, objects: list[Any], src: int = 0) -> list[Any]:
        """Replace `objects` in place by those of process `src`."""
        return objects

    def all_gather_object(self, obj: Any) -> list[Any]:
        """The picklable `obj` of every process, in process order."""
        return [obj]

    def data_parallel_size(self, world_size: int) -> int:
        """How many of `world_size` ranks read different batches (all of them, unless ranks split the
        model itself)."""
        return world_size

    def layout(self, world_size: int) -> str:
        """How `world_size` ranks share the work, for the plan."""
        return "one process" if world_size == 1 else f"{world_size} ranks, each reading its own batches"

    def activation_share(self) -> float:
        """For `plan=true`: the share of one process's activations (the whole model on a per-device batch)
        that a device keeps at once."""
        return 1.0

    def describe_stages(self, model: torch.nn.Module) -> str | None:
        """For `plan=true`: how the model is split into pipeline stages (None: it is not)."""
        return None

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        """Before launch, with the model on the meta device: raise ConfigError for what this backend cannot
        do with it on `world_size` ranks."""

    def setup_precision(self, precision: Precision) -> Precision:
        """The precision plugin to train with: `precision` itself, unless this backend applies it its own
        way (FSDP's MixedPrecisionPolicy). Raises ConfigError for a precision it cannot run."""
        return precision

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Wrap the (already placed) model for this backend; here: the compute options only."""
        self.apply_compute(module)
        return module

    @functools.cached_property
    def parameter_map(self) -> ParameterMap:
        """The parameters that preparing models replaced (see `ParameterMap`)."""
        return ParameterMap()

    def replace_parameters(
        self, module: torch.nn.Module, apply: Callable[[], torch.nn.Module | None]
    ) -> torch.nn.Module:
        """Run `apply` (which replaces the module's parameters: placement, sharding, tensor parallel, in
        place, or returns the module that holds them now: this rank's pipeline stages) and record which
        parameter became which in `parameter_map`; the module that holds them."""
        before = dict(module.named_parameters(remove_duplicate=False))
        result = apply()
        result = module if result is None else result  # not `or`: a compiled module has no truth value
        self.parameter_map.record(before, dict(result.named_parameters(remove_duplicate=False)))
        return result

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point `optimizer` at the parameters `setup_module` left in the model (in place)."""
        self.parameter_map.follow(optimizer)

    def setup_module_and_optimizers(
        self,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        micro_batch_size: int | None,
        gradient_accumulation_steps: int,
    ) -> torch.nn.Module:
        """Wrap a model together with the optimizers over its parameters, in place for the optimizers.

        `micro_batch_size` (per process, None when no dataloader was prepared) and
        `gradient_accumulation_steps` are for a backend that builds one engine of all of them (DeepSpeed);
        by default this is `setup_module`, then `setup_optimizer` for each optimizer.
        """
        module = self.setup_module(module)
        for optimizer in optimizers:
            self.setup_optimizer(optimizer)
        return module

    def prepared_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        """The optimizer `prepare` wraps for `optimizer`, after `setup_module_and_optimizers`: itself. (A
        `DummyOptim` stands for one a DeepSpeed config declares: refused here.)"""
        if isinstance(optimizer, DummyOptim):
            raise ValueError(
                f"DummyOptim stands for the optimizer a DeepSpeed config declares; this Accelerator runs "
                f"{type(self).__name__}. Prepare a torch optimizer, or give a DeepSpeedPlugin."
            )
        return optimizer

    def prepared_scheduler(self, scheduler: Any) -> Any:
        """The schedule `prepare` wraps for `scheduler`: itself (a `DummyScheduler`: refused here)."""
        if isinstance(scheduler, DummyScheduler):
            raise ValueError(
                f"DummyScheduler stands for the schedule a DeepSpeed config declares; this Accelerator runs "
                f"{type(self).__name__}. Prepare a torch scheduler, or give a DeepSpeedPlugin."
            )
        return scheduler

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's complete weights (a collective for sharding backends; the main process's count)."""
        return self.unwrap_module(module).state_dict()

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Return the user's model from what `setup_module` made of it."""
        return module

    def no_sync(self, module: torch.nn.Module) -> AbstractContextManager:
        """Skip gradient synchronisation inside this context (gradient accumulation)."""
        return NOTHING

    def trigger_sync_in_backward(self, module: torch.nn.Module) -> AbstractContextManager:
        """Make the next backward synchronise gradients, even after forwards under `no_sync` (nothing to do
        where gradients are not synchronised by the wrapper)."""
        return NOTHING

    def join(self, joinables: list[Any]) -> AbstractContextManager:
        """In a job of several processes: let those that run out of batches early shadow the collectives
        of the others (`torch.distributed.algorithms.Join`)."""
        raise ConfigError(
            f"join_uneven_inputs: {type(self).__name__} (DistributedType.{self.distributed_type.value}) "
            "cannot let ranks run different numbers of steps (DDP can, through torch's Join). Keep "
            "even_batches=True so that every rank gets as many batches."
        )

    def check_training(self, task: Any, batch_size: int, sample: Any = None) -> None:
        """Before launch: ConfigError for what this backend cannot train with `task` on batches of
        `batch_size` rows per data-parallel rank, of samples like `sample` (the training set's first;
        None where none is known)."""

    def check_batches(self, batch_size: int, gradient_accumulation_steps: int, world_size: int) -> None:
        """Before launch: ConfigError where this backend's own config contradicts the run's batches
        (`batch_size` rows per process, accumulated over `gradient_accumulation_steps`, `world_size` ranks)."""

    def training_loss(
        self,
        module: torch.nn.Module,
        batch: Any,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        scale: float = 1.0,
        sync_gradients: bool = True,
    ) -> torch.Tensor:
        """`loss_fn(outputs, batch)` of the model's outputs for `batch`, to backpropagate next (`scale` and
        `sync_gradients` are for a backend that runs the backward here: pipeline parallel)."""
        return loss_fn(model_outputs(module, batch), batch)

    def backward(
        self,
        loss: torch.Tensor,
        precision: Precision,
        sync_gradients: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """Backpropagate `loss` (already divided by the accumulation steps); `sync_gradients` is False on
        the micro-steps of an accumulation; `options`: `Tensor.backward`'s keyword arguments."""
        precision.backward(loss, options)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, precision: Precision, closure: Any = None
    ) -> bool:
        """Step `optimizer` (at a synchronisation step); return False when the step was skipped."""
        return precision.optimizer_step(optimizer, closure)

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    def gradients_finite(self, parameters: Iterable[torch.Tensor]) -> bool:
        """Whether the gradients of `parameters` are all finite, alike on every rank: their total norm,
        which `clip_grad_norm_` measures over every rank that holds a part of them (a norm that no
        clipping changes; it waits for the device)."""
        return bool(torch.isfinite(self.clip_grad_norm_(parameters, math.inf)).item())

    def device_batches(
        self, batches: Iterator[Any], device: torch.device, non_blocking: bool = False
    ) -> Iterator[Any]:
        """The batches of a prepared dataloader on `device` (a backend may also lay them out there)."""
        return on_device(batches, device, non_blocking)

    def teardown(self) -> None:
        """Release what `setup_environment` acquired."""
