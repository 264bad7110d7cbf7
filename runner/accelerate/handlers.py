"""Accelerate's configuration objects for `Accelerator(...)`: the kwargs handlers (`kwargs_handlers=[...]`),
`DataLoaderConfiguration`, `GradientAccumulationPlugin`, `TorchDynamoPlugin`,
`FullyShardedDataParallelPlugin` and `DeepSpeedPlugin`, with Accelerate's names, fields and defaults
(the layout of the ranks, `ParallelismConfig`, is in `runner.accelerate.parallelism_config`).

Each translates into the core's own options: a kwargs handler into the strategy's (`ProcessGroupOptions`,
`DDPOptions`) or the precision's (`Autocast`, loss scaling), `GradientAccumulationPlugin` and
`DataLoaderConfiguration` into the Engine's `Accumulation` and `Loading`; the profiler the Accelerator
runs itself."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from runner.accelerate.launch import env_flag
from runner.config import CompileConfig, CompileScope
from runner.engine import Accumulation, Loading
from runner.errors import ConfigError
from runner.hardware import Strategy
from runner.hardware.base import ProcessGroupOptions
from runner.hardware.deepspeed import config_node, fill_auto
from runner.hardware.parallelize import DDPCommunicationHookType, DDPOptions
from runner.precision import Autocast, Precision


class KwargsHandler:
    """A handler's `to_kwargs()`: the fields set to something other than their default (the only ones
    that are applied, as in Accelerate)."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != getattr(default, f.name)
        }

    def apply(self, strategy: Strategy, precision: Precision) -> None:
        """Hand these settings to what they configure (before the Engine sets either up): nothing here."""


def apply_handlers(handlers: list[KwargsHandler], strategy: Strategy, precision: Precision) -> None:
    """Apply each of `kwargs_handlers`; a ConfigError naming the handler where it configures nothing."""
    for handler in handlers:
        try:
            handler.apply(strategy, precision)
        except ConfigError:
            raise ConfigError(
                f"kwargs_handlers: {type(handler).__name__} configures what {type(strategy).__name__} "
                f"(DistributedType.{strategy.distributed_type.value}) does not use: remove it, or run the "
                "backend it is meant for."
            ) from None


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """DistributedDataParallel's arguments, and a communication hook (`comm_hook`, optionally wrapped by
    `comm_wrapper` to compress PowerSGD's output; `comm_state_option`: PowerSGDState's arguments)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    def apply(self, strategy: Strategy, precision: Precision) -> None:
        module = {k: v for k, v in self.to_kwargs().items() if not k.startswith("comm_")}
        hook = DDPOptions(module, self.comm_hook, self.comm_wrapper, dict(self.comm_state_option))
        strategy.use_ddp(hook)


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """`torch.distributed.init_process_group`'s backend, init_method and timeout (each applied only when
    set to something other than its default)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def apply(self, strategy: Strategy, precision: Precision) -> None:
        strategy.use_process_group(ProcessGroupOptions(**self.to_kwargs()))


@dataclass
class GradScalerKwargs(KwargsHandler):
    """`torch.amp.GradScaler`'s arguments for fp16 loss scaling."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def apply(self, strategy: Strategy, precision: Precision) -> None:
        precision.use_loss_scaling(**self.to_kwargs())


@dataclass
class AutocastKwargs(KwargsHandler):
    """`torch.autocast`'s `enabled` and `cache_enabled` for mixed precision."""

    enabled: bool = True
    cache_enabled: bool | None = None

    def settings(self) -> Autocast:
        return Autocast(self.enabled, self.cache_enabled)

    def apply(self, strategy: Strategy, precision: Precision) -> None:
        precision.use_autocast(self.settings())


@dataclass
class ProfileKwargs(KwargsHandler):
    """`torch.profiler.profile`'s arguments for `Accelerator.profile()`; with `output_trace_dir` each
    process writes its Chrome trace there (`profile_<i>.json`, as Accelerate names it)."""

    activities: list[str] | None = None  # "cpu", "cuda", "xpu"
    schedule_option: dict[str, int] | None = None  # torch.profiler.schedule's wait, warmup, active, ...
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> torch.profiler.profile:
        """The profiler these settings describe."""
        activities = None
        if self.activities is not None:
            known = {a.name.lower(): a for a in torch.profiler.ProfilerActivity.__members__.values()}
            unknown = [a for a in self.activities if a.lower() not in known]
            if unknown:
                raise ValueError(
                    f"ProfileKwargs.activities: unknown {unknown}; expected some of {sorted(known)}."
                )
            activities = [known[a.lower()] for a in self.activities]
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(**self.schedule_option) if self.schedule_option else None,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


