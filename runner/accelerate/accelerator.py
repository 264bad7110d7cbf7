"""`Accelerator`: Hugging Face Accelerate's public API, adapted onto runner's `Engine`.

The constructor maps Accelerate's arguments (mixed-precision names, plugins, kwargs handlers, what
`accelerate launch` set in the environment) onto the engine's; the methods here are the Accelerate
names the engine does not need for runner's own loop. The engine answers the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

import runner.engine.collectives as collectives
from runner.accelerate.handlers import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DeepSpeedSettings,
    DistributedDataParallelKwargs,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    TorchDynamoPlugin,
    apply_handlers,
)
from runner.accelerate.launch import AccelerateLaunchSettings, accelerate_launch_settings
from runner.accelerate.logging import get_logger
from runner.accelerate.parallelism_config import ParallelismConfig
from runner.checkpoint.checkpointer import ProjectConfiguration
from runner.checkpoint.weights import save_object
from runner.cluster import launched_environment
from runner.config import ActivationCheckpointingConfig, CheckpointingMode, CompileConfig
from runner.engine import Engine
from runner.hardware import DDP, FSDP, DeepSpeed, Strategy, TensorParallel, default_strategy
from runner.precision import Precision
from runner.precision import from_name as precision_from_name
from runner.state import DistributedType, ProcessState
from runner.trackers import BlankTracker, LoggerType, Tracker, trackers_from_name

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AcceleratorState(ProcessState):
    """`accelerator.state`: the process's place in its job, and the `DeepSpeedPlugin` the strategy was built
    from (scripts read `accelerator.state.deepspeed_plugin.deepspeed_config`)."""

    deepspeed_plugin: DeepSpeedPlugin | None = None

    @classmethod
    def of(cls, state: ProcessState, deepspeed_plugin: DeepSpeedPlugin | None) -> AcceleratorState:
        """`state` with the plugin."""
        place = {f.name: getattr(state, f.name) for f in dataclasses.fields(ProcessState)}
        return cls(**place, deepspeed_plugin=deepspeed_plugin)


_process_log = get_logger(__name__)  # Accelerate's warning_once


_NO_MEGATRON_LM = (
    "megatron_lm_plugin is not supported: Accelerate's Megatron-LM integration replaces the model with "
    "Megatron-LM's own implementation, runs the whole training step inside its forward and schedules the "
    "learning rate itself; runner has no Megatron-LM. Its tensor and pipeline parallel take the same "
    "layout: strategy=runner.hardware.TensorParallel(tp_size=..., pp_size=..., microbatches=..., "
    "sequence_parallel=...), or parallelism_config=ParallelismConfig(tp_size=...)."
)


class Accelerator(Engine):
    """Prepares models, optimizers, dataloaders and schedulers, and runs the training step around them.

    Args:
        mixed_precision: "no", "fp16", "bf16", "fp8", or a `Precision` plugin (what `conf/precision`
            builds); None: `$ACCELERATE_MIXED_PRECISION`, else "no".

        What `accelerate launch` sets is applied where the script leaves the default: ACCELERATE_USE_CPU,
        _MIXED_PRECISION, _GRADIENT_ACCUMULATION_STEPS, _DYNAMO_BACKEND (with _MODE, _USE_FULLGRAPH,
        _USE_DYNAMIC, _USE_REGIONAL_COMPILATION: a `TorchDynamoPlugin`), ACCELERATE_USE_FSDP with the FSDP_* variables (an
        `FullyShardedDataParallelPlugin`), ACCELERATE_USE_DEEPSPEED with the ACCELERATE_DEEPSPEED_*
        variables (a `DeepSpeedPlugin`). ACCELERATE_USE_MEGATRON_LM and _DEBUG_MODE are refused
        (ValueError) rather than run as plain data parallel.
        gradient_accumulation_steps: micro-batches per optimizer step, driven by `accumulate()`.
        device_placement: move prepared models and batches to `device`.
        cpu: force the CPU when no `strategy` is given.
        step_scheduler_with_optimizer: step prepared schedulers only on real optimizer steps.
        rng_types: RNGs that processes synchronise (from process 0) before each pass over a prepared
            dataloader: "generator" (the sampler's), "torch", "cuda". Default ["generator"].
        split_batches: the dataloader's batch size is the global one, split across processes.
        even_batches: pad the last batches so that every process gets the same number of batches.
        dataloader_config: `DataLoaderConfiguration` (split_batches, even_batches, data_seed,
            non_blocking, ...); its values win over the two arguments above.
        gradient_accumulation_plugin: `GradientAccumulationPlugin` (num_steps, adjust_scheduler,
            sync_with_dataloader, sync_each_batch); refused together with gradient_accumulation_steps.
        kwargs_handlers: Accelerate's handlers (`runner.utils.DistributedDataParallelKwargs`,
            `InitProcessGroupKwargs`, `GradScalerKwargs`, `AutocastKwargs`, `ProfileKwargs`): each goes to
            what it configures (the strategy, the precision, `profile()`); one of each kind.
        strategy: the hardware backend (what `conf/hardware` builds); default DDP when a launcher started
            several ranks (torchrun, srun), else one process on CUDA when available, else the CPU.
        fsdp_plugin: Accelerate's `FullyShardedDataParallelPlugin`: runner's `FSDP` strategy with its
            settings (`runner.accelerate.handlers.FullyShardedDataParallelPlugin` says how each maps).
        deepspeed_plugin: Accelerate's `DeepSpeedPlugin`: runner's `DeepSpeed` strategy with the config it
            describes; a gradient accumulation that config fixes is the Accelerator's, and without a
            `mixed_precision` its bf16/fp16 block gives it.
        parallelism_config: Accelerate's `ParallelismConfig`: replicas, shards, context- and
            tensor-parallel ranks, whose product is the world size (all 1: the ranks replicate); DDP,
            FSDP/HSDP or `TensorParallel` over that mesh (`torch_device_mesh`), with context parallel
            (`maybe_context_parallel`) for `cp_size` above 1.
        project_dir: shorthand for `ProjectConfiguration(project_dir=...)`.
        project_config: where `save_state()` without a directory writes, and how it names checkpoints.
        log_with: trackers that `init_trackers` starts and `log` writes to, on the main process (unless
            a tracker says `main_process_only = False`): "mlflow", "tensorboard", "all" (those installed),
            `LoggerType` members, or tracker objects (`MLflowTracker(...)`, a `GeneralTracker` subclass).
        logging_dir: where trackers keep local files (TensorBoard's events); None: `project_dir`.
        compile: `torch.compile` of prepared models (`CompileConfig`: the whole model or each block),
            applied by the strategy before it wraps the model; None: `dynamo_plugin`'s, else eager.
        dynamo_backend, dynamo_plugin: Accelerate's way to ask for `compile`: a backend name ("inductor",
            `DynamoBackend.INDUCTOR`), or a `TorchDynamoPlugin` (backend, mode, fullgraph, dynamic,
            options, use_regional_compilation); one of the three.
        megatron_lm_plugin: refused (ValueError, saying why): Accelerate's Megatron-LM integration swaps
            the model for Megatron-LM's own; runner's tensor and pipeline parallel is `TensorParallel`.
        activation_checkpointing: recompute each block's activations in backward
            (`ActivationCheckpointingConfig`), applied like `compile`; None: keep them.
    """

    def __init__(
        self,
        mixed_precision: str | Precision | None = None,
        gradient_accumulation_steps: int = 1,
        device_placement: bool = True,
        cpu: bool = False,
        step_scheduler_with_optimizer: bool = True,
        rng_types: list[str] | None = None,
        split_batches: bool = False,
        even_batches: bool = True,
        strategy: Strategy | None = None,
        project_dir: str | None = None,
        project_config: ProjectConfiguration | None = None,
        log_with: str | LoggerType | Tracker | list[str | LoggerType | Tracker] | None = None,
        compile: CompileConfig | None = None,
        activation_checkpointing: ActivationCheckpointingConfig | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        kwargs_handlers: list[KwargsHandler] | None = None,
        logging_dir: str | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        parallelism_config: ParallelismConfig | None = None,
        deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None = None,
        dynamo_backend: DynamoBackend | str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        megatron_lm_plugin: Any = None,
    ) -> None:
        if megatron_lm_plugin is not None:
            raise ValueError(_NO_MEGATRON_LM)
        strategy, deepspeed_plugin, mixed_precision, accumulation, activation_checkpointing = _backend(
            cpu,
            strategy,
            fsdp_plugin,
            deepspeed_plugin,
            parallelism_config,
            mixed_precision,
            gradient_accumulation_steps,
            gradient_accumulation_plugin,
            activation_checkpointing,
        )
        handlers = _one_of_each(kwargs_handlers or [])
        apply_handlers(handlers, strategy, mixed_precision)
        self.dataloader_config = dataloader_config or DataLoaderConfiguration(
            split_batches=split_batches, even_batches=even_batches
        )
        super().__init__(
            strategy,
            mixed_precision,
            accumulation=accumulation.accumulation(),
            loading=self.dataloader_config.loading(),
            project_config=project_config or ProjectConfiguration(project_dir, logging_dir),
            trackers=_trackers(log_with),
            compile=_compile_config(compile, dynamo_backend, dynamo_plugin),
            activation_checkpointing=activation_checkpointing,
            device_placement=device_placement,
            step_scheduler_with_optimizer=step_scheduler_with_optimizer,
            rng_types=rng_types,
        )
        self.profile_handler = next((h for h in handlers if isinstance(h, ProfileKwargs)), None)
        self.state = AcceleratorState.of(self.state, deepspeed_plugin)

    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None:
        """The `DeepSpeedPlugin` the DeepSpeed strategy was built from (None: none was given)."""
        return self.state.deepspeed_plugin

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def dispatch_batches(self) -> bool:
        """False: every process reads its own share (`DataLoaderConfiguration.dispatch_batches`)."""
        return bool(self.dataloader_config.dispatch_batches)

    @property
    def use_stateful_dataloader(self) -> bool:
        """Whether prepared dataloaders resume by themselves after `load_state` (as torchdata's
        StatefulDataLoader does under Accelerate); either way they have `state_dict`/`load_state_dict`."""
        return self.dataloader_config.use_stateful_dataloader

    @property
    def data_parallel_rank(self) -> int:
        """This process's replica, as Accelerate counts it: its rank in `dp_replicate` (0 where the
        model is only sharded); without a mesh (DDP, one process) its data-parallel rank. Which share of
        the data it reads is `state.data_parallel_index`."""
        if self.torch_device_mesh is None:
            return self.state.data_parallel_index
        return self._mesh_rank("dp_replicate")

    @property
    def torch_device_mesh(self) -> Any:
        """The strategy's DeviceMesh over the ranks (dims named "pp", "dp_replicate", "dp_shard", "cp",
        "tp"), built when the process joins, as Accelerate builds it; None for strategies without one (DDP)."""
        return getattr(self.strategy, "mesh", None)

    @property
    def parallelism_config(self) -> ParallelismConfig | None:
        """The layout as Accelerate's `ParallelismConfig`, for strategies with a mesh (None: DDP, one
        process)."""
        dims = getattr(self.strategy, "dims", None)
        if dims is None:
            return None
        resolved = dims.resolved(self.num_processes)
        return ParallelismConfig(
            dp_replicate_size=resolved.dp_replicate,
            dp_shard_size=resolved.dp_shard,
            tp_size=resolved.tp,
            cp_size=resolved.cp,
        )

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in its tensor-parallel group (0 without tensor parallel)."""
        return self._mesh_rank("tp")

    @property
    def context_parallel_rank(self) -> int:
        """This process's rank in its context-parallel group (0 without context parallel): which head-tail
        share of each sequence `maybe_context_parallel` gives it."""
        return self._mesh_rank("cp")

    @property
    def data_parallel_shard_rank(self) -> int:
        """This process's rank among the ranks that shard the model (FSDP's dp_shard; 0 without)."""
        return self._mesh_rank("dp_shard")

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        """Whether the strategy composes parallelisms on a mesh (FSDP2, as under Accelerate)."""
        return self.is_fsdp2

    def _mesh_rank(self, name: str) -> int:
        mesh = self.torch_device_mesh
        if mesh is None:
            raise RuntimeError(
                f"{name}: this strategy lays out no mesh; set parallelism_config=ParallelismConfig(...) (or an FSDP "
                "plugin) first."
            )
        return mesh.get_local_rank(name) if name in (mesh.mesh_dim_names or ()) else 0

    @property
    def is_fsdp2(self) -> bool:
        """Whether models are sharded with FSDP (runner's FSDP is torch's FSDP2, `fully_shard`)."""
        return self.distributed_type is DistributedType.FSDP

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model files in `save_model` (the main process)."""
        return self.is_main_process

    @property
    def step(self) -> int:
        """Accelerate's `step`: micro-batches since the accumulation's last reset (the engine's `micro_step`)."""
        return self.micro_step

    @step.setter
    def step(self, value: int) -> None:
        self.micro_step = value

    def verify_device_map(self, model: torch.nn.Module) -> bool:
        """Whether `model` (or a module in it) was dispatched over several devices with a device map
        (big model inference: such a model is for inference, not for training with `prepare`)."""
        return any(len(set(getattr(m, "hf_device_map", {}).values())) > 1 for m in model.modules())

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> AbstractContextManager:
        """The precision's autocast context (prepared models already run their forward in it);
        `autocast_handler` overrides the `AutocastKwargs` given to the Accelerator."""
        return self.precision.autocast(autocast_handler.settings() if autocast_handler else None)

    def trigger_sync_in_backward(self, model: torch.nn.Module) -> AbstractContextManager:
        """Synchronise gradients in the next backward, after forwards run under `no_sync`."""
        return self.strategy.trigger_sync_in_backward(model)

    @contextmanager
    def maybe_context_parallel(
        self,
        buffers: list[torch.Tensor] | None = None,
        buffer_seq_dims: list[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Train the body on this rank's share of each sequence (context parallel, `ParallelismConfig(
        cp_size=...)`), as under Accelerate: `buffers` (inputs, labels, position ids: whatever has the
        sequence dimension `buffer_seq_dims`) are cut in place to this rank's share, and those not in
        `no_restore_buffers` are whole again after the body. Each rank's loss is its share's; FSDP
        averages the gradients over the cp group, and `torch_device_mesh["dp_cp"]` is the group to
        average the loss value over. Without context parallel: a warning, and the buffers stay whole."""
        share = getattr(self.strategy, "context_parallel", None)
        if share is None:
            _process_log.warning_once(
                "Context parallel training is not enabled: maybe_context_parallel has no effect. Enable it with "
                "parallelism_config=ParallelismConfig(cp_size=...) and an FSDP2 plugin."
            )
            yield
            return
        with share.cut_in_place(list(buffers or []), list(buffer_seq_dims or []), no_restore_buffers):
            yield

    @contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Train on dataloaders that give processes different numbers of batches: processes that finish
        first shadow the others' collectives (DDP's `Join`). `even_batches` overrides the prepared
        dataloaders' inside."""
        with ExitStack() as stack:
            if even_batches is not None:
                for loader in self.checkpointer.of_kind("dataloader"):
                    stack.enter_context(loader.even_batches_set_to(even_batches))
            if self.use_distributed:
                stack.enter_context(self.strategy.join(joinables))
            yield

    @contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[torch.profiler.profile]:
        """`torch.profiler` over the body, with `profile_handler`'s (else the Accelerator's `ProfileKwargs`)
        settings; with `output_trace_dir`, each process writes its Chrome trace `profile_<i>.json` there."""
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is not None:
            Path(handler.output_trace_dir).mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(
                str(Path(handler.output_trace_dir) / f"profile_{self.process_index}.json")
            )
            self.wait_for_everyone()

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Unscale, then clamp every gradient element to [-clip_value, clip_value]."""
        self.unscale_gradients()
        self.strategy.clip_grad_value_(parameters, clip_value)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False
    ) -> Any:
        """Pad tensors along `dim` to the largest size any process has, so that they can be gathered."""
        return collectives.pad_across_processes(self.strategy, tensor, dim, pad_index, pad_first)

    def broadcast(self, tensor: Any, from_process: int = 0) -> Any:
        """Overwrite tensors (nested structures too) with process `from_process`'s, in place."""
        return collectives.broadcast(self.strategy, tensor, from_process)

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def checkpoint_in_progress(self) -> bool:
        """Whether a checkpoint of `save_state(blocking=False)` is still being written."""
        return self.checkpointer.in_progress

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, weights, output_dir)` at the start of every `save_state`: `models` the
        unwrapped prepared models, `weights` their state dicts, `output_dir` the checkpoint's directory
        being written. A model whose state dict the hook removes from `weights` is not saved by
        `save_state` (the hook saves it its own way: `save_pretrained`)."""
        return self.checkpointer.add_save_hook(hook)

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call `hook(models, input_dir)` at the start of every `load_state`: a model the hook removes
        from `models` is not loaded by `load_state` (the hook loads it its own way)."""
        return self.checkpointer.add_load_hook(hook)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Write `obj` to `f` once (from the main process), through a temporary file renamed into place:
        `torch.save`, or safetensors for a dict of tensors with `safe_serialization`."""
        if self.is_main_process:
            save_object(obj, Path(f), safe_serialization)
        self.wait_for_everyone()

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The started tracker called `name` (its client object with `unwrap`); a tracker whose calls do
        nothing on processes that run none."""
        if not self.trackers:
            return BlankTracker()
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(
            f"{name!r} is not a tracker of this Accelerator; it has {[t.name for t in self.trackers]}."
        )


def _trackers(
    log_with: str | LoggerType | Tracker | list[str | LoggerType | Tracker] | None,
) -> list[Tracker]:
    """The trackers `log_with` names or gives."""
    entries = log_with if isinstance(log_with, list) else [] if log_with is None else [log_with]
    return [t for e in entries for t in (trackers_from_name(e) if isinstance(e, str) else [e])]


def _backend(
    cpu: bool,
    strategy: Strategy | None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None,
    parallelism_config: ParallelismConfig | None,
    mixed_precision: str | Precision | None,
    accumulation_steps: int,
    accumulation_plugin: GradientAccumulationPlugin | None,
    activation_checkpointing: ActivationCheckpointingConfig | None,
) -> tuple[
    Strategy,
    DeepSpeedPlugin | None,
    Precision,
    GradientAccumulationPlugin,
    ActivationCheckpointingConfig | None,
]:
    """The strategy, DeepSpeed plugin, precision, accumulation and activation checkpointing the
    Accelerator's arguments (and `accelerate launch`'s settings where they are unset) describe: a
    DeepSpeed plugin's config fixes the accumulation and, unless given, the precision; an FSDP plugin's
    `activation_checkpointing` checkpoints every block."""
    launch = accelerate_launch_settings()  # what `accelerate launch` set, where the script did not
    cpu = cpu or launch.cpu
    fsdp_plugin, deepspeed_plugin, parallelism_config = _backend_given(
        launch, strategy, fsdp_plugin, deepspeed_plugin, parallelism_config
    )
    deepspeed_plugin = DeepSpeedPlugin.one(deepspeed_plugin)
    if deepspeed_plugin is not None:
        deepspeed = deepspeed_plugin.settings()
        strategy = _deepspeed_strategy(deepspeed, cpu)
        accumulation_steps = _deepspeed_accumulation(deepspeed, accumulation_steps)
        if mixed_precision is None and launch.mixed_precision is None:
            mixed_precision = deepspeed.mixed_precision
    strategy = strategy or _plugin_strategy(fsdp_plugin, parallelism_config, cpu) or default_strategy(cpu)
    if activation_checkpointing is None and fsdp_plugin and fsdp_plugin.settings().activation_checkpointing:
        activation_checkpointing = ActivationCheckpointingConfig(mode=CheckpointingMode.full)
    if not isinstance(mixed_precision, Precision):
        mixed_precision = precision_from_name(mixed_precision or launch.mixed_precision)
    if accumulation_plugin is None and accumulation_steps == 1:
        accumulation_steps = launch.gradient_accumulation_steps or 1
    accumulation = _accumulation_plugin(accumulation_steps, accumulation_plugin)
    return strategy, deepspeed_plugin, mixed_precision, accumulation, activation_checkpointing


def _backend_given(
    launch: AccelerateLaunchSettings,
    strategy: Strategy | None,
    fsdp: FullyShardedDataParallelPlugin | None,
    deepspeed: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None,
    layout: ParallelismConfig | None,
) -> tuple[
    FullyShardedDataParallelPlugin | None,
    DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None,
    ParallelismConfig | None,
]:
    """The FSDP plugin, DeepSpeed plugin and layout the Accelerator was given, with what `accelerate
    launch` set where the script set none; ValueError when more than one backend is given."""
    if strategy is None and fsdp is None and deepspeed is None:
        if launch.fsdp is not None:
            fsdp = FullyShardedDataParallelPlugin.from_launch(launch.fsdp)
        elif launch.deepspeed:
            deepspeed = DeepSpeedPlugin()  # from the ACCELERATE_DEEPSPEED_* variables
    if strategy is None and deepspeed is None and layout is None and launch.parallelism_config:
        layout = ParallelismConfig()  # from the PARALLELISM_CONFIG_* variables
    arguments = {"strategy": strategy, "fsdp_plugin": fsdp, "deepspeed_plugin": deepspeed}
    given = [name for name, value in arguments.items() if value]
    if len(given) > 1 or (layout and {"strategy", "deepspeed_plugin"} & set(given)):
        raise ValueError(
            f"Give the backend once: strategy=..., Accelerate's fsdp_plugin / parallelism_config, or its "
            f"deepspeed_plugin (`accelerate launch --use_fsdp / --use_deepspeed` gives a plugin), not "
            f"{' and '.join(given + ['parallelism_config'] * bool(layout))}."
        )
    return fsdp, deepspeed, layout


def _plugin_strategy(
    fsdp: FullyShardedDataParallelPlugin | None, layout: ParallelismConfig | None, cpu: bool
) -> Strategy | None:
    """The strategy that Accelerate's FSDP plugin and `ParallelismConfig` describe (None: neither given):
    tensor parallel when `tp_size` > 1 (FSDP over the data-parallel ranks), FSDP/HSDP with a plugin or
    `dp_shard_size` > 1, else DDP over the replicas; `cp_size` > 1 (with an FSDP2 plugin, as Accelerate
    requires) adds the strategy's context parallel."""
    if fsdp is None and layout is None:
        return None
    env = launched_environment()
    world, local = (env.world_size, env.local_world_size) if env is not None else (1, 1)
    settings = (fsdp or FullyShardedDataParallelPlugin()).settings()
    cp = 1
    if layout is not None:
        if layout.total_size == 1:  # as under Accelerate: no layout given, the ranks replicate
            layout = dataclasses.replace(layout, dp_replicate_size=world)
        if layout.total_size != world:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={layout.dp_replicate_size}, dp_shard_size={layout.dp_shard_size}, "
                f"cp_size={layout.cp_size}, tp_size={layout.tp_size}) lays out {layout.total_size} process(es), but "
                f"this job has {world}. Make their product {world}."
            )
        if layout.cp_enabled and (fsdp is None or fsdp.fsdp_version != 2):
            raise ValueError(
                f"ParallelismConfig(cp_size={layout.cp_size}) needs an FSDP2 plugin, as under Accelerate: context "
                "parallel ranks also shard the model (over dp_shard x cp). Pass "
                "fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...) to the Accelerator (or launch "
                "with `accelerate launch --use_fsdp --fsdp_version 2`)."
            )
        replicate, shard, tp = layout.dp_replicate_size, layout.dp_shard_size, layout.tp_size
        cp = layout.cp_size
    else:
        tp = 1
        replicate, shard = {"shard": (1, world), "replicate": (world, 1), "hybrid": (world // local, local)}[
            settings.layout
        ]
    common: dict[str, Any] = {"num_processes": local, "device": "cpu" if cpu else None}
    if tp > 1:
        return TensorParallel(
            tp_size=tp,
            shard_modules=settings.shard_modules,
            reshard_after_forward=settings.reshard_after_forward,
            dp_replicate=replicate,
            dp_shard=shard,
            cp_size=cp,
            **common,
        )
    if fsdp is None and shard == 1 and cp == 1:
        return DDP(**common)
    return FSDP(
        shard_modules=settings.shard_modules,
        reshard_after_forward=settings.reshard_after_forward,
        cpu_offload=settings.cpu_offload,
        dp_replicate=replicate,
        dp_shard=shard,
        cp_size=cp,
        **common,
    )


def _deepspeed_strategy(settings: DeepSpeedSettings, cpu: bool) -> DeepSpeed:
    """runner's `DeepSpeed` strategy as a `DeepSpeedPlugin` describes it, with the optimizer and schedule
    its config declares (`DummyOptim`, `DummyScheduler`)."""
    env = launched_environment()
    return DeepSpeed(
        zero_stage=settings.zero_stage,
        offload_optimizer=settings.offload_optimizer,
        offload_params=settings.offload_params,
        gradient_clipping=settings.gradient_clipping,
        config=settings.config,
        declared_optimizer=True,
        num_processes=env.local_world_size if env is not None else 1,
        device="cpu" if cpu else None,
    )


def _deepspeed_accumulation(settings: DeepSpeedSettings, steps: int) -> int:
    """The accumulation steps: the DeepSpeed config's when it fixes them (Accelerate warns and takes
    DeepSpeed's value), else the Accelerator's."""
    fixed = settings.gradient_accumulation_steps
    if fixed is None:
        return steps
    if steps not in (1, fixed):
        log.warning(
            "gradient_accumulation_steps=%d, but the DeepSpeed config has %s: using DeepSpeed's value.",
            steps,
            fixed,
        )
    return fixed


def _compile_config(
    compile: CompileConfig | None, backend: DynamoBackend | str | None, plugin: TorchDynamoPlugin | None
) -> CompileConfig | None:
    """The one description of compilation the arguments give: runner's `compile`, or Accelerate's
    `dynamo_backend` / `dynamo_plugin` (by default the `ACCELERATE_DYNAMO_*` variables' plugin)."""
    given = [
        name
        for name, value in (("compile", compile), ("dynamo_backend", backend), ("dynamo_plugin", plugin))
        if value
    ]
    if len(given) > 1:
        raise ValueError(f"Give the compilation once: {' or '.join(given)}, not both.")
    if compile is not None:
        return compile
    return (plugin or TorchDynamoPlugin(backend=backend)).compile_config()


def _accumulation_plugin(steps: int, plugin: GradientAccumulationPlugin | None) -> GradientAccumulationPlugin:
    """The one description of gradient accumulation that the arguments give (Accelerate refuses both)."""
    if steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps}.")
    if plugin is None:
        return GradientAccumulationPlugin(num_steps=steps)
    if steps != 1:
        raise ValueError(
            "Give gradient accumulation once: gradient_accumulation_steps or gradient_accumulation_plugin "
            f"(GradientAccumulationPlugin(num_steps={steps}, ...)), not both."
        )
    if plugin.num_steps is None or plugin.num_steps < 1:
        raise ValueError(f"GradientAccumulationPlugin.num_steps must be >= 1, got {plugin.num_steps}.")
    return plugin


def _one_of_each(handlers: list[KwargsHandler]) -> list[KwargsHandler]:
    """`handlers`, refused when one is no kwargs handler or when two are of one kind."""
    kinds = (
        DistributedDataParallelKwargs,
        InitProcessGroupKwargs,
        GradScalerKwargs,
        AutocastKwargs,
        ProfileKwargs,
    )
    for handler in handlers:
        if not isinstance(handler, kinds):
            raise ValueError(
                f"kwargs_handlers: {handler!r} is not one of {', '.join(k.__name__ for k in kinds)}."
            )
    names = [type(h).__name__ for h in handlers]
    if doubled := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"kwargs_handlers: give one {' and one '.join(doubled)}, not several.")
    return handlers
