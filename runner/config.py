"""Typed schemas for the config groups the runner itself reads (Hydra structured configs).

A typo or a wrong type in YAML or on the command line fails at compose time, naming the key.
Each hardware and precision option declares its schema in its defaults list, e.g.
`conf/hardware/cpu.yaml` starts with `- /schema/hardware/cpu@_here_`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# The built-in config groups: the repository's conf/, installed as the package runner.conf.
CONF_PACKAGE = "runner.conf"
CONF_SEARCH_PATH = f"pkg://{CONF_PACKAGE}"
CONF_DIR = Path(str(files(CONF_PACKAGE)))


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts (None: no bound on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def problem(self, key: str, value: float) -> str | None:
        """Why `key=value` is out of range, or None."""
        low = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        high = (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
        if low and high:
            return None
        bounds = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
        return f"{key}={value}: must be {' and '.join(f'{op} {b}' for op, b in bounds if b is not None)}."


def bounded(default: Any, **bounds: float) -> Any:
    """A numeric setting with its `Range`, checked before launch (every numeric setting of a schema
    declares one: tests/test_config.py)."""
    return field(default=default, metadata={"range": Range(**bounds)})


# The untyped groups (model, data, task, optimizer, scheduler) instantiate classes and functions whose
# numeric arguments declare their range in the signature, e.g. `batch_size: PositiveInt = 64`; checked
# before launch like the schemas' (tests/test_config.py: every numeric setting of their YAML has one).
PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
Seed = Annotated[int, Range(ge=0, lt=2**32)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(gt=0, lt=1)]  # a share strictly between none and all
Probability = Annotated[float, Range(ge=0, lt=1)]  # dropout, a warm-up share


@dataclass(frozen=True)
class Declared:
    """What an argument of an untyped group's target accepts: numbers of `number`'s type within `bounds`;
    a list of them with `many`."""

    number: type
    bounds: Range
    many: bool = False


_ADAM = {
    "lr": Declared(float, Range(gt=0)),
    "weight_decay": Declared(float, Range(ge=0)),
    "eps": Declared(float, Range(gt=0)),
    "betas": Declared(float, Range(ge=0, lt=1), many=True),
}
# Third-party targets the shipped YAML names ("module.qualname" -> argument -> what it accepts).
THIRD_PARTY_RANGES: dict[str, dict[str, Declared]] = {
    "torch.optim.adamw.AdamW": _ADAM,
    "torch.optim.adam.Adam": _ADAM,
    "torch.optim.sgd.SGD": {
        key: Declared(float, Range(gt=0) if key == "lr" else Range(ge=0))
        for key in ("lr", "momentum", "dampening", "weight_decay")
    },
}


def declared_ranges(target: Any) -> dict[str, Declared]:
    """What each numeric argument of `target`, a class or function a `_target_` names, accepts: what its
    signature declares (`Annotated[int, Range(...)]`, in a list too; for a class, its base classes' too,
    which receive its **kwargs; for a function, the class it returns too), and THIRD_PARTY_RANGES."""
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
    ranges = dict(THIRD_PARTY_RANGES.get(name, {}))
    for function in _signatures(target):
        for key, hint in _hints(function).items():
            declared = _range_in(hint)
            if declared is not None and key != "return":
                ranges.setdefault(key, declared)
    return ranges


def _signatures(target: Any) -> list[Any]:
    if isinstance(target, type):
        return [cls.__init__ for cls in target.__mro__ if "__init__" in vars(cls) and cls is not object]
    returned = _hints(target).get("return")
    return [target, *(_signatures(returned) if isinstance(returned, type) else [])]


def _hints(function: Any) -> dict[str, Any]:
    try:
        return get_type_hints(function, include_extras=True)
    except Exception:  # annotations this process cannot resolve (a third party's): none declared
        return {}


def _range_in(hint: Any, many: bool = False) -> Declared | None:
    """What an annotation declares, looking inside Optional[...] and list[...]."""
    if get_origin(hint) is Annotated:
        number, *metadata = get_args(hint)
        bounds = next((m for m in metadata if isinstance(m, Range)), None)
        return Declared(number, bounds, many) if bounds is not None else None
    inside = many or get_origin(hint) in (list, tuple)
    return next((found for arg in get_args(hint) if (found := _range_in(arg, inside)) is not None), None)


class CompileScope(str, Enum):
    """What `trainer.compile.scope` compiles."""

    none = "none"  # eager
    model = "model"  # the whole model, one graph (broken where it must be)
    regional = (
        "regional"  # each block (the FSDP units, else the model's `_no_split_modules`): one compile, reused
    )


@dataclass
class CompileConfig:
    """`torch.compile` of the model (`trainer.compile`): applied in place (`Module.compile`) before the
    backend wraps the model, so state-dict keys and checkpoints are the eager model's."""

    scope: CompileScope = CompileScope.none
    backend: str = "inductor"  # a torch.compile backend: inductor | aot_eager | eager | ...
    mode: str | None = None  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    fullgraph: bool = False  # a graph break is an error instead of a fallback to Python
    dynamic: bool | None = None  # null: dynamic shapes after a recompilation; false: specialise