@dataclass
class DataLoaderConfiguration:
    """How `prepare` shards dataloaders.

    split_batches: the loader's batch size is the global one, split across processes.
    even_batches: every process gets as many batches (the last ones completed from the start).
    dispatch_batches: process 0 reads every batch and sends the shares: not supported (each process reads
        its own share; True is refused).
    use_seedable_sampler: every process shuffles in the same order (runner's prepared loaders always do:
        their sampler's generator is synchronised from process 0 before each pass).
    data_seed: seed of the prepared loaders' shuffling generator (None: from the global seed).
    non_blocking: copy batches to the device asynchronously (from pinned memory, on CUDA).
    use_stateful_dataloader: prepared loaders resume by themselves after `load_state` (torchdata's
        StatefulDataLoader under Accelerate); a checkpoint then also records their position in its format
        (`dl_state_dict.bin`). runner's loaders have `state_dict()` either way.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def loading(self) -> Loading:
        """What the Engine takes of it."""
        return Loading(
            split_batches=self.split_batches,
            even_batches=self.even_batches,
            seeded_sampler=self.use_seedable_sampler,
            data_seed=self.data_seed,
            non_blocking=self.non_blocking,
            stateful=self.use_stateful_dataloader,
        )

    def __post_init__(self) -> None:
        if self.dispatch_batches:
            raise ValueError(
                "DataLoaderConfiguration(dispatch_batches=True) is not supported: each process reads its own "
                "share of the data. Leave dispatch_batches unset (an IterableDataset is sharded sample by "
                "sample)."
            )


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """Gradient accumulation.

    num_steps: micro-batches per optimizer step.
    adjust_scheduler: on a micro-step, count a scheduler step without taking it (`_step_count`, which
        bounds OneCycleLR) as Accelerate does.
    sync_with_dataloader: the last batch of a dataloader always completes an optimizer step.
    sync_each_batch: all-reduce the gradients of every micro-batch (less memory under FSDP; slower).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def accumulation(self) -> Accumulation:
        """What the Engine takes of it (`num_steps` checked by the Accelerator)."""
        return Accumulation(
            self.num_steps or 1, self.adjust_scheduler, self.sync_with_dataloader, self.sync_each_batch
        )


# FSDP1's sharding strategies (Accelerate's names and numbers): (reshard after forward, how ranks hold the model).
SHARDING_STRATEGIES = {
    "FULL_SHARD": (True, "shard"),
    "SHARD_GRAD_OP": (False, "shard"),
    "NO_SHARD": (True, "replicate"),
    "HYBRID_SHARD": (True, "hybrid"),
    "_HYBRID_SHARD_ZERO2": (False, "hybrid"),
}


