"""How a setting is declared: its type, default and `Range`, once, where it is read.

The trainer's settings are the dataclasses below (the loop reads them). A hardware, precision, launcher
or tracker option's settings are its class's constructor arguments, from which `runner.schemas` derives
the structured config Hydra checks at compose time (`conf/hardware/single_device.yaml` starts with
`- /schema/hardware/single_device@_here_`). The untyped groups (model, data, ...) instantiate classes whose
arguments declare their ranges the same way. `runner.validate` checks every range before launch.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from importlib.resources import files
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from omegaconf import MISSING, DictConfig, OmegaConf

from runner.errors import ConfigError

# The built-in config groups: the repository's conf/, installed as the package runner.conf.
CONF_PACKAGE = "runner.conf"
CONF_SEARCH_PATH = f"pkg://{CONF_PACKAGE}"
CONF_DIR = Path(str(files(CONF_PACKAGE)))
# group -> a former option name -> the option it names now (conf/<group>/<former>.yaml extends it), kept
# working for the configs that use it and left out of `--help`.
FORMER_NAMES: dict[str, dict[str, str]] = {
    "hardware": {"cpu": "single_device", "multi_gpu": "ddp", "megatron": "tensor_parallel", "tpu": "xla"},
}


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts (None: no bound on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    off: float | None = None  # a value outside the bounds that turns the setting off (0: never)

    def problem(self, key: str, value: float) -> str | None:
        """Why `key=value` is out of range, or None."""
        low = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        high = (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
        if (low and high) or value == self.off:
            return None
        return f"{key}={value}: must be {self}."

    def __str__(self) -> str:
        """The bounds as `runner --help` and the range errors write them: ">= 0 and < 1", ">= 1, or 0 (off)"."""
        bounds = ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
        said = " and ".join(f"{op} {bound}" for op, bound in bounds if bound is not None)
        return said if self.off is None else f"{said}, or {self.off} (off)"


# A numeric setting declares its range in its annotation, e.g. `batch_size: PositiveInt = 64`, checked
# before launch (tests/test_config.py: every numeric setting of a shipped option declares one).
PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
Seed = Annotated[int, Range(ge=0, lt=2**32)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
# trainer.hang_timeout_s: 0 turns the watchdog off; below 1 s (its poll is 0.5 s) any step, an evaluation
# batch or a checkpoint's start would read as a hang
HangTimeout = Annotated[float, Range(ge=1, off=0)]
# trainer.spike.window: the median and the MAD of fewer steps say little; 0 turns the check off
SpikeWindow = Annotated[int, Range(ge=8, off=0)]
Port = Annotated[int, Range(ge=1, le=65535)]  # a TCP port to listen on
StragglerRatio = Annotated[float, Range(gt=1, off=0)]  # how many times as long a straggler makes the steps
Fraction = Annotated[float, Range(gt=0, lt=1)]  # a share strictly between none and all
Probability = Annotated[float, Range(ge=0, lt=1)]  # dropout, a warm-up share
ShardDegree = Annotated[int, Range(ge=-1)]  # ranks a parameter is sharded over; -1: all the rest


def checked(group: str) -> Callable[[F], F]:
    """Decorates a constructor whose arguments declare `Range`s or `Exists`: a value out of its range, or
    a path that is not there, is a ConfigError naming `<group>.<argument>`, for an object built from Python
    as for one built from YAML (whose ranges `runner.validate` checks before launch, with the same
    `declared_ranges` and `Declared.problem`, and whose paths the command checks as it composes)."""

    def decorate(init: F) -> F:
        signature = inspect.signature(init)

        @functools.wraps(init)
        def checked_init(*args: Any, **kwargs: Any) -> Any:
            ranges, paths = _ranges_of(init), _paths_of(init)
            arguments = signature.bind(*args, **kwargs).arguments
            problems = [
                problem
                for name, value in arguments.items()
                if name in ranges and (problem := ranges[name].problem(f"{group}.{name}", value)) is not None
            ] + [
                problem
                for name, value in arguments.items()
                if name in paths
                and (problem := paths[name].problem(f"{group}.{name}", value)) is not None
            ]
            if problems:
                raise ConfigError(" ".join(problems))
            return init(*args, **kwargs)

        return checked_init  # type: ignore[return-value]

    return decorate


@functools.cache
def _ranges_of(function: Callable[..., Any]) -> dict[str, Declared]:
    """`declared_ranges(function)`, resolved at its first call (once every name it names exists)."""
    return declared_ranges(function)


@functools.cache
def _paths_of(function: Callable[..., Any]) -> dict[str, Exists]:
    """`declared_paths(function)`, resolved at its first call."""
    return declared_paths(function)


@dataclass(frozen=True)
class Exists:
    """Marks a setting that names a path on this machine, which must be there before anything starts
    (`path: Annotated[str, Exists("file", "a CSV file")]`): a "file", a "folder", a "path" (a file or a
    directory), a "tokenizer" (a directory `save_pretrained` wrote) or "shards" (a directory `runner
    prepare-data` wrote); `what` says what to give. Checked as the command composes, for the shipped
    options (before torch loads: `runner.group_schemas.PATH_SETTINGS`), and as a constructor decorated
    with `checked` is called."""

    kind: Literal["file", "folder", "path", "tokenizer", "shards"]
    what: str

    def problem(self, key: str, value: Any) -> str | None:
        """Why `key=value` names no such path (None: it does, or no path is given)."""
        if not isinstance(value, (str, Path)):
            return None
        path = Path(value).expanduser()
        found = {
            "file": path.is_file(),
            "folder": path.is_dir(),
            "path": path.exists(),
            "tokenizer": (path / "tokenizer_config.json").is_file(),
            "shards": (path / "manifest.json").is_file(),
        }[self.kind]
        if found:
            return None
        named, where = f"{key}={str(value)!r}", f"looked for {path.resolve()}"
        said = {
            "file": f"no such file ({where})",
            "folder": f"no such folder ({where})",
            "path": f"no such file or directory ({where})",
            "tokenizer": f"not a tokenizer directory (no tokenizer_config.json in {path.resolve()})",
            "shards": f"no token shards there ({'no manifest.json in it' if path.is_dir() else 'no such directory'}; "
            f"looked in {path.resolve()})",
        }[self.kind]
        return f"{named}: {said}. Give {self.what}; a relative path is taken from the directory you run in."


def declared_paths(target: Any) -> dict[str, Exists]:
    """The arguments of `target` (a class or function a `_target_` names; see `declared_ranges`) that name
    a path which must exist, each with its `Exists`."""
    paths: dict[str, Exists] = {}
    for function in _signatures(target):
        for key, hint in _hints(function).items():
            for inner in [hint, *get_args(hint)] if get_origin(hint) in (Union, UnionType) else [hint]:
                marks = inner.__metadata__ if get_origin(inner) is Annotated else ()
                for mark in marks:
                    if isinstance(mark, Exists):
                        paths.setdefault(key, mark)
    return paths


TokenizerDir = Annotated[str, Exists("tokenizer", "a local directory written by save_pretrained")]


@dataclass(frozen=True)
class NotASetting:
    """Marks a constructor argument given from Python (an Accelerate plugin), which no YAML sets: the
    derived schema leaves it out (`PythonOnly[bool]`)."""


T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
PythonOnly = Annotated[T, NotASetting()]


@dataclass(frozen=True)
class Declared:
    """What a setting accepts: values of `number`'s type (int, float, or for a plain annotation of a
    user's class also bool or str) within `bounds`, or one of `choices` (a Literal); a list of them with
    `many`."""

    number: type
    bounds: Range | None = None
    many: bool = False
    choices: tuple[Any, ...] | None = None

    def problem(self, key: str, value: Any) -> str | None:
        """Why `key=value` is not what this accepts, or None (None too for no value)."""
        if value is None:
            return None
        several = isinstance(value, Sequence) and not isinstance(value, str)  # a ListConfig too
        kind = self._kind()
        if several != self.many:
            return (
                f"{key}={value!r}: expected {'a list of ' + self._kind(plural=True) if self.many else kind}."
            )
        for index, item in enumerate(value if several else [value]):
            name = f"{key}[{index}]" if several else key
            if not self._accepts(item):
                return f"{name}={item!r}: expected {kind}."
            if self.bounds is not None and (problem := self.bounds.problem(name, item)) is not None:
                return problem
        return None

    def _kind(self, plural: bool = False) -> str:
        if self.choices is not None:
            return ("values among " if plural else "one of ") + ", ".join(map(repr, self.choices))
        if plural:
            return {int: "integers", bool: "true/false values", str: "strings"}.get(self.number, "numbers")
        return {int: "an integer", bool: "true or false", str: "a string"}.get(self.number, "a number")

    def _accepts(self, item: Any) -> bool:
        if self.choices is not None:
            return item in self.choices
        if self.number is bool or self.number is str:
            return isinstance(item, self.number)
        kinds = numbers.Integral if self.number is int else numbers.Real
        return isinstance(item, kinds) and not isinstance(item, bool)


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


def declared_ranges(target: Any, plain: bool = False) -> dict[str, Declared]:
    """What each numeric argument of `target`, a class or function a `_target_` names, accepts: what its
    signature declares (`Annotated[int, Range(...)]`, in a list too; for a class, its base classes' too,
    which receive its **kwargs; for a function, the class it returns too), and THIRD_PARTY_RANGES. With
    `plain` (a user's class, whose settings no schema types) also the arguments annotated with a plain
    int, float, bool, str or Literal (in Optional or a list too)."""
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
    ranges = dict(THIRD_PARTY_RANGES.get(name, {}))
    for function in _signatures(target):
        for key, hint in _hints(function).items():
            declared = _range_in(hint, plain=plain)
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


PLAIN = (bool, int, float, str)  # the plain annotations of a user's class that are checked


def _range_in(hint: Any, many: bool = False, plain: bool = False) -> Declared | None:
    """What an annotation declares, looking inside Optional[...] and list[...] (`plain`: see
    `declared_ranges`)."""
    if get_origin(hint) is Annotated:
        number, *metadata = get_args(hint)
        bounds = next((m for m in metadata if isinstance(m, Range)), None)
        if bounds is not None:
            return Declared(number, bounds, many)
        return _range_in(number, many, plain)
    if plain and hint in PLAIN:
        return Declared(hint, None, many)
    if plain and get_origin(hint) is Literal:
        return Declared(object, None, many, choices=get_args(hint))
    origin = get_origin(hint)
    if plain and origin is not None and origin not in (list, tuple, Union, UnionType):
        return None  # dict[...], Callable[...]: not checked
    inside = many or origin in (list, tuple)
    found = [
        found for arg in get_args(hint) if arg is not type(None) and (found := _range_in(arg, inside, plain))
    ]
    return found[0] if len(found) == 1 or (found and not plain) else None  # a Union of two types: not checked


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
    options: Any = None  # the backend's options: a mapping (inductor's config keys); not with `mode`
    loss: bool = True  # also compile the task's loss (with scope model or regional), as one more graph


class Mode(str, Enum):
    """What a run does with a training task."""

    train = "train"
    evaluate = "evaluate"  # the eval loop once, on `checkpoint`'s weights


class Direction(str, Enum):
    """Which way a sweep's objective is better (Optuna's words)."""

    minimize = "minimize"
    maximize = "maximize"


class NonFinite(str, Enum):
    """What `trainer.on_nonfinite` does with an optimizer step whose gradients are NaN or infinite."""

    stop = "stop"  # take it: the run stops as diverged at its next logging step (train/loss is not finite)
    skip = "skip"  # leave it out (the weights, the optimizer state and the LR schedule stay), and count it


class Console(str, Enum):
    """What the console says of a run (`trainer.console`); the log file, the history and the trackers keep
    everything either way."""

    quiet = "quiet"  # what repeats itself left out (`runner.telemetry.console`)
    full = "full"  # every figure, and the goodput table of every run


class SpikeMetric(str, Enum):
    """A per-step value `trainer.spike` watches (the mean over the processes)."""

    loss = "loss"  # the step's training loss
    grad_norm = "grad_norm"  # the total gradient norm before clipping


class SpikeAction(str, Enum):
    """What `trainer.spike` does with a spike."""

    log = "log"  # warn, count it as train/spikes, record it in spikes.jsonl
    rollback = "rollback"  # and return to a checkpoint before it, leaving out the batches since (PaLM's recipe)


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
    every_n_blocks: PositiveInt = 1  # selective: checkpoint blocks n-1, 2n-1, ... (1: every block)
    save_matmuls: bool = False  # selective: inside a checkpointed block keep the matmul outputs (op-level)


@dataclass
class ProfileConfig:
    """torch.profiler over a window of optimizer steps (`trainer.profile`): skip `wait`, warm up
    `warmup`, record `active` (0: off); the trace goes to <output dir>/profile/."""

    wait: NonNegativeInt = 1
    warmup: NonNegativeInt = 1
    active: NonNegativeInt = 0
    record_shapes: bool = False  # the input shapes of each op (the table groups by them)
    profile_memory: bool = False  # the memory each op allocates and frees


@dataclass
class SpikeConfig:
    """Loss and gradient-norm spikes (`trainer.spike`, `runner.callbacks.spikes`): a step whose value is
    more than `threshold` robust z-scores ((x - median) / (1.4826 MAD)) above the `window` steps before it."""

    window: SpikeWindow = 0  # steps the median and the MAD are taken over; 0: off
    threshold: PositiveFloat = 6.0
    metrics: list[SpikeMetric] = field(default_factory=lambda: [SpikeMetric.loss])
    action: SpikeAction = SpikeAction.log
    # rollback: to the newest checkpoint written at least this many steps before the spike
    rollback_steps: PositiveInt = 1


@dataclass
class TrainerConfig:
    max_steps: PositiveInt | None = 200  # optimizer steps; null: run `max_epochs` epochs
    max_epochs: PositiveInt | None = None
    eval_every: NonNegativeInt = 100  # optimizer steps between evaluations; 0: evaluate at the end only
    eval_at_start: bool = False  # also evaluate before the first step of a run started afresh (step 0)
    eval_train_batches: NonNegativeInt = 0  # batches a process of a fixed training sample evaluated with each evaluation
    log_every: PositiveInt = 10  # optimizer steps between log lines
    rank_metrics: bool = True  # every rank's step time, data wait and memory at log steps (rank/<r>/...)
    # a rank whose extra data wait makes the steps this many times as long is named a straggler; 0: off
    straggler_ratio: StragglerRatio = 1.5
    gradient_accumulation_steps: PositiveInt = 1
    split_batches: bool = False  # data.batch_size is the global batch, split over the processes
    max_grad_norm: PositiveFloat | None = None  # clip the total gradient norm to this value
    on_nonfinite: NonFinite = NonFinite.stop  # a step whose gradients are NaN or infinite: stop | skip
    max_skipped_steps: PositiveInt = 10  # on_nonfinite=skip: this many skipped steps in a row stop the run
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    seed: Seed = 0
    progress_bar: bool = True
    # optimizer steps between checkpoints; 0: only when stopped by a signal
    checkpoint_every: NonNegativeInt = 0
    # seconds between checkpoints, checked at logging steps (as well as checkpoint_every); 0: off
    checkpoint_every_s: NonNegativeFloat = 0.0
    keep_checkpoints: PositiveInt | None = 2  # newest checkpoints kept; null: all
    # at every logging step whose loss is finite, also save the state to checkpoints/last_finite (replacing
    # it): a run that diverges can resume from just before (costs a save every log_every steps)
    checkpoint_last_finite: bool = False
    # write checkpoints in the background: the loop waits only for the copy into host memory
    async_checkpoint: bool = False
    resume: str | None = (
        "auto"  # auto: the output dir's latest checkpoint, if any | last (runner.cli) | a dir | null
    )
    # a run that would start over in the dir of a finished run with other settings: move that run's files
    # into replaced-<time>/ first (false: refuse)
    overwrite: bool = False
    save_model: bool = True  # write the final weights to <output dir>/model
    plots: bool = True  # draw the curves (history.jsonl) into <output dir>/plots/ at each eval and the end
    plots_log_scale: bool = False  # the losses' and perplexities' curves on a logarithmic y axis
    console: Console = Console.quiet  # quiet: what repeats itself left out | full: every figure, each time
    objective: str | None = "eval/loss"  # the metric the Hydra main returns to sweepers; null: all metrics
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    memory_snapshot: bool = (
        False  # CUDA: record allocations; an out-of-memory error dumps them to the run dir
    )
    # seconds a rank may make no progress before it dumps its stacks and fails (at least 1); null: 20x the
    # median step (at least 600 s; 1800 s for the first steps); 0: never (`runner.callbacks.watchdog`)
    hang_timeout_s: HangTimeout | None = None
    # Debugging (Lightning's switches): `fast_dev_run` N > 0 runs N steps and N eval batches with nothing
    # kept (no checkpoint, tracker, callbacks, plots, model or results: `runner.build.fast_dev_run`)
    fast_dev_run: NonNegativeInt = 0
    limit_train_batches: PositiveInt | None = None  # batches of each epoch, on each process; null: all
    limit_eval_batches: PositiveInt | None = None  # batches of each evaluation, on each process; null: all
    overfit_batches: NonNegativeInt = 0  # N > 0: train and evaluate on the first N batches only


@dataclass
class HardwareConfig:
    """What every hardware option's schema (`runner.schemas`, derived from its strategy) starts from."""

    _target_: str = MISSING