class CheckpointingMode(str, Enum):
    """What `trainer.activation_checkpointing.mode` recomputes in backward."""

    none = "none"  # keep every activation
    full = "full"  # every block: keep its input, recompute the rest
    selective = "selective"  # every `every_n_blocks`-th block; with `save_matmuls`, recompute all but matmuls


@dataclass
class ActivationCheckpointingConfig:
    """Activation checkpointing per block (`trainer.activation_checkpointing`, torch.utils.checkpoint,
    non-reentrant), applied before the backend wraps the model."""

    mode: CheckpointingMode = CheckpointingMode.none
    every_n_blocks: int = bounded(1, ge=1)  # selective: checkpoint blocks n-1, 2n-1, ... (1: every block)
    save_matmuls: bool = False  # selective: inside a checkpointed block keep the matmul outputs (op-level)


@dataclass
class ProfileConfig:
    """torch.profiler over a window of optimizer steps (`trainer.profile`): skip `wait`, warm up
    `warmup`, record `active` (0: off); the trace goes to <output dir>/profile/."""

    wait: int = bounded(1, ge=0)
    warmup: int = bounded(1, ge=0)
    active: int = bounded(0, ge=0)
    record_shapes: bool = False  # the input shapes of each op (the table groups by them)
    profile_memory: bool = False  # the memory each op allocates and frees


@dataclass
class TrainerConfig:
    max_steps: int | None = bounded(200, ge=1)  # optimizer steps; null: run `max_epochs` epochs
    max_epochs: int | None = bounded(None, ge=1)
    eval_every: int = bounded(100, ge=0)  # optimizer steps between evaluations; 0: evaluate at the end only
    log_every: int = bounded(10, ge=1)  # optimizer steps between log lines
    gradient_accumulation_steps: int = bounded(1, ge=1)
    split_batches: bool = False  # data.batch_size is the global batch, split over the processes
    max_grad_norm: float | None = bounded(None, gt=0)  # clip the total gradient norm to this value
    seed: int = bounded(0, ge=0, lt=2**32)
    progress_bar: bool = True
    checkpoint_every: int = bounded(
        0, ge=0
    )  # optimizer steps between checkpoints; 0: only when stopped by a signal
    keep_checkpoints: int | None = bounded(2, ge=1)  # newest checkpoints kept; null: all
    # at every logging step whose loss is finite, also save the state to checkpoints/last_finite (replacing
    # it): a run that diverges can resume from just before (costs a save every log_every steps)
    checkpoint_last_finite: bool = False
    # write checkpoints in the background: the loop waits only for the copy into host memory
    async_checkpoint: bool = False
    resume: str | None = "auto"  # auto: the output dir's latest checkpoint, if any | a checkpoint dir | null
    # a run that would start over in the dir of a finished run with other settings: move that run's files
    # into replaced-<time>/ first (false: refuse)
    overwrite: bool = False
    save_model: bool = True  # write the final weights to <output dir>/model
    objective: str | None = "eval/loss"  # the metric the Hydra main returns to sweepers; null: all metrics
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    memory_snapshot: bool = (
        False  # CUDA: record allocations; an out-of-memory error dumps them to the run dir
    )


@dataclass
class HardwareConfig:
    _target_: str = MISSING


@dataclass
class CPUConfig(HardwareConfig):
    device: str = "cpu"
    num_threads: int | None = bounded(None, ge=1)
    peak_flops: float | None = bounded(None, gt=0)  # the device's peak FLOP/s for MFU; null: the known table