class DynamoBackend(str, Enum):
    """Accelerate's names for torch.compile backends (`TorchDynamoPlugin.backend`, `dynamo_backend=`)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


@dataclass
class TorchDynamoPlugin:
    """Accelerate's torch.compile settings (`Accelerator(dynamo_plugin=...)`, `dynamo_backend=`, or
    `accelerate launch --dynamo_backend ...`), with its fields, defaults and environment variables: an
    unset field takes `ACCELERATE_DYNAMO_BACKEND` ("no"), `_MODE` ("default"), `_USE_FULLGRAPH`,
    `_USE_DYNAMIC` and `_USE_REGIONAL_COMPILATION`. runner compiles as `compile_config()` describes: in
    place before the backend wraps the model (Accelerate compiles the wrapped model; the computation is
    the same), `use_regional_compilation` as scope "regional" (each block compiled once, reused)."""

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        env = os.environ.get
        backend = str(getattr(self.backend, "value", self.backend or env("ACCELERATE_DYNAMO_BACKEND", "no")))
        try:
            self.backend = DynamoBackend(backend.strip().upper())
        except ValueError:
            raise ValueError(
                f"TorchDynamoPlugin(backend={backend!r}): expected one of {', '.join(b.value.lower() for b in DynamoBackend)}."
            ) from None
        if self.mode is None:
            self.mode = env("ACCELERATE_DYNAMO_MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = env_flag("ACCELERATE_DYNAMO_USE_FULLGRAPH")
        if self.dynamic is None and env("ACCELERATE_DYNAMO_USE_DYNAMIC") is not None:
            self.dynamic = env_flag("ACCELERATE_DYNAMO_USE_DYNAMIC")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = env_flag("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION")

    def compile_config(self) -> CompileConfig | None:
        """The compilation these settings describe; None: none (backend "no", or `disable`)."""
        if self.backend == DynamoBackend.NO or self.disable:
            return None
        return CompileConfig(
            scope=CompileScope.regional if self.use_regional_compilation else CompileScope.model,
            backend=DynamoBackend(self.backend).value.lower(),
            mode=None if self.mode in (None, "default") else self.mode,
            fullgraph=bool(self.fullgraph),
            dynamic=self.dynamic,
            options=self.options,
        )


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP settings (`Accelerator(fsdp_plugin=...)`), with its fields and defaults; runner
    runs them as its `FSDP` strategy, FSDP2's `fully_shard`, whichever `fsdp_version` (the arithmetic of
    FSDP1's flat parameters is the same). `FSDPSettings` is what they come to.

    Accelerate's meaning, mapped: `sharding_strategy` (FSDP1: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD,
    HYBRID_SHARD, _HYBRID_SHARD_ZERO2, or their numbers or enum) or `reshard_after_forward` (a bool, or one
    of those names); `auto_wrap_policy` "no_wrap" (the default: the root module is the one unit) or
    "transformer_based_wrap" (a unit per module of `transformer_cls_names_to_wrap`, else of the model's
    `_no_split_modules`); `cpu_offload` (a bool, or torch's CPUOffload/CPUOffloadPolicy);
    `activation_checkpointing` (each unit's activations recomputed in backward). FSDP1's tuning knobs that
    FSDP2 has no use for (`backward_prefetch`, `forward_prefetch`, `limit_all_gathers`, `use_orig_params`,
    `sync_module_states`, `state_dict_config`, `optim_state_dict_config`) do nothing, as under
    Accelerate's FSDP2; `state_dict_type` too: runner's `save_state` of a sharded model always writes
    DCP shards (any layout loads them), `save_model` the full weights; and `cpu_ram_efficient_loading`:
    every rank loads the same weights. Refused (ValueError, saying why): "size_based_wrap" or a callable
    policy, `mixed_precision_policy`, `ignored_modules`, `param_init_fn`,
    `activation_checkpointing_offload`.
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: bool | str | None = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: str | Callable | None = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Callable | None = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | str | None = None
    min_num_params: int | None = None

    def __post_init__(self) -> None:
        self.settings()  # refuses what has no meaning here, at construction as Accelerate's does

    @classmethod
    def from_launch(cls, variables: dict[str, str]) -> FullyShardedDataParallelPlugin:
        """The plugin an FSDP launch config describes (`accelerate launch` sets `ACCELERATE_USE_FSDP` and
        these `FSDP_*` variables, here without the prefix and lowercase), read as Accelerate reads them."""

        def flag(name: str) -> bool | None:
            value = variables.get(name)
            return None if value is None else value.strip().lower() in ("1", "true", "yes")

        version = int(variables.get("version", "1"))
        reshard = flag("reshard_after_forward") if version == 2 else variables.get("reshard_after_forward")
        return cls(
            fsdp_version=version,
            sharding_strategy=variables.get("sharding_strategy") if version == 1 else None,
            reshard_after_forward=reshard,
            cpu_offload=flag("offload_params"),
            auto_wrap_policy=variables.get("auto_wrap_policy"),
            transformer_cls_names_to_wrap=variables.get("transformer_cls_to_wrap"),
            activation_checkpointing=flag("activation_checkpointing"),
            activation_checkpointing_offload=flag("activation_checkpointing_offload"),
            min_num_params=int(variables["min_num_params"]) if variables.get("min_num_params") else None,
            state_dict_type=variables.get("state_dict_type"),
            cpu_ram_efficient_loading=flag("cpu_ram_efficient_loading"),
            sync_module_states=flag("sync_module_states"),
        )

    def settings(self) -> FSDPSettings:
        if self.fsdp_version not in (None, 1, 2):
            raise ValueError(
                f"FullyShardedDataParallelPlugin(fsdp_version={self.fsdp_version!r}): expected 1 or 2."
            )
        refused = {
            "mixed_precision_policy": "give the precision to the Accelerator (mixed_precision='bf16'): runner's "
            "FSDP gathers parameters in that dtype and reduces gradients in fp32",
            "ignored_modules": "runner's FSDP shards every parameter of the model",
            "param_init_fn": "FSDP2 shards modules that are already materialised (build on 'meta' and load with "
            "runner.load_checkpoint_in_model instead)",
            "activation_checkpointing_offload": "recomputed activations are not offloaded here",
        }
        for name, why in refused.items():
            if getattr(self, name):
                raise ValueError(f"FullyShardedDataParallelPlugin({name}=...) is not supported: {why}.")
        reshard, layout = _sharding(self.sharding_strategy, self.reshard_after_forward)
        return FSDPSettings(
            shard_modules=self._units(),
            reshard_after_forward=reshard,
            layout=layout,
            cpu_offload=_offloads(self.cpu_offload),
            activation_checkpointing=bool(self.activation_checkpointing),
        )

    def _units(self) -> list[str] | None:
        """The FSDP units' class names: [] the root only, None the model's `_no_split_modules`."""
        policy = self.auto_wrap_policy
        if policy is None or (isinstance(policy, str) and policy.upper() == "NO_WRAP"):
            return []
        if isinstance(policy, str) and policy.upper() == "TRANSFORMER_BASED_WRAP":
            names = self.transformer_cls_names_to_wrap
            return [n.strip() for n in names.split(",")] if isinstance(names, str) else names
        raise ValueError(
            f"FullyShardedDataParallelPlugin(auto_wrap_policy={policy!r}) is not supported: runner's FSDP units are "
            "module classes. Use auto_wrap_policy='transformer_based_wrap' with transformer_cls_names_to_wrap "
            "(default: the model's _no_split_modules), or 'no_wrap' for the root module alone."
        )


@dataclass(frozen=True)
class FSDPSettings:
    """What a `FullyShardedDataParallelPlugin` comes to: runner's `FSDP` arguments, and how the ranks hold
    the model ("shard": all ranks shard it; "replicate": each holds all of it, FSDP1's NO_SHARD; "hybrid":
    sharded within a node, replicated across nodes)."""

    shard_modules: list[str] | None
    reshard_after_forward: bool
    layout: str
    cpu_offload: bool
    activation_checkpointing: bool


def _offloads(cpu_offload: Any) -> bool:
    """`cpu_offload` as a bool: a bool, torch's FSDP1 `CPUOffload(offload_params=...)`, or FSDP2's
    `CPUOffloadPolicy` (its base `OffloadPolicy` offloads nothing)."""
    if cpu_offload is None or isinstance(cpu_offload, bool):
        return bool(cpu_offload)
    if hasattr(cpu_offload, "offload_params"):
        return bool(cpu_offload.offload_params)
    return type(cpu_offload).__name__ == "CPUOffloadPolicy"


def _sharding(strategy: Any, reshard_after_forward: bool | str | None) -> tuple[bool, str]:
    """(reshard after forward, layout) from FSDP1's `sharding_strategy` or `reshard_after_forward`."""
    if isinstance(reshard_after_forward, bool):
        if strategy is not None:
            raise ValueError(
                "FullyShardedDataParallelPlugin: give sharding_strategy (FSDP1's) or reshard_after_forward=True/False, "
                "not both."
            )
        return reshard_after_forward, "shard"
    named = strategy if strategy is not None else reshard_after_forward
    if named is None:
        return True, "shard"
    names = list(SHARDING_STRATEGIES)
    key = getattr(named, "name", named)  # torch's ShardingStrategy enum
    if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
        key = names[int(key) - 1] if 1 <= int(key) <= len(names) else str(key)
    key = str(key).upper()
    if key == "HYBRID_SHARD_ZERO2":
        key = "_HYBRID_SHARD_ZERO2"
    if key not in SHARDING_STRATEGIES:
        raise ValueError(
            f"FullyShardedDataParallelPlugin: sharding strategy {named!r} is not one of {', '.join(names)} (or 1-5)."
        )
    return SHARDING_STRATEGIES[key]


