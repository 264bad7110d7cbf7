"""Checks on the composed config that run before anything is built, spawned or queued."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import IterableDataset

from runner.build import (
    OPTIMIZER_SETTINGS,
    Blueprint,
    build_data,
    build_on_meta,
    build_optimizer,
    build_scheduler,
    is_inference,
    locate,
)
from runner.checkpoint.weights import DamagedFileError, check_against_model, checkpoint_tensors
from runner.config import CheckpointingMode, RunConfig, SpikeAction, SpikeMetric, declared_ranges
from runner.data.base import DataSource, Stream
from runner.errors import ConfigError
from runner.hardware.base import Strategy
from runner.hardware.big_model import BigModel
from runner.rng import seeded
from runner.task import POSITIONS, attends_within_documents
from runner.trackers.base import Tracker

T = TypeVar("T")

# Nodes with a dataclass schema (runner/config.py).
TYPED_NODES = ("trainer", "hardware", "precision", "launcher", "tracker")
# Nodes the runner instantiates, in the order they are reported.
TARGET_NODES = (
    "hardware",
    "precision",
    "launcher",
    "tracker",
    "model",
    "data",
    "task",
    "optimizer",
    "scheduler",
)
# Nodes without a schema: their numeric settings are checked against the target's signature.
UNTYPED_NODES = ("model", "data", "task", "optimizer", "scheduler")
OPTIONAL_NODES = ("tracker",)  # `_target_: null` turns them off
# Nodes cheap to build in the launching process; building them checks their values (devices, files).
BUILT_NODES = ("hardware", "launcher", "tracker", "data")
_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


@dataclass(frozen=True)
class Built:
    """What validation built in the launching process, passed on so that nothing is built twice there."""

    hardware: Strategy
    launcher: Any  # a runner.launchers.Launcher (a layer above this one)
    blueprint: Blueprint | None = None  # what the training checks read (None: not built)
    tracker: Tracker | None = None  # None: tracker._target_ is null


def validate(cfg: DictConfig) -> Built:
    """The hardware and the launcher, built and checked; a ConfigError whose message lists every problem
    found, one paragraph each, if there is any."""
    built, problems = _validate(cfg)
    if problems:
        raise ConfigError("\n\n".join(problems))
    return Built(hardware=built["hardware"], launcher=built["launcher"], tracker=built.get("tracker"))


def _validate(cfg: DictConfig) -> tuple[dict[str, Any], list[str]]:
    """What could be built (hardware, launcher, data source) and every problem found: the settings
    checked, then each node built whose settings no problem names."""
    problems = _shape_problems(cfg) or missing_values(cfg)
    if problems:  # interpolations and builds would fail on them
        return {}, problems
    problems = [
        *_schema_problems(cfg),
        *_target_problems(cfg),
        *_trainer_problems(cfg.trainer),
        *_mode_problems(cfg),
        *_range_problems(cfg),
    ]
    built: dict[str, Any] = {}
    problems += _build_problems(cfg, built, skip=named_nodes(problems))
    return built, problems


def named_nodes(problems: list[str]) -> set[str]:
    """The nodes the problems are about (each message starts with the key it names: `data.path=...`,
    `model._target_=...`, `optimizer: ...`)."""
    return {node for node in TARGET_NODES for p in problems if re.match(rf"{node}[.=:\[ ]", p)}


def _shape_problems(cfg: DictConfig) -> list[str]:
    """A `_target_` node whose YAML is not a mapping (a list, a scalar at its top level)."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    problems = []
    for node in TARGET_NODES:
        value = cfg._get_node(node)
        if not isinstance(value, DictConfig):
            kind = "a list" if isinstance(value, ListConfig) else f"the value {value._value()!r}"
            source = f"the YAML of {node}={choices[node]}" if node in choices else f"the YAML of {node}"
            problems.append(
                f"{node}: {source} holds {kind} at its top level, not a mapping. A config option holds `key: value` "
                f"lines: `_target_: <module.Class>` and its settings."
            )
    return problems


def missing_values(cfg: DictConfig) -> list[str]:
    return [
        f"{key}: no value was given (it is '???' in its YAML). Set it on the command line, e.g. `{key}=...`."
        for key in sorted(OmegaConf.missing_keys(cfg))
    ]


