"""`Engine`: runner's training engine over a hardware strategy and a precision plugin.

It prepares models, optimizers, dataloaders and schedulers, runs the training step around them
(accumulation, backward, clipping), the collectives over nested tensors, checkpoints (through its
`Checkpointer`) and the trackers. Every call is forwarded once to the injected `Strategy` (process
group, wrapping, collectives) or `Precision` (autocast, loss scaling); nothing here asks which backend
or precision is in use. The `Trainer` runs on it; the `Accelerator` of `runner.accelerate` adapts
Hugging Face Accelerate's public API onto it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import runner.engine.collectives as collectives
from runner.checkpoint.checkpointer import Checkpointer, ProjectConfiguration
from runner.checkpoint.weights import save_model_files, set_module_tensor
from runner.config import ActivationCheckpointingConfig, CompileConfig
from runner.engine.collectives import rng_generators
from runner.engine.data_loader import (
    DataLoaderShard,
    last_batch_remainder,
    order_generators,
    per_process_batch_size,
    shard_dataloader,
)
from runner.engine.prepared import AcceleratedOptimizer, AcceleratedScheduler
from runner.engine.process_control import ProcessControl, activate, deactivate
from runner.hardware import Strategy
from runner.hardware.base import NOTHING, DummyOptim, DummyScheduler
from runner.ops import apply_to_tensors, is_tensor_structure
from runner.precision import Precision
from runner.state import GradientState
from runner.trackers import Tracker

LRScheduler = torch.optim.lr_scheduler.LRScheduler


@dataclass(frozen=True)
class Accumulation:
    """Gradient accumulation: `steps` micro-batches make an optimizer step.

    adjust_scheduler: on a micro-step, count a scheduler step without taking it (`_step_count`, which
        bounds OneCycleLR).
    sync_with_dataloader: the last batch of a dataloader always completes an optimizer step.
    sync_each_batch: all-reduce the gradients of every micro-batch (less memory under FSDP; slower).
    """

    steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass(frozen=True)
class Loading:
    """How prepared dataloaders shard and deliver batches.

    split_batches: the loader's batch size is the global one, split across processes.
    even_batches: every process gets as many batches (the last ones completed from the start).
    seeded_sampler: one process alone shuffles from a generator of its own too (several always do: it is
        synchronised from process 0 before each pass).
    data_seed: seed of that generator (None: from the global seed).
    non_blocking: copy batches to the device asynchronously (from pinned memory, on CUDA).
    stateful: prepared loaders resume by themselves after a checkpoint is loaded, and the checkpoint
        records their position.
    """

    split_batches: bool = False
    even_batches: bool = True
    seeded_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    stateful: bool = False


def _is_model(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module)


def _is_new_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer | DummyOptim) and not isinstance(obj, AcceleratedOptimizer)


class MicroBatch:
    """`Engine.accumulate`'s context, a class rather than a generator: entered for every micro-batch,
    it costs what a plain loop's `with` costs (a generator-based one, ~1.4 us; an ExitStack, ~2.8 us)."""

    __slots__ = ("engine", "models", "skipping")

    def __init__(self, engine: Engine, models: tuple[torch.nn.Module, ...]) -> None:
        self.engine = engine
        self.models = models
        self.skipping: AbstractContextManager | None = None  # the models' no_sync, between syncs

    def __enter__(self) -> None:
        """Sync on every `num_steps`-th micro-batch and on the loader's last (an optimizer step, counted);
        skip syncing otherwise."""
        engine, state = self.engine, self.engine.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            engine.micro_step = 0
            state.sync_gradients = True
            engine.optimizer_step += 1
            return
        engine.micro_step += 1
        state.sync_gradients = engine.micro_step % state.num_steps == 0
        if state.sync_gradients:
            engine.optimizer_step += 1
            return
        if state.sync_each_batch or not self.models:
            return
        no_sync = engine.strategy.no_sync
        if len(self.models) == 1:
            skipping = no_sync(self.models[0])
            if skipping is not NOTHING:  # a backend that syncs no gradients has nothing to skip
                skipping.__enter__()
                self.skipping = skipping
            return
        with ExitStack() as stack:
            for model in self.models:
                stack.enter_context(no_sync(model))
            self.skipping = stack.pop_all()

    def __exit__(self, *exc_info: Any) -> bool | None:
        skipping, self.skipping = self.skipping, None
        return None if skipping is None else skipping.__exit__(*exc_info)