@dataclass
class DeepSpeedPlugin:
    """Accelerate's DeepSpeed settings (`Accelerator(deepspeed_plugin=...)`, or `accelerate launch
    --use_deepspeed`), with its fields, defaults and environment variables; runner runs them as its
    `DeepSpeed` strategy. `deepspeed_config` is the DeepSpeed config they describe, built as Accelerate
    builds it: from `hf_ds_config` (a JSON file or a dict; its "auto" values filled from the fields set),
    else from the fields, "auto" values left for the run (micro batch, accumulation, precision).

    As under Accelerate: an unset field takes `ACCELERATE_DEEPSPEED_ZERO_STAGE` (default 2),
    `_OFFLOAD_OPTIMIZER_DEVICE`, `_OFFLOAD_PARAM_DEVICE` ("none"), `_CONFIG_FILE`, `_ZERO3_INIT`,
    `_ZERO3_SAVE_16BIT_MODEL`, `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` and `ACCELERATE_GRADIENT_CLIPPING`
    ("auto"); gradient clipping left "auto" clips at 1.0 (DeepSpeed's default), and a
    `gradient_accumulation_steps` the config fixes is the Accelerator's. `zero3_init_flag`: runner builds
    the model whole and partitions it at `prepare` (the memory of construction differs, the weights a
    checkpoint loads do not). `is_train_batch_min`: the micro batch DeepSpeed accounts is the first
    prepared dataloader's (the loop, not the engine, feeds the batches). Refused (ValueError, saying why):
    `transformer_moe_cls_names` and `enable_msamp` (so `msamp_opt_level` has nothing to set).
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None
    deepspeed_config: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        refused = {
            "transformer_moe_cls_names": "ZeRO-3 leaf modules for mixture-of-experts layers are not set here",
            "enable_msamp": "runner has no MS-AMP backend (its fp8 is torchao's, which DeepSpeed's engine refuses)",
        }
        for name, why in refused.items():
            if getattr(self, name):
                raise ValueError(f"DeepSpeedPlugin({name}=...) is not supported: {why}.")
        self._fill_from_environment()
        if isinstance(self.hf_ds_config, dict) or self.hf_ds_config != "none":
            self.deepspeed_config = self._from_file()
        else:
            self.deepspeed_config = self._from_fields()
        self.deepspeed_config["steps_per_print"] = float("inf")  # runner logs progress itself
        zero3 = self.deepspeed_config["zero_optimization"].get("stage") == 3
        if self.zero3_init_flag is None:
            flag = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", str(zero3))
            self.zero3_init_flag = flag.lower() in ("1", "true", "yes")
        self.zero3_init_flag = self.zero3_init_flag and zero3

    def _fill_from_environment(self) -> None:
        """Each unset field from its `ACCELERATE_*` variable, else Accelerate's default."""
        env = os.environ.get
        if self.gradient_accumulation_steps is None:
            steps = env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
            self.gradient_accumulation_steps = int(steps) if steps.isdigit() else steps
        if self.gradient_clipping is None:
            clipping = env("ACCELERATE_GRADIENT_CLIPPING", "auto")
            self.gradient_clipping = clipping if clipping == "auto" else float(clipping)
        if self.zero_stage is None:
            self.zero_stage = int(env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        for name in (
            "offload_optimizer_device",
            "offload_param_device",
            "offload_optimizer_nvme_path",
            "offload_param_nvme_path",
        ):
            if getattr(self, name) is None:
                setattr(self, name, env(f"ACCELERATE_DEEPSPEED_{name.upper()}", "none"))
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = (
                env("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true"
            )
        if self.hf_ds_config is None:
            self.hf_ds_config = env("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")

    def _from_fields(self) -> dict[str, Any]:
        """The config the fields describe (Accelerate's, without a config file)."""

        def offload(device: str | None, path: str | None) -> dict[str, Any]:
            return {"device": device, "nvme_path": path if device == "nvme" else None}

        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": {
                "stage": self.zero_stage,
                "offload_optimizer": offload(self.offload_optimizer_device, self.offload_optimizer_nvme_path),
                "offload_param": offload(self.offload_param_device, self.offload_param_nvme_path),
                "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
            },
        }
        if self.gradient_clipping:
            config["gradient_clipping"] = self.gradient_clipping
        return config

    def _from_file(self) -> dict[str, Any]:
        """`hf_ds_config` (a dict, or a JSON file) with its "auto" values filled from the fields, and the
        fields read back from it where it sets them (Accelerate's order)."""
        if isinstance(self.hf_ds_config, dict):
            config = copy.deepcopy(self.hf_ds_config)
        else:
            try:
                config = json.loads(Path(self.hf_ds_config).read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(
                    f"DeepSpeedPlugin(hf_ds_config={self.hf_ds_config!r}): not a readable JSON file ({err})."
                ) from err
        if "zero_optimization" not in config:
            raise ValueError(
                "DeepSpeedPlugin(hf_ds_config=...): the config has no zero_optimization block; give one."
            )
        config.setdefault("gradient_accumulation_steps", 1)
        fill_auto(
            config,
            {
                key: getattr(self, name)
                for name, key in DEEPSPEED_FIELDS.items()
                if getattr(self, name) is not None
            },
        )
        for name, key in DEEPSPEED_FIELDS.items():
            node, leaf = config_node(config, key)
            value = None if node is None else node.get(leaf)
            if value is not None and value != "auto":
                setattr(self, name, value)
        return config

    def settings(self) -> DeepSpeedSettings:
        """What the plugin comes to in runner. Clipping left "auto" or unset clips at 1.0, DeepSpeed's
        default, as under Accelerate; 0: none. A parameter offload below stage 3 stays in the config, for
        DeepSpeed to ignore (as Accelerate lets it)."""
        config = copy.deepcopy(self.deepspeed_config)
        zero = config["zero_optimization"]
        clipping = config.pop("gradient_clipping", "auto")
        fixed = config.get("gradient_accumulation_steps", "auto")
        precision = next(
            (
                name
                for name in ("fp16", "bf16")
                if str((config.get(name) or {}).get("enabled")).lower() == "true"
            ),
            None,
        )
        return DeepSpeedSettings(
            zero_stage=zero.get("stage"),
            offload_optimizer=(zero.get("offload_optimizer") or {}).get("device") == "cpu",
            offload_params=(zero.get("offload_param") or {}).get("device") == "cpu"
            and zero.get("stage") == 3,
            gradient_clipping=(1.0 if clipping == "auto" else float(clipping)) or None,
            config=config,
            gradient_accumulation_steps=None if fixed == "auto" else int(fixed),
            mixed_precision=precision,
        )

    @staticmethod
    def one(plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None) -> DeepSpeedPlugin | None:
        """The one plugin given (Accelerate also takes a dict of several, one per model)."""
        if not isinstance(plugin, dict):
            return plugin
        if len(plugin) != 1:
            raise ValueError(
                f"deepspeed_plugin: {len(plugin)} plugins ({', '.join(plugin)}); runner's DeepSpeed strategy trains "
                "one model with one engine. Pass one DeepSpeedPlugin."
            )
        return next(iter(plugin.values()))


@dataclass
class DeepSpeedSettings:
    """What a `DeepSpeedPlugin` comes to: runner's `DeepSpeed` arguments (the config without the clipping,
    which is an argument of its own), the accumulation steps the config fixes (None: "auto", the
    Accelerator's) and the mixed precision it enables (None: neither its fp16 nor its bf16 block)."""

    zero_stage: int | None
    offload_optimizer: bool
    offload_params: bool
    gradient_clipping: float | None
    config: dict[str, Any]
    gradient_accumulation_steps: int | None
    mixed_precision: str | None


# A DeepSpeedPlugin field and the config key it fills (Accelerate's mapping).
DEEPSPEED_FIELDS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