def _schema_problems(cfg: DictConfig) -> list[str]:
    """Keys added with `+key=value` to a typed group or the top level pass composition; they are still
    not settings."""
    top = [f.name for f in dataclasses.fields(RunConfig)]
    problems = []
    for key in cfg:
        if key not in top:
            owners = [node for node in TYPED_NODES if key in cfg[node]]
            hint = f" Did you mean {owners[0]}.{key}?" if owners else ""
            problems.append(
                f"{key}: not a setting of the top level (its settings are {', '.join(top)}).{hint} Remove it."
            )
    for node, node_cfg in _typed_nodes(cfg):
        fields = [f.name for f in dataclasses.fields(OmegaConf.get_type(node_cfg))]
        problems += [
            f"{node}.{key}: not a setting of {node} (its settings are {', '.join(fields)}). Remove it."
            for key in node_cfg
            if key not in fields
        ]
    return problems


def _typed_nodes(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """(dotted key, node) of every node with a schema: the typed groups and the settings nested in them
    (`trainer.compile`)."""
    found = []
    pending = [(node, cfg[node]) for node in TYPED_NODES if _has_schema(cfg[node])]
    while pending:
        key, node_cfg = pending.pop(0)
        found.append((key, node_cfg))
        for setting in dataclasses.fields(OmegaConf.get_type(node_cfg)):
            child = node_cfg.get(setting.name)
            if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
                pending.append((f"{key}.{setting.name}", child))
    return found


def _has_schema(node_cfg: DictConfig) -> bool:
    """Whether a node is typed (a user's own tracker option is not)."""
    return dataclasses.is_dataclass(OmegaConf.get_type(node_cfg))


def _untyped_nodes(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """(dotted key, node) of the free-form nodes: the untyped groups, a typed group's option of the user's
    own without a schema, and the callbacks."""
    untyped = [node for node in TYPED_NODES if not _has_schema(cfg[node])]
    return [(node, cfg[node]) for node in (*UNTYPED_NODES, *untyped)] + callback_nodes(cfg)


def callback_nodes(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """(dotted key, node) of each callback the run adds to its loop (`callbacks.<name>`)."""
    named = (cfg.get("callbacks") or {}).items()
    return [(f"callbacks.{name}", node) for name, node in named if node is not None]  # null: switched off


def _target_problems(cfg: DictConfig) -> list[str]:
    problems = []
    for node, node_cfg in [(node, cfg[node]) for node in TARGET_NODES] + callback_nodes(cfg):
        target = node_cfg.get("_target_")
        if target is None and node in OPTIONAL_NODES:
            continue
        try:
            obj = locate(target)
        except ImportError as err:
            problems.append(
                f"{node}._target_={target!r} cannot be imported ({err}; looked in the working directory "
                f"{os.getcwd()} and the installed packages). Check the spelling, run from the directory that holds "
                "your package (it is importable from there), or install the package that provides it; "
                f"`runner --help` lists the {node} options that ship with runner."
            )
            continue
        if node == "model" and "peft" in node_cfg and not _takes(obj, "peft"):
            problems.append(
                f"model.peft: {target} trains every weight it has; PEFT adapters (model/peft=lora) are for the "
                "Hugging Face models: model=hf_causal_lm or model=hf_sequence_classification, with "
                "model.pretrained=<a local model dir>. Remove model/peft, or choose one of those models."
            )
            continue
        problems += _argument_problems(node, obj, node_cfg, OPTIMIZER_SETTINGS if node == "optimizer" else ())
        if node.startswith("callbacks.") and (check := getattr(obj, "check_settings", None)) is not None:
            problems += check(
                node, node_cfg, cfg.trainer
            )  # the callback's own rule (`Callback.check_settings`)
    return problems


def _takes(obj: Any, argument: str) -> bool:
    """Whether the callable `obj` has a parameter named `argument`."""
    try:
        return argument in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False


def _argument_problems(node: str, obj: Any, node_cfg: DictConfig, own: tuple[str, ...] = ()) -> list[str]:
    """The settings of `node` that its `_target_` does not take (those in `own` runner reads itself)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return []
    arguments = {k: v for k, v in node_cfg.items() if k not in _HYDRA_KEYS and k not in own}
    try:
        signature.bind_partial(**arguments)
    except TypeError as err:
        names = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        close = [
            f"{node}.{found[0]}"
            for key in arguments
            if key not in signature.parameters and (found := difflib.get_close_matches(key, names, n=1))
        ]
        return [
            f"{node}: {node_cfg._target_} does not accept these settings ({err})"
            f"{'; did you mean ' + ', '.join(close) + '?' if close else '.'} "
            f"Its parameters are: {', '.join(names)}. Fix the key in your YAML or on the command line."
        ]
    return []


def _trainer_problems(trainer: DictConfig) -> list[str]:
    problems = []
    if trainer.max_steps is None and trainer.max_epochs is None:
        problems.append("trainer.max_steps and trainer.max_epochs are both null: set one of them.")
    checkpointing = trainer.activation_checkpointing
    selective = {"every_n_blocks": 1, "save_matmuls": False}
    changed = [
        f"{key}={checkpointing[key]}" for key, default in selective.items() if checkpointing[key] != default
    ]
    if changed and checkpointing.mode != CheckpointingMode.selective:
        problems.append(
            f"trainer.activation_checkpointing.{changed[0]}: a setting of mode=selective, and mode is "
            f"{checkpointing.mode.value} ({'every block is checkpointed whole' if checkpointing.mode == CheckpointingMode.full else 'nothing is checkpointed'}). "
            "Set trainer.activation_checkpointing.mode=selective, or leave every_n_blocks=1 and save_matmuls=false."
        )
    problems += _spike_problems(trainer)
    window = trainer.profile.wait + trainer.profile.warmup + trainer.profile.active
    if trainer.profile.active and trainer.max_steps is not None and window > trainer.max_steps:
        problems.append(
            f"trainer.profile: the window (wait {trainer.profile.wait} + warmup {trainer.profile.warmup} + active "
            f"{trainer.profile.active} = {window} steps) is longer than trainer.max_steps={trainer.max_steps}: "
            "nothing would be written. Shorten the window or train longer."
        )
    return problems


def _spike_problems(trainer: DictConfig) -> list[str]:
    """`trainer.spike` watches something, and a rollback finds a checkpoint to return to: one numbered by
    steps, still kept `rollback_steps` after it was written."""
    spike = trainer.spike
    if not spike.window:
        return []
    if not spike.metrics:
        return ["trainer.spike.metrics=[]: nothing to watch. Give loss and/or grad_norm, or trainer.spike.window=0 (off)."]
    if spike.action != SpikeAction.rollback:
        return []
    every, keep = trainer.checkpoint_every, trainer.keep_checkpoints
    if not every:
        return [
            "trainer.spike.action=rollback returns to a checkpoint written before the spike, and "
            "trainer.checkpoint_every=0 writes none by steps. Set trainer.checkpoint_every (PaLM returned about "
            "100 steps before a spike), or use trainer.spike.action=log."
        ]
    reach = (keep - 1) * every + 1 if keep is not None else None  # the steps back the kept ones surely cover
    if reach is not None and spike.rollback_steps > reach:
        return [
            f"trainer.spike.rollback_steps={spike.rollback_steps}: a rollback returns to the newest checkpoint "
            f"at least that many steps before the spike, and with trainer.checkpoint_every={every} and "
            f"trainer.keep_checkpoints={keep} the oldest one kept may be only {reach} step(s) back. Keep more "
            f"(trainer.keep_checkpoints={-(-(spike.rollback_steps - 1) // every) + 1}, or null: all), or roll "
            f"back fewer steps (at most {reach})."
        ]
    return []


def _mode_problems(cfg: DictConfig) -> list[str]:
    """`mode=evaluate` needs weights to evaluate and a training task (whose eval loop it runs)."""
    if cfg.get("mode") != "evaluate":
        return []
    if cfg.checkpoint is None:
        return [
            "mode=evaluate needs checkpoint=<weights>: a run's dir (its final model/), a save_model dir or a "
            "weights file, e.g. mode=evaluate checkpoint=outputs/runs/<date>_<time>."
        ]
    if is_inference(cfg.task._target_):
        return [
            f"mode=evaluate runs a training task's eval loop; task={cfg.task._target_} runs as it is: leave mode out."
        ]
    return []


def _range_problems(cfg: DictConfig) -> list[str]:
    """Every numeric setting against the range its declaration gives (`config.declared_ranges`): a typed
    node's from its schema, an untyped node's from the signature of what it instantiates, where a value
    of the wrong type is named too, also for a plain int, float, bool, str or Literal annotation."""
    declarations = [
        (node, node_cfg, declared_ranges(OmegaConf.get_type(node_cfg)))
        for node, node_cfg in _typed_nodes(cfg)
    ]
    # no schema types them: the plain annotations of what they build too
    for node, node_cfg in _untyped_nodes(cfg):
        try:
            declarations.append(
                (node, node_cfg, declared_ranges(locate(node_cfg.get("_target_")), plain=True))
            )
        except ImportError:  # _target_problems names it
            continue
    return [
        problem
        for node, node_cfg, declared in declarations
        for key, accepts in declared.items()
        if key in node_cfg and (problem := accepts.problem(f"{node}.{key}", node_cfg.get(key))) is not None
    ]


def _build_problems(cfg: DictConfig, built: dict[str, Any], skip: set[str]) -> list[str]:
    """Build the hardware, the launcher, the tracker and the data source into `built` (not those in
    `skip`, whose settings are known to be wrong): their constructors check what only they know (process
    counts against the GPUs here, files that must exist, a tracking URI); the callbacks, built to check
    their settings, then dropped. Then ask the hardware whether it can run the precision."""
    problems = []
    for node in BUILT_NODES:
        if node in skip or (node in OPTIONAL_NODES and not cfg[node].get("_target_")):
            continue
        try:
            built[node] = _built_node(cfg, node)
        except ConfigError as err:
            problems.append(str(err))
    for node, node_cfg in callback_nodes(cfg):
        if node not in skip:
            try:
                _run_user_code(node, node_cfg, "to be built", lambda n=node_cfg: instantiate(n))
            except ConfigError as err:
                problems.append(str(err))
    if "hardware" in built and "precision" not in skip:
        problems += _hardware_problems(cfg, built["hardware"])
    return problems


def _built_node(cfg: DictConfig, node: str) -> Any:
    """`cfg[node]` instantiated; what its constructor refused, a ConfigError (a user's own option's error
    in its code, `_run_user_code`)."""
    if node in TYPED_NODES and not _has_schema(cfg[node]):  # a user's own option (a tracker)
        return _run_user_code(node, cfg[node], "to be built", lambda: instantiate(cfg[node]))
    try:
        return instantiate(cfg[node])
    except InstantiationException as err:
        if not isinstance(err.__cause__, ConfigError):
            raise
        raise err.__cause__ from None


def _hardware_problems(cfg: DictConfig, hardware: Any) -> list[str]:
    """Whether the built hardware runs the precision on its device, the compute options, a memory
    snapshot (CUDA only), a step left out (`trainer.on_nonfinite=skip`), a gradient norm to watch
    (`trainer.spike`) and the checkpoints' settings."""
    problems = []
    device = getattr(hardware, "device", torch.device("cpu"))
    for check in (
        lambda: hardware.setup_precision(instantiate(cfg.precision)).check_device(device),
        lambda: hardware.setup_compute(
            OmegaConf.to_object(cfg.trainer.compile),
            OmegaConf.to_object(cfg.trainer.activation_checkpointing),
        ),
    ):
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
    if cfg.trainer.memory_snapshot and device.type != "cuda":
        problems.append(
            f"trainer.memory_snapshot=true records the CUDA allocator's history; hardware={cfg.hardware._target_} "
            f"computes on {device.type}. Set trainer.memory_snapshot=false, or run on GPUs."
        )
    if cfg.trainer.get("on_nonfinite") == "skip" and not hardware.skips_steps:
        problems.append(
            f"trainer.on_nonfinite=skip: {type(hardware).__name__} takes every optimizer step itself (DeepSpeed's "
            "engine; with precision=fp16 its loss scaler skips the steps that overflow). Use "
            "trainer.on_nonfinite=stop with it."
        )
    spike = cfg.trainer.spike
    watches_norm = spike.window and SpikeMetric.grad_norm in spike.metrics
    if watches_norm and cfg.trainer.max_grad_norm is None and not hardware.skips_steps:
        problems.append(
            f"trainer.spike.metrics: grad_norm, and {type(hardware).__name__} measures the gradient norm inside "
            "its own step, where it clips (DeepSpeed's engine). Set trainer.max_grad_norm (and "
            "hardware.gradient_clipping to the same), or watch the loss only: trainer.spike.metrics=[loss]."
        )
    return problems + _checkpoint_problems(cfg, hardware)


def check_job(cfg: DictConfig) -> tuple[Built, int]:
    """Every check a job passes before launch, all of them reported at once: `validate`'s, then (once the
    hardware and the launcher are built) the launcher's own and `validate_for_world`'s with the number of
    ranks the launcher will start. What was built, and that number."""
    built, problems = _validate(cfg)
    details = []
    blueprint = None
    if "hardware" in built and "launcher" in built:
        hardware, launcher = built["hardware"], built["launcher"]
        world_size = launcher.world_size(cfg, hardware)
        skip = named_nodes(problems)
        try:
            launcher.check(cfg, hardware)
        except ConfigError as err:
            problems.append(str(err))
            details += [err.details] if err.details else []
        try:
            blueprint = validate_for_world(cfg, world_size, hardware, skip)
        except ConfigError as err:
            problems.append(str(err))
            details += [err.details] if err.details else []
    else:  # the hardware or the launcher is refused: the checks that need neither, as for one rank
        try:
            validate_for_world(cfg, 1, None, named_nodes(problems))
        except ConfigError as err:
            problems.append(str(err))
            details += [err.details] if err.details else []
    if problems:
        raise ConfigError("\n\n".join(problems), details="\n".join(details) or None)
    return Built(built["hardware"], built["launcher"], blueprint, built.get("tracker")), world_size


def validate_for_world(
    cfg: DictConfig, world_size: int, hardware: Strategy | None, skip: set[str] = frozenset()
) -> Blueprint | None:
    """The checks that need the number of ranks the launcher will start (ConfigError listing all): the
    data read (seeded as a rank seeds it), the model built on meta, the run's blueprint of them read by
    each of `WORLD_CHECKS` (the `hardware`'s own checks are left out where it is None: a hardware group
    that was refused); not when a node they build is in `skip` (its settings are known to be wrong). The
    blueprint (None where none was built: an inference task, or settings known to be wrong)."""
    problems = _split_problems(cfg, world_size)
    blueprint = None
    if not skip & set(UNTYPED_NODES) and not is_inference(cfg.task._target_):
        with seeded(cfg.trainer.seed) as rng:
            data = _run_user_code("data", cfg.data, "to read its data", lambda: build_data(cfg))
        model = _run_user_code("model", cfg.model, "to build the model", lambda: build_on_meta(cfg, data))
        readers = hardware.data_parallel_size(world_size) if hardware is not None else world_size
        blueprint = Blueprint(cfg, data, model, readers if cfg.trainer.split_batches else 1, rng)
        problems += [problem for check in WORLD_CHECKS for problem in check(blueprint, hardware, world_size)]
    if problems:
        raise ConfigError("\n\n".join(problems))
    return blueprint


def _split_problems(cfg: DictConfig, world_size: int) -> list[str]:
    """With `trainer.split_batches`, a global batch that does not split evenly over the processes."""
    batch_size = cfg.data.get("batch_size")
    if not (cfg.trainer.split_batches and batch_size and batch_size % world_size):
        return []
    return [
        f"trainer.split_batches=true: data.batch_size={batch_size} is the global batch and must split evenly "
        f"over the {world_size} processes. Use a multiple of {world_size} (e.g. "
        f"{batch_size - batch_size % world_size or world_size}), or trainer.split_batches=false for "
        f"{batch_size} per process."
    ]


def _strategy_problems(blueprint: Blueprint, hardware: Strategy | None, world_size: int) -> list[str]:
    """The strategy's own checks of the meta model, its compute, the training step and the batches."""
    if hardware is None:
        return []
    cfg, model = blueprint.cfg, blueprint.model
    batch_size = cfg.data.get("batch_size") or 1
    checks = (
        lambda: hardware.check_model(model, world_size),
        lambda: hardware.check_compute(model),
        lambda: _check_training(cfg, hardware, world_size, blueprint.data),
        lambda: hardware.check_batches(
            batch_size // (world_size if cfg.trainer.split_batches else 1),
            cfg.trainer.gradient_accumulation_steps,
            world_size,
        ),
    )
    problems = []
    for check in checks:
        try:
            check()
        except ConfigError as err:
            problems.append(str(err))
    return problems


def _size_problems(blueprint: Blueprint, hardware: Strategy | None, world_size: int) -> list[str]:
    """A training set smaller than one step's batches (or the batches `trainer.overfit_batches` takes), a
    stream that cannot feed every reader, an eval set with fewer samples than processes."""
    cfg, data = blueprint.cfg, blueprint.data
    batch_size = cfg.data.get("batch_size")
    split = cfg.trainer.split_batches
    step_samples = (batch_size or 1) * (1 if split else world_size)
    readers = hardware.data_parallel_size(world_size) if hardware is not None else world_size
    overfit = cfg.trainer.overfit_batches * (batch_size or 1) * (1 if split else readers)
    problems = []
    if isinstance(data.train_set, Stream):
        problems += _stream_problems(cfg, data.train_set, hardware, world_size)
    elif overfit > len(data.train_set):
        problems.append(
            f"trainer.overfit_batches={cfg.trainer.overfit_batches}: the training set has {len(data.train_set)} "
            f"sample(s), fewer than the {overfit} its first {cfg.trainer.overfit_batches} batch(es) take. Ask for "
            "fewer batches, or a smaller data.batch_size."
        )
    elif batch_size and len(data.train_set) < step_samples:
        problems.append(
            f"data.batch_size={batch_size}: the training set has {len(data.train_set)} sample(s), fewer than one "
            f"batch on each of the {world_size} process(es) needs ({step_samples}): training would run on smaller "
            "batches than asked. Lower data.batch_size, or use more data."
        )
    eval_size = len(data.eval_set)
    if eval_size < world_size:
        problems.append(
            f"the eval set has {eval_size} sample(s), fewer than the {world_size} processes: each process needs "
            "at least one to evaluate. Hold out more data (e.g. a larger data.eval_fraction) or run fewer "
            "processes."
        )
    return problems


def _check_training(cfg: DictConfig, hardware: Strategy, world_size: int, data: DataSource) -> None:
    """The backend's checks of the task, the rows of each batch one data-parallel rank trains on and the
    samples."""
    try:
        task = instantiate(cfg.task)
    except Exception:  # the training step on meta reports a task that cannot be built
        return
    batch_size = cfg.data.get("batch_size") or 1
    readers = hardware.data_parallel_size(world_size)
    if isinstance(data.train_set, IterableDataset):
        sample = next(iter(data.train_set), None)
    else:
        sample = data.train_set[0] if len(data.train_set) else None
    hardware.check_training(task, batch_size // readers if cfg.trainer.split_batches else batch_size, sample)


def _stream_problems(
    cfg: DictConfig, stream: Stream, hardware: Strategy | None, world_size: int
) -> list[str]:
    """What a streamed training set cannot do with these settings: end (it needs a number of steps), or
    give each of its readers (data-parallel processes x loader workers) data."""
    problems = []
    if cfg.trainer.max_steps is None:
        problems.append(
            f"trainer.max_steps=null with a streamed training set ({cfg.data._target_}): a stream has no end, so "
            "no epochs to count; set trainer.max_steps."
        )
    if cfg.trainer.overfit_batches:
        problems.append(
            f"trainer.overfit_batches={cfg.trainer.overfit_batches} with a streamed training set ({cfg.data._target_}): "
            "a stream has no first batches to go back to. Use the same data unstreamed (data.streaming=false)."
        )
    if cfg.trainer.eval_train_batches:
        problems.append(
            f"trainer.eval_train_batches={cfg.trainer.eval_train_batches} with a streamed training set "
            f"({cfg.data._target_}): a stream has no fixed sample to evaluate on. Set trainer.eval_train_batches=0, "
            "or use the same data unstreamed (data.streaming=false)."
        )
    processes = hardware.data_parallel_size(world_size) if hardware is not None else world_size
    try:
        stream.check_readers(processes * max(1, cfg.data.get("num_workers") or 0))
    except ConfigError as err:
        problems.append(str(err))
    return problems


def _run_user_code(node: str, node_cfg: DictConfig, doing: str, build: Callable[[], T]) -> T:
    """`build()`; an exception from the user's code under `node` (a corrupt or empty data file, a model
    that refuses its sizes) becomes a ConfigError naming the node, its target and the files it was given,
    before any rank starts."""
    try:
        return build()
    except ConfigError:
        raise
    except Exception as raised:
        err = raised.__cause__ if isinstance(raised, InstantiationException) and raised.__cause__ else raised
        if isinstance(err, ConfigError):
            raise err from None
        message = str(err).splitlines()[0][:300] if str(err) else "no message"
        files = [
            f"{node}.{key}={value}"
            for key, value in node_cfg.items()
            if isinstance(value, str) and any(word in str(key) for word in ("path", "file", "dir"))
        ]
        raise ConfigError(
            f"{node}: {node_cfg._target_} failed {doing}{' from ' + ', '.join(files) if files else ''} "
            f"({type(err).__name__}: {message}; the traceback is in the run's log). Check the settings under {node}"
            + (" and that the files are whole and in the format expected." if files else "."),
            details="".join(traceback.format_exception(err)),
        ) from err


def _step_problems(blueprint: Blueprint, hardware: Strategy | None, world_size: int) -> list[str]:
    """One training step on meta tensors (the real shapes, nothing computed): a model, data and task that
    do not fit together fail here, before launch, instead of in every rank. A task that reads values
    cannot run on meta tensors: that is not reported."""
    cfg = blueprint.cfg
    if problems := _positions_problems(cfg, blueprint.model, blueprint.data):
        return problems
    try:
        blueprint.training_step()
    except Exception as err:
        message = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        if "meta" in message.lower():
            return []
        return [
            f"one training step of {cfg.model._target_} on the first batch of {cfg.data._target_} with "
            f"{cfg.task._target_} fails ({type(err).__name__}: {message}). Make the model, data and task settings "
            "agree."
        ]
    return []


def _positions_problems(cfg: DictConfig, model: torch.nn.Module, data: DataSource) -> list[str]:
    """Samples that give each token's position in its document (`data.document_mask`, `data.packing`) need
    a model that attends within documents by them (`position_ids=`)."""
    sample = (
        None if isinstance(data.train_set, IterableDataset) or not len(data.train_set) else data.train_set[0]
    )
    if not isinstance(sample, dict) or POSITIONS not in sample or attends_within_documents(model):
        return []
    setting = "data.document_mask=true" if cfg.data.get("document_mask") else "data.packing=true"
    return [
        f"{setting} gives the model each token's position in its document (position_ids=), and "
        f"{cfg.model._target_}'s forward does not take it or does not attend within documents by it. Use model=gpt "
        "or a transformers causal LM whose attention follows position_ids (llama, qwen2, mistral, gpt2, ...), or "
        f"{setting.replace('true', 'false')}."
    ]


def _start_weights_problems(blueprint: Blueprint, hardware: Strategy | None, world_size: int) -> list[str]:
    """`checkpoint=`'s names and shapes against the model's on meta, from the files' headers (what the
    ranks' load checks again); a missing or damaged file is `_checkpoint_problems`'s."""
    cfg = blueprint.cfg
    if cfg.checkpoint is None or not Path(cfg.checkpoint).exists():
        return []
    try:
        check_against_model(blueprint.model, cfg.checkpoint, checkpoint_tensors(cfg.checkpoint), strict=True)
    except DamagedFileError:
        return []
    except (ValueError, FileNotFoundError) as err:
        return [f"checkpoint={cfg.checkpoint}: {err}"]
    return []


# The final metrics the loop reports beside the task's `eval/*`: the training loss and learning rate.
TRAINING_METRICS = ("train/loss", "train/lr")


def _objective_problems(blueprint: Blueprint, hardware: Strategy | None, world_size: int) -> list[str]:
    """`trainer.objective` must name a final metric: an `eval/` one the task reports (its names from
    its evaluation step on meta; not checked for a task that reads values), `train/loss`, `train/lr` or
    a `perf/` one. A callback's monitored metric must be an `eval/` one the task reports (callbacks read
    them after each evaluation)."""
    cfg = blueprint.cfg
    try:
        reported = blueprint.eval_metrics()
    except Exception:  # a task that reads values, or one that fails: the training step reports it
        reported = []
    problems = []
    objective = cfg.trainer.objective
    known = objective is None or objective in (*reported, *TRAINING_METRICS) or objective.startswith("perf/")
    if not known and not (objective.startswith("eval/") and not reported):
        problems.append(
            f"trainer.objective={objective}: the run reports no such metric; its final metrics are "
            f"{', '.join([*reported, *TRAINING_METRICS])} and perf/*. Name one of them, or null to return them "
            "all."
        )
    for node, node_cfg in callback_nodes(cfg):
        monitor = node_cfg.get("monitor")
        if monitor is not None and reported and monitor not in reported:
            problems.append(
                f"{node}.monitor={monitor}: the task reports no such eval metric; after each evaluation the "
                f"run has {', '.join(reported)}. Name one of them."
            )
    return problems


def _optimizer_problems(blueprint: Blueprint, hardware: Strategy | None, world_size: int) -> list[str]:
    """Build the optimizer over the (meta) model's parameters and the schedule over it, as the ranks
    will: their constructors check what the declared ranges do not (a `betas` of one value)."""
    cfg, model = blueprint.cfg, blueprint.model
    built = {}
    for node, build in (
        ("optimizer", lambda: build_optimizer(cfg, model)),
        ("scheduler", lambda: build_scheduler(cfg, built["optimizer"], 100)),
    ):
        try:
            built[node] = build()
        except Exception as raised:
            err = (
                raised.__cause__
                if isinstance(raised, InstantiationException) and raised.__cause__
                else raised
            )
            if isinstance(err, ConfigError):
                return [str(err)]
            message = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
            return [
                f"{node}: {cfg[node]._target_} refuses its settings ({type(err).__name__}: {message}). Fix them "
                f"under {node}."
            ]
    return []


# The checks of a training run's blueprint, in the order they are reported: each gets the blueprint, the
# built hardware (None: refused) and the number of ranks, and returns its problems.
WORLD_CHECKS: tuple[Callable[[Blueprint, Strategy | None, int], list[str]], ...] = (
    _strategy_problems,
    _step_problems,
    _objective_problems,
    _start_weights_problems,
    _optimizer_problems,
    _size_problems,
)


def _checkpoint_problems(cfg: DictConfig, hardware: Any) -> list[str]:
    """An inference task runs `checkpoint=` on `hardware=big_model`; training starts from `checkpoint=`
    (when given) on a training backend."""
    problems = []
    inference = is_inference(cfg.task._target_)
    if inference and not isinstance(hardware, BigModel):
        problems.append(
            f"task._target_={cfg.task._target_} is an inference task: it runs with hardware=big_model, which loads "
            "checkpoint= onto the devices. Add hardware=big_model (experiment=gpt_generate has it)."
        )
    if not inference and isinstance(hardware, BigModel):
        problems.append(
            f"hardware=big_model places a model for inference, but task._target_={cfg.task._target_} trains. Train "
            "with hardware=single_device, ddp, fsdp or deepspeed; run inference with an inference task "
            "(experiment=gpt_generate)."
        )
    if cfg.trainer.get("async_checkpoint") and not hardware.async_checkpoints:
        problems.append(
            f"trainer.async_checkpoint=true: {cfg.hardware._target_} writes its checkpoints itself, synchronously "
            "(DeepSpeed's engine). Use trainer.async_checkpoint=false with it."
        )
    if inference and cfg.checkpoint is None:
        problems.append(
            "checkpoint: an inference task needs the weights to run. Set checkpoint=<a model dir written by "
            "save_model>, e.g. outputs/runs/<run>/model."
        )
    if cfg.checkpoint is not None and not Path(cfg.checkpoint).exists():
        problems.append(
            f"checkpoint={cfg.checkpoint}: no such file or directory. Give a model dir written by save_model "
            "(outputs/runs/<run>/model) or a weights file."
        )
    elif cfg.checkpoint is not None:
        try:
            checkpoint_tensors(cfg.checkpoint)  # every file's header against its length
        except (DamagedFileError, FileNotFoundError) as err:
            problems.append(f"checkpoint={cfg.checkpoint}: {err}")
    return problems