@dataclass
class PrecisionConfig:
    _target_: str = MISSING


@dataclass
class LauncherConfig:
    _target_: str = MISSING


@dataclass
class TrackerConfig:
    _target_: str | None = None  # null: no tracking (tracker=none)


@dataclass
class SweepConfig:
    """A multirun (`-m`) in a sweep dir that holds the same sweep: `resume` skips its finished jobs and
    resumes its interrupted ones; false starts it over (the previous jobs' dirs moved aside). `direction`:
    which way `trainer.objective` is better, what the sweep's summary ranks its jobs by."""

    resume: bool = True
    direction: Direction = Direction.minimize


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
    # typed by its option's schema; a user's own tracker (a `_target_` in their tracker/ option) is checked
    # against its class's signature, as the free-form nodes are
    tracker: Any = MISSING
    plan: bool = False  # print what the run would do, start nothing
    sweep: SweepConfig = field(default_factory=SweepConfig)
    # code the loop calls at its named points, by name: each a `_target_` (conf/callbacks/, runner.callbacks)
    callbacks: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = (
        None  # model weights (a save_model dir or file, a run's dir): fine-tune from them, or run them
    )
    mode: Mode = Mode.train  # evaluate: the eval loop on `checkpoint`'s weights, nothing trained


def trainer_settings(trainer: DictConfig) -> TrainerConfig:
    """The composed `trainer` node as its dataclass, nested configs included (a node loaded from YAML,
    untyped, is checked against the schema on the way)."""
    return OmegaConf.to_object(OmegaConf.merge(TrainerConfig, trainer))  # type: ignore[return-value]