@dataclass
class ParallelConfig(HardwareConfig):
    num_processes: int | None = bounded(None, ge=1)  # ranks on this machine; null: one per GPU, 2 on CPU
    device: str | None = None  # cuda | cpu; null: cuda when available
    backend: str | None = None  # null: nccl on cuda, gloo on cpu
    timeout_s: float = bounded(1800.0, gt=0)  # collective timeout
    num_threads: int | None = bounded(None, ge=1)  # CPU threads per rank; null: cores / ranks
    oversubscribe: bool = False  # allow more CPU ranks than cores
    peak_flops: float | None = bounded(None, gt=0)  # one device's peak FLOP/s for MFU; null: the known table


@dataclass
class DDPConfig(ParallelConfig):
    find_unused_parameters: bool = False
    bucket_cap_mb: float | None = bounded(None, gt=0)
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclass
class FSDPConfig(ParallelConfig):
    # sharding units by class; null: the model's _no_split_modules; []: the root only
    shard_modules: list[str] | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    dp_replicate: int = bounded(
        1, ge=1
    )  # HSDP: replica groups, each sharding over world / dp_replicate ranks
    dp_shard: int = bounded(-1, ge=-1)  # ranks each parameter is sharded over; -1: the rest of the world


@dataclass
class MegatronConfig(ParallelConfig):
    tp_size: int = bounded(2, ge=1)  # ranks each layer is split over; the rest of the world is data parallel
    sequence_parallel: bool = False  # also split the activations between layers along the sequence
    shard_modules: list[str] | None = None  # FSDP2 units for the data-parallel dimension
    reshard_after_forward: bool = True
    pp_size: int = bounded(1, ge=1)  # pipeline stages; tp_size x pp_size must divide the world
    dp_replicate: int = bounded(1, ge=1)  # HSDP over the data-parallel ranks: replica groups
    dp_shard: int = bounded(-1, ge=-1)  # data-parallel ranks each parameter is sharded over; -1: the rest
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    microbatches: int = bounded(4, ge=1)  # pipeline microbatches per batch (a divisor of the per-rank batch)
    virtual_stages: int = bounded(1, ge=1)  # stages per rank (interleaved_1f1b: >= 2)


@dataclass
class DeepSpeedConfig(ParallelConfig):
    zero_stage: int | None = bounded(None, ge=1, le=3)  # 1 | 2 | 3; null: the stage of `config`, else 2
    offload_optimizer: bool = False
    offload_params: bool = False  # stage 3 only
    gradient_clipping: float | None = bounded(None, gt=0)  # max gradient norm; null: none
    micro_batch_size: int | None = bounded(None, ge=1)  # null: the prepared dataloader's per-process batch
    config: Any = None  # a DeepSpeed JSON file, or its contents


@dataclass
class XLAConfig(HardwareConfig):
    spmd: bool | None = None  # shard each batch over the host's devices; null: when there are several
    peak_flops: float | None = bounded(None, gt=0)  # one device's peak FLOP/s for MFU; null: the known table


@dataclass
class BigModelConfig(HardwareConfig):
    device_map: Any = "auto"  # auto | balanced | balanced_low_0 | sequential | {module: device}
    max_memory: dict[str, Any] = field(default_factory=lambda: {"cpu": None})
    offload_folder: str | None = None
    no_split_module_classes: list[str] = field(default_factory=list)
    dtype: str | None = None
    offload_buffers: bool = False
    num_threads: int | None = bounded(None, ge=1)


@dataclass
class PrecisionConfig:
    _target_: str = MISSING


@dataclass
class MixedPrecisionConfig(PrecisionConfig):
    dtype: str = "bfloat16"


@dataclass
class Float16Config(PrecisionConfig):
    init_scale: float = bounded(2.0**16, gt=0)
    growth_factor: float = bounded(2.0, gt=1)
    backoff_factor: float = bounded(0.5, gt=0, lt=1)
    growth_interval: int = bounded(2000, ge=1)


@dataclass
class Float8Config(PrecisionConfig):
    recipe: str = "tensorwise"  # tensorwise | rowwise
    keep: list[str] = field(default_factory=lambda: ["lm_head"])  # module name patterns kept in bf16
    fsdp_float8_all_gather: bool = False
    emulate: bool = False  # float8 numerics with high-precision matmuls, on any device


@dataclass
class LauncherConfig:
    _target_: str = MISSING