class Engine(ProcessControl):
    """Prepares models, optimizers, dataloaders and schedulers, and runs the training step around them.

    Args:
        strategy: the hardware backend (what `conf/hardware` builds).
        precision: the precision plugin (what `conf/precision` builds).
        accumulation: micro-batches per optimizer step and how they sync (driven by `accumulate()`);
            None: one.
        loading: how prepared dataloaders shard and deliver batches.
        project_config: where `save_state()` without a directory writes, and how it names checkpoints.
        trackers: what `init_trackers` starts and `log` writes to, on the main process (unless a tracker
            says `main_process_only = False`).
        compile: `torch.compile` of prepared models (`CompileConfig`: the whole model or each block),
            applied by the strategy before it wraps the model; None: eager.
        activation_checkpointing: recompute each block's activations in backward
            (`ActivationCheckpointingConfig`), applied like `compile`; None: keep them.
        device_placement: move prepared models and batches to `device`.
        step_scheduler_with_optimizer: step prepared schedulers only on real optimizer steps.
        rng_types: RNGs that processes synchronise (from process 0) before each pass over a prepared
            dataloader: "generator" (the sampler's), "torch", "cuda". Default ["generator"].
        skip_nonfinite_steps: prepared optimizers leave out a step whose gradients are NaN or infinite
            (`optimizer_step_was_skipped` tells; `trainer.on_nonfinite=skip`).
    """

    def __init__(
        self,
        strategy: Strategy,
        precision: Precision,
        accumulation: Accumulation | None = None,
        loading: Loading | None = None,
        project_config: ProjectConfiguration | None = None,
        trackers: list[Tracker] | None = None,
        compile: CompileConfig | None = None,
        activation_checkpointing: ActivationCheckpointingConfig | None = None,
        device_placement: bool = True,
        step_scheduler_with_optimizer: bool = True,
        rng_types: list[str] | None = None,
        skip_nonfinite_steps: bool = False,
    ) -> None:
        self.strategy = strategy
        self.skip_nonfinite_steps = skip_nonfinite_steps
        self.state = strategy.setup_environment()
        activate(strategy, self.state)
        self.precision = strategy.setup_precision(precision)
        self.precision.setup(self.state.device)
        strategy.setup_compute(
            compile or CompileConfig(), activation_checkpointing or ActivationCheckpointingConfig()
        )
        accumulation = accumulation or Accumulation()
        self.gradient_state = GradientState(
            num_steps=accumulation.steps,
            adjust_scheduler=accumulation.adjust_scheduler,
            sync_with_dataloader=accumulation.sync_with_dataloader,
            sync_each_batch=accumulation.sync_each_batch,
        )
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = ["generator"] if rng_types is None else list(rng_types)
        rng_generators(self.rng_types, self.device)  # a ValueError for an unknown one, now
        self.loading = loading or Loading()
        # Micro-batches since the last reset (Accelerate's `step`: the accumulation's phase; 0 again at the
        # end of a dataloader), and the optimizer steps `accumulate()` ended: what a checkpoint records.
        self.micro_step = 0
        self.optimizer_step = 0
        self._trigger = False
        self._micro_batch_size: int | None = None  # per process, of the first prepared dataloader
        self.project_configuration = project_config or ProjectConfiguration()
        # Owns what is prepared (models, optimizers, schedulers, dataloaders) and registered: save_state.
        self.checkpointer = Checkpointer(
            self.strategy, self.precision, self.state, self.project_configuration, self.split_batches
        )
        self.log_with: list[Tracker] = list(trackers or [])
        self.trackers: list[Tracker] = []

    @property
    def split_batches(self) -> bool:
        return self.loading.split_batches

    @property
    def even_batches(self) -> bool:
        return self.loading.even_batches

    @property
    def non_blocking(self) -> bool:
        return self.loading.non_blocking

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def mixed_precision(self) -> str:
        return self.precision.mixed_precision

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        """Micro-batches per optimizer step from now on (a script that picks it from the batch size it
        found, as Accelerate allows)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}.")
        self.gradient_state.num_steps = steps

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers, in any order; returned in that order.

        Dataloaders come first (a backend may size its engine by their batches), then the models with the
        optimizers of the same call (a sharding backend replaces the parameters those optimizers hold; a
        model and its optimizer may become one engine), schedulers last (they see the prepared
        optimizers). Other objects pass through.
        """
        placements = device_placement or [self.device_placement] * len(args)
        if len(placements) != len(args):
            raise ValueError("device_placement needs one entry per object passed to prepare().")
        result = list(args)
        for i, (obj, place) in enumerate(zip(args, placements, strict=True)):
            if isinstance(obj, DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=place)
        models = [i for i, obj in enumerate(args) if _is_model(obj)]
        optimizers = [i for i, obj in enumerate(args) if _is_new_optimizer(obj)]
        for n, i in enumerate(models):
            paired = optimizers if n == len(models) - 1 else []  # the optimizers go with the last model
            result[i] = self._prepare_model(args[i], [args[k] for k in paired], placements[i])
            for k in paired:
                result[k] = self._wrap_optimizer(self.strategy.prepared_optimizer(args[k]))
        if not models:
            for k in optimizers:
                result[k] = self.prepare_optimizer(args[k])
        for i, obj in enumerate(args):
            if isinstance(obj, LRScheduler | DummyScheduler):
                result[i] = self.prepare_scheduler(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None) -> torch.nn.Module:
        place = device_placement if device_placement is not None else self.device_placement
        return self._prepare_model(model, [], place)

    def _prepare_model(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], device_placement: bool
    ) -> torch.nn.Module:
        if device_placement:
            model = self.strategy.replace_parameters(model, lambda: self._place(model))
            for optimizer in optimizers:
                self.strategy.parameter_map.follow(optimizer)
        model = self.precision.setup_module(model)
        model = self.strategy.setup_module_and_optimizers(
            model,
            optimizers,
            micro_batch_size=self._micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )
        self.checkpointer.add("model", model)
        return model

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` on the device. Where that makes new parameter objects (XLA), tied weights are tied
        again (the strategy's `parameter_map` records the new ones, for the optimizers)."""
        before = dict(model.named_parameters(remove_duplicate=False))
        model = model.to(self.device)
        after = dict(model.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        for name, param in before.items():
            owner = first.setdefault(id(param), name)
            if after[name] is not after[owner]:  # a tie that the move broke
                set_module_tensor(model, name, after[owner])
        return model

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow; `skip_nonfinite_steps`)."""
        return any(opt.step_was_skipped for opt in self.checkpointer.of_kind("optimizer"))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        if isinstance(optimizer, AcceleratedOptimizer):
            return optimizer
        self.strategy.setup_optimizer(optimizer)
        return self._wrap_optimizer(self.strategy.prepared_optimizer(optimizer))

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        wrapped = AcceleratedOptimizer(
            optimizer, self.strategy, self.precision, self.gradient_state, self.skip_nonfinite_steps
        )
        self.checkpointer.add("optimizer", wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: LRScheduler | DummyScheduler) -> AcceleratedScheduler:
        wrapped = AcceleratedScheduler(
            self.strategy.prepared_scheduler(scheduler),
            self._optimizers_of(scheduler),
            self.gradient_state,
            num_processes=self.state.data_parallel_size,  # the processes that split the data
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        self.checkpointer.add("scheduler", wrapped)
        return wrapped

    def _optimizers_of(self, scheduler: Any) -> list[AcceleratedOptimizer]:
        """The prepared optimizer whose learning rate `scheduler` sets (Accelerate's match), else every
        optimizer prepared so far: a step they skipped is not taken by the scheduler either."""
        prepared = self.checkpointer.of_kind("optimizer")
        own = [opt for opt in prepared if opt.optimizer is getattr(scheduler, "optimizer", None)]
        return own or prepared

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None, checkpointed: bool = True
    ) -> DataLoaderShard:
        """This process's share of `data_loader`'s batches, placed on the device; its position saved with
        the checkpoints unless `checkpointed` is False (a loader of runner's own, outside the run's state)."""
        dataloader = data_loader
        place = device_placement if device_placement is not None else self.device_placement
        readers, reader = self.state.data_parallel_size, self.state.data_parallel_index
        config = self.loading
        seeded = readers > 1 or config.data_seed is not None or config.seeded_sampler
        generators, global_rng = order_generators(dataloader, seeded_sampler=seeded)
        if config.data_seed is not None:
            for generator in generators:
                generator.manual_seed(config.data_seed)
        shard = shard_dataloader(dataloader, readers, reader, self.split_batches, self.even_batches)
        remainder = last_batch_remainder(dataloader, readers, self.split_batches)
        batch_size = dataloader.batch_size or getattr(dataloader.batch_sampler, "batch_size", None)
        if self._micro_batch_size is None and batch_size:
            self._micro_batch_size = per_process_batch_size(batch_size, readers, self.split_batches)
        wrapped = DataLoaderShard(
            shard,
            self.gradient_state,
            device=self.device if place else None,
            remainder=remainder,
            synchronize_rng=(  # process 0's state of the RNGs `rng_types` names, before each pass
                partial(
                    collectives.synchronize_rng_states,
                    self.strategy,
                    rng_generators(self.rng_types, self.device, generators),
                )
                if self.use_distributed
                else None
            ),
            generators=generators,
            place=partial(self.strategy.device_batches, non_blocking=self.non_blocking),
            global_rng=global_rng,
            stateful=config.stateful,
        )
        if checkpointed:
            self.checkpointer.add("dataloader", wrapped)
        return wrapped

    def skip_first_batches(self, dataloader: DataLoaderShard, num_batches: int = 0) -> DataLoaderShard:
        """A prepared `dataloader` that skips its first `num_batches` batches (resume mid-epoch); use it
        for the first epoch only, as in Accelerate."""
        if not isinstance(dataloader, DataLoaderShard):
            dataloader = self.prepare_data_loader(dataloader)
        return dataloader.skip_first_batches(num_batches)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The user's model from a prepared one; `keep_fp32_wrapper=False` also removes the autocast
        forward. Runner compiles in place (`Module.compile`), so there is no compiled wrapper to keep or
        remove: `keep_torch_compile` is Accelerate's argument, with nothing to do."""
        model = self.strategy.unwrap_module(model)
        if not keep_fp32_wrapper and "_original_forward" in model.__dict__:  # precision's autocast forward
            model.forward = model.__dict__.pop("_original_forward")
        return model

    def training_loss(
        self, model: torch.nn.Module, batch: Any, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]
    ) -> torch.Tensor:
        """`loss_fn(outputs, batch)` of the model's outputs on `batch` (`runner.task.model_outputs`), for
        `backward`. Under pipeline parallel (`hardware=tensor_parallel hardware.pp_size=N`) the model trains only
        so: the schedule runs forward and backward over microbatches here, the last stage computing
        `loss_fn` on each one's rows, and every rank gets their mean (`backward` has nothing left to do)."""
        state = self.gradient_state
        return self.strategy.training_loss(model, batch, loss_fn, 1.0 / state.num_steps, state.sync_gradients)

    def loss_of_batch(
        self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> Callable[[Any], torch.Tensor]:
        """The training loop's `training_loss(model, batch, loss_fn)` of a batch, `loss_fn` compiled with
        the model's settings (`trainer.compile.loss`). It takes the model's outputs in the compute dtype and
        upcasts them itself (precision's `upcast_outputs`): the same values, and compiled, the upcast fuses
        into the loss instead of writing out the fp32 logits (8% of GPT-124M's step at batch 32 on an H100)."""
        loss_fn = self.strategy.compile_loss(self.precision.upcast_outputs(loss_fn))

        def loss_of(batch: Any) -> torch.Tensor:
            return self.training_loss(model, batch, loss_fn)

        return self.precision.keeping_outputs(loss_of)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward(**kwargs)`, divided by the accumulation steps and scaled for fp16."""
        state = self.gradient_state
        if state.num_steps > 1:
            loss = loss / state.num_steps
        # `kwargs` go down as one dict: a call through `**kwargs` at each layer cost 0.6 us per micro-batch here
        self.strategy.backward(loss, self.precision, state.sync_gradients, kwargs)

    def accumulate(self, *models: torch.nn.Module) -> MicroBatch:
        """One micro-batch: sets `sync_gradients` and skips gradient sync on the models in between."""
        return MicroBatch(self, models)

    def no_sync(self, model: torch.nn.Module) -> AbstractContextManager:
        """Gradients computed inside are not synchronised across processes."""
        return self.strategy.no_sync(model)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Undo fp16 loss scaling on the gradients (called by the clip functions)."""
        optimizers = [optimizer] if optimizer is not None else self.checkpointer.of_kind("optimizer")
        for opt in optimizers:
            self.precision.unscale_(opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Unscale, then clip the total gradient norm; returns the norm before clipping."""
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def gather(self, tensor: Any) -> Any:
        """Concatenate tensors (nested structures too) from all processes along the first dimension."""
        return collectives.gather(self.strategy, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """`gather` (or `gather_object` for non-tensor data), minus the samples that even batches
        duplicated at the end of the dataloader being iterated."""
        if use_gather_object or not is_tensor_structure(input_data):
            data = self.gather_object(input_data)
        else:
            data = self.gather(input_data)
        loader = self.gradient_state.active_dataloaders[-1] if self.gradient_state.end_of_dataloader else None
        remainder = loader.remainder if loader is not None and loader.even_batches else 0
        if remainder > 0:
            data = (
                data[:remainder]
                if isinstance(data, list)
                else apply_to_tensors(lambda t: t[:remainder], data)
            )
        return data

    def gather_object(self, obj: Any) -> list[Any]:
        """Every process's picklable `obj`, in process order; lists and tuples are concatenated."""
        return collectives.gather_object(self.strategy, obj)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce tensors (nested structures too) across processes: "sum", "mean", "max", "min" ("none"
        returns them as they are), times `scale`."""
        return collectives.reduce(self.strategy, tensor, reduction, scale)

    def broadcast_object_list(self, object_list: list[Any], from_process: int = 0) -> list[Any]:
        """Replace the picklable objects of `object_list`, in place, by process `from_process`'s."""
        return collectives.broadcast_object_list(self.strategy, object_list, from_process)

    def set_trigger(self) -> None:
        """Raise this process's flag; the next `check_trigger` on every process sees it."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process when any process called `set_trigger` since the last check (which then
        clears it). A collective: call it on all processes."""
        raised = self._trigger
        if self.use_distributed:
            flag = torch.tensor(float(raised), device=self.device)
            raised = self.strategy.all_reduce(flag).item() > 0
        self._trigger = False
        return raised

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects with `save_state`/`load_state` (each needs `state_dict` and
        `load_state_dict`)."""
        self.checkpointer.register(*objects)

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, blocking: bool = True
    ) -> str:
        """Write a checkpoint of everything prepared and registered, atomically; return its directory.

        Models (safetensors), optimizers, schedulers, the loss scaler, dataloader positions, registered
        objects, the step counter and every process's RNG states. Without `output_dir`, automatic
        naming writes `<project_dir>/checkpoints/checkpoint_<iteration>`, marks it latest and keeps at
        most `total_limit`. A crash during the save leaves the previous checkpoint untouched.

        `blocking=False` (runner's; `trainer.async_checkpoint`): the state is copied into host memory
        here and written by a background thread (sharded checkpoints by DCP, over a process group of
        their own); the checkpoint becomes latest only once complete. The next save, `wait_for_checkpoint` and
        `end_training` wait for the write.
        """
        # Accelerate's rule: with automatic naming the checkpoint is the next numbered one, whatever the dir.
        if self.project_configuration.automatic_checkpoint_naming:
            target = None
        elif output_dir is None:
            raise ValueError(
                "save_state() needs a directory, or Accelerator(project_config=ProjectConfiguration("
                "project_dir=..., automatic_checkpoint_naming=True))."
            )
        else:
            target = Path(output_dir)
        saved = self.checkpointer.save(target, self.optimizer_step, blocking, self.micro_step)
        return str(saved)

    def load_state(self, input_dir: str | None = None) -> None:
        """Restore a checkpoint that `save_state` wrote (without `input_dir`: the latest one of the
        project), into the objects prepared and registered, in the same order. A sharded (DCP) checkpoint
        loads onto another number of ranks or another layout (fsdp 4 -> 2, fsdp -> tensor parallel):
        DCP reshards it."""
        steps = self.checkpointer.load(input_dir)
        self.micro_step = steps.micro
        self.optimizer_step = steps.optimizer or 0  # None: a checkpoint that did not record it

    def wait_for_checkpoint(self, everyone: bool = True) -> None:
        """Wait until the checkpoint that `save_state(blocking=False)` is writing is complete (and marked
        latest: with `everyone`, every process waits for the main process's commit); raise what failed in
        its writing."""
        self.checkpointer.wait(everyone)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the unwrapped model's weights to `save_directory` (from the main process): safetensors (or
        torch) files of at most `max_shard_size`, with an index when there are several."""
        state_dict = self.get_state_dict(model)
        if self.is_main_process:
            save_model_files(state_dict, save_directory, max_shard_size, safe_serialization)
        self.wait_for_everyone()

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict (unwrapped by default); with a sharding backend a collective whose
        result is complete on the main process."""
        return self.strategy.full_state_dict(model) if unwrap else model.state_dict()

    def init_trackers(
        self,
        project_name: str | None,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Start the `log_with` trackers on the main process (local files under `project_dir`) and record
        `config` as the run's parameters; `init_kwargs={"mlflow": {"tags": {...}}}` adds run tags.
        `project_name` None: each tracker's own (`tracker.experiment_name`, `tracker.project`)."""
        for tracker in self.log_with:
            if tracker.main_process_only and not self.is_main_process:
                continue
            logging_dir = self.logging_dir or self.project_dir
            tracker.open(project_name, logging_dir, (init_kwargs or {}).get(tracker.name, {}))
            if config is not None:
                tracker.store_init_configuration(config)
            self.trackers.append(tracker)

    def log(
        self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Record scalar `values` at `step` with every started tracker (nothing on other processes)."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop the references held to prepared objects, collect garbage, empty the device cache."""
        self.checkpointer.clear()
        self._micro_batch_size = None
        self.micro_step = self.optimizer_step = 0
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return [None] * len(objects)

    clear = free_memory

    def close_trackers(self, status: str) -> None:
        """Close the trackers' runs as `status` (FAILED, KILLED), once: a closed tracker is dropped."""
        for tracker in self.trackers:
            tracker.close(status)
        self.trackers.clear()

    def end_training(self) -> None:
        """Wait for a checkpoint being written, close the trackers' runs, then release the process group
        and the strategy's other resources."""
        self.wait_for_checkpoint()
        for tracker in self.trackers:
            tracker.close()
        self.trackers.clear()
        self.strategy.teardown()
        deactivate(self.strategy)
