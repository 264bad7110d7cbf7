"""Checks on the composed config that run before anything is built, spawned or queued."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from runner.build import build_data, build_on_meta, is_inference, locate
from runner.errors import ConfigError
from runner.hardware.base import Strategy
from runner.hardware.big_model import BigModel
from runner.weights import DamagedFileError, checkpoint_tensors

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
OPTIONAL_NODES = ("tracker",)  # `_target_: null` turns them off
# Nodes cheap to build in the launching process; building them checks their values (devices, files).
BUILT_NODES = ("hardware", "launcher", "data")
_HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


@dataclass(frozen=True)
class Built:
    """What validation built in the launching process, passed on so that nothing is built twice there."""

    hardware: Strategy
    launcher: Any  # a runner.launchers.Launcher (a layer above this one)


def validate(cfg: DictConfig) -> Built:
    """The hardware and the launcher, built and checked; a ConfigError whose message lists every problem
    found, one paragraph each, if there is any."""
    problems = _missing_values(cfg) or [
        *_schema_problems(cfg),
        *_target_problems(cfg),
        *_trainer_problems(cfg.trainer),
    ]
    built: dict[str, Any] = {}
    if not problems:
        problems = _build_problems(cfg, built)
    if problems:
        raise ConfigError("\n\n".join(problems))
    return Built(hardware=built["hardware"], launcher=built["launcher"])


def _missing_values(cfg: DictConfig) -> list[str]:
    return [
        f"{key}: no value was given (it is '???' in its YAML). Set it on the command line, e.g. `{key}=...`."
        for key in sorted(OmegaConf.missing_keys(cfg))
    ]


def _schema_problems(cfg: DictConfig) -> list[str]:
    """Keys added with `+key=value` to a typed group pass composition; they are still not settings."""
    problems = []
    for node in TYPED_NODES:
        fields = [f.name for f in dataclasses.fields(OmegaConf.get_type(cfg[node]))]
        problems += [
            f"{node}.{key}: not a setting of {node} (its settings are {', '.join(fields)}). Remove it."
            for key in cfg[node]
            if key not in fields
        ]
    return problems


def _target_problems(cfg: DictConfig) -> list[str]:
    problems = []
    for node in TARGET_NODES:
        target = cfg[node].get("_target_")
        if target is None and node in OPTIONAL_NODES:
            continue
        try:
            obj = locate(target)
        except ImportError as err:
            problems.append(
                f"{node}._target_={target!r} cannot be imported ({err}). Check the spelling, or install the "
                f"package that provides it; `python -m runner --help` lists the {node} options that ship "
                "with runner."
            )
            continue
        problems += _argument_problems(node, obj, cfg[node])
    return problems


def _argument_problems(node: str, obj: Any, node_cfg: DictConfig) -> list[str]:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return []
    arguments = {k: v for k, v in node_cfg.items() if k not in _HYDRA_KEYS}
    try:
        signature.bind_partial(**arguments)
    except TypeError as err:
        names = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        return [
            f"{node}: {node_cfg._target_} does not accept these settings ({err}). "
            f"Its parameters are: {', '.join(names)}. Fix the key in your YAML or on the command line."
        ]
    return []


def _trainer_problems(trainer: DictConfig) -> list[str]:
    problems = []
    if trainer.max_steps is None and trainer.max_epochs is None:
        problems.append("trainer.max_steps and trainer.max_epochs are both null: set one of them.")
    for key, minimum in (
        ("max_steps", 1),
        ("max_epochs", 1),
        ("log_every", 1),
        ("eval_every", 0),
        ("gradient_accumulation_steps", 1),
        ("checkpoint_every", 0),
        ("keep_checkpoints", 1),
    ):
        value = trainer[key]
        if value is not None and value < minimum:
            problems.append(f"trainer.{key}={value}: must be >= {minimum}.")
    if trainer.max_grad_norm is not None and trainer.max_grad_norm <= 0:
        problems.append(
            f"trainer.max_grad_norm={trainer.max_grad_norm}: must be > 0, or null for no clipping."
        )
    return problems


def _build_problems(cfg: DictConfig, built: dict[str, Any]) -> list[str]:
    """Build the hardware, the launcher and the data source into `built`: their constructors check what
    only they know (process counts against the GPUs here, files that must exist); reading the data happens
    in the ranks. Then ask the hardware whether it can run the precision."""
    problems = []
    for node in BUILT_NODES:
        try:
            built[node] = instantiate(cfg[node])
        except InstantiationException as err:
            if not isinstance(err.__cause__, ConfigError):
                raise
            problems.append(str(err.__cause__))
    if "hardware" in built:
        try:
            built["hardware"].setup_precision(instantiate(cfg.precision))
        except ConfigError as err:
            problems.append(str(err))
        problems += _checkpoint_problems(cfg, built["hardware"])
    return problems


def validate_for_world(cfg: DictConfig, world_size: int, hardware: Strategy) -> None:
    """The checks that need the number of ranks the launcher will start (ConfigError listing all)."""
    problems = []
    batch_size = cfg.data.get("batch_size")
    if cfg.trainer.split_batches and batch_size and batch_size % world_size:
        problems.append(
            f"trainer.split_batches=true: data.batch_size={batch_size} is the global batch and must split evenly "
            f"over the {world_size} processes. Use a multiple of {world_size} (e.g. "
            f"{batch_size - batch_size % world_size or world_size}), or trainer.split_batches=false for "
            f"{batch_size} per process."
        )
    if world_size > 1 and not is_inference(cfg.task._target_):
        data = build_data(cfg)
        try:
            hardware.check_model(build_on_meta(cfg, data), world_size)
        except ConfigError as err:
            problems.append(str(err))
        eval_size = len(data.eval_set)
        if eval_size < world_size:
            problems.append(
                f"the eval set has {eval_size} sample(s), fewer than the {world_size} processes: each process needs "
                "at least one to evaluate. Hold out more data (e.g. a larger data.eval_fraction) or run fewer "
                "processes."
            )
    if problems:
        raise ConfigError("\n\n".join(problems))


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
            "with hardware=cpu, multi_gpu, fsdp or deepspeed; run inference with an inference task "
            "(experiment=gpt_generate)."
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