@dataclass
class LocalLauncherConfig(LauncherConfig):
    start_method: str | None = None  # fork | spawn | forkserver; null: the hardware's choice
    monitor_interval_s: float = bounded(0.1, gt=0)
    shutdown_timeout_s: float = bounded(30.0, ge=0)


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    partition: str | None = None  # null: the cluster's default partition
    nodes: int = bounded(1, ge=1)
    gpus_per_node: int = bounded(0, ge=0)
    cpus_per_task: int | None = bounded(None, ge=1)
    mem_gb: float | None = bounded(None, gt=0)  # per node
    time_min: int = bounded(60, ge=1)
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    setup: list[str] = field(default_factory=list)  # shell lines before the ranks start
    sbatch_args: dict[str, Any] = field(default_factory=dict)  # {"mail-type": "END"} -> --mail-type=END
    srun_args: list[str] = field(default_factory=list)
    wait: bool = True  # false: return once queued
    signal_delay_s: int = bounded(120, ge=0)  # the preemption signal comes this long before the time limit
    max_timeouts: int = bounded(3, ge=0)  # requeues at the time limit
    folder: str | None = None  # submitit's files; null: <job dir>/slurm
    poll_interval_s: float = bounded(1.0, gt=0)
    name: str = "runner"


@dataclass
class TrackerConfig:
    _target_: str | None = None  # null: no tracking (tracker=none)


@dataclass
class MLflowTrackerConfig(TrackerConfig):
    experiment_name: str = "runner"
    uri: str | None = None  # null: $MLFLOW_TRACKING_URI, else sqlite in ./outputs/mlflow.db
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    parent_run_id: str | None = None  # set by the runner for the jobs of a sweep
    log_model: bool = False
    detach: bool | None = None  # null: detach unless in a SLURM job
    finish_timeout_s: float = bounded(120.0, ge=0)


@dataclass
class TensorBoardTrackerConfig(TrackerConfig):
    experiment_name: str = "runner"  # the folder under logging_dir
    logging_dir: str | None = None  # null: the run's directory


@dataclass
class SweepConfig:
    """A multirun (`-m`) in a sweep dir that holds the same sweep: `resume` skips its finished jobs and
    resumes its interrupted ones; false starts it over (the previous jobs' dirs moved aside)."""

    resume: bool = True


@dataclass
class RunnerSweeperConfig:
    """`hydra/sweeper=runner` (the default): Hydra's grid sweeper, resumable (`hydra_plugins/runner_sweeper`)."""

    _target_: str = "hydra_plugins.runner_sweeper.resumable_sweeper.ResumableSweeper"
    max_batch_size: int | None = None
    params: dict[str, str] | None = None


@dataclass
class RunnerLauncherConfig:
    """`hydra/launcher=runner` (the default): a sweep's jobs where their `launcher` says: SLURM arrays for
    `launcher=slurm`, else one after another here (`hydra_plugins/runner_launcher`)."""

    _target_: str = "hydra_plugins.runner_launcher.launcher.RunnerLauncher"


@dataclass
class RunConfig:
    """The composed config: `model`, `data`, `task`, `optimizer` and `scheduler` are free-form `_target_`
    nodes; the groups the runner reads are typed."""

    model: Any = MISSING
    data: Any = MISSING
    task: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    hardware: HardwareConfig = MISSING
    precision: PrecisionConfig = MISSING
    launcher: LauncherConfig = MISSING
    tracker: TrackerConfig = MISSING
    plan: bool = False  # print what the run would do, start nothing
    sweep: SweepConfig = field(default_factory=SweepConfig)
    checkpoint: str | None = (
        None  # model weights (a save_model dir or file): fine-tune from them, or run them
    )


SCHEMAS: dict[str, dict[str, type]] = {
    "hardware": {
        "cpu": CPUConfig,
        "multi_gpu": DDPConfig,
        "fsdp": FSDPConfig,
        "deepspeed": DeepSpeedConfig,
        "megatron": MegatronConfig,
        "tpu": XLAConfig,
        "big_model": BigModelConfig,
    },
    "precision": {
        "fp32": PrecisionConfig,
        "bf16": MixedPrecisionConfig,
        "fp16": Float16Config,
        "fp8": Float8Config,
    },
    "launcher": {"local": LocalLauncherConfig, "slurm": SlurmLauncherConfig},
    "tracker": {
        "mlflow": MLflowTrackerConfig,
        "tensorboard": TensorBoardTrackerConfig,
        "none": TrackerConfig,
    },
}


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (before composing)."""
    store = ConfigStore.instance()
    store.store(name="runner_schema", node=RunConfig)
    store.store(group="hydra/sweeper", name="runner", node=RunnerSweeperConfig, provider="runner")
    store.store(group="hydra/launcher", name="runner", node=RunnerLauncherConfig, provider="runner")
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=node)
