"""The structured configs of the typed groups, derived from the classes their options build.

A hardware, precision, launcher or tracker option's settings are declared once: as its class's
constructor arguments (type, default, `Range`). `schema_of` turns a constructor into the dataclass Hydra
checks the option's YAML and overrides against at compose time (a typo or a wrong type fails naming the
key); `runner.validate` checks the ranges before launch. An argument marked `PythonOnly` is no setting.
The command composes against these schemas written out as source (`runner/group_schemas.py`, by
`python -m runner.schemas`), which import none of the classes: a refusal does not wait for torch.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import yaml
from hydra.utils import get_object

from runner.config import (
    CONF_DIR,
    Exists,
    HardwareConfig,
    LauncherConfig,
    NotASetting,
    PrecisionConfig,
    TrackerConfig,
    declared_paths,
)
from runner.hardware import DDP, FSDP, DeepSpeed, SingleDevice, TensorParallel
from runner.hardware.big_model import BigModel
from runner.hardware.xla import XLA
from runner.launchers import LocalLauncher
from runner.launchers.elastic import ElasticLauncher
from runner.launchers.kubernetes import KubernetesLauncher
from runner.launchers.ray import RayLauncher
from runner.launchers.slurm import SlurmLauncher
from runner.precision import Float8Precision, Float16MixedPrecision, MixedPrecision, Precision
from runner.trackers import MLflowTracker, TensorBoardTracker, WandbTracker

# group -> option (conf/<group>/<option>.yaml) -> the class it builds (None: builds nothing).
OPTIONS: dict[str, dict[str, type | None]] = {
    "hardware": {
        "single_device": SingleDevice,
        "ddp": DDP,
        "fsdp": FSDP,
        "deepspeed": DeepSpeed,
        "tensor_parallel": TensorParallel,
        "xla": XLA,
        "big_model": BigModel,
    },
    "precision": {
        "fp32": Precision,
        "bf16": MixedPrecision,
        "fp16": Float16MixedPrecision,
        "fp8": Float8Precision,
    },
    "launcher": {
        "local": LocalLauncher,
        "elastic": ElasticLauncher,
        "slurm": SlurmLauncher,
        "ray": RayLauncher,
        "kubernetes": KubernetesLauncher,
    },
    "tracker": {
        "mlflow": MLflowTracker,
        "tensorboard": TensorBoardTracker,
        "wandb": WandbTracker,
        "none": None,
    },
}
BASES: dict[str, type] = {
    "hardware": HardwareConfig,
    "precision": PrecisionConfig,
    "launcher": LauncherConfig,
    "tracker": TrackerConfig,
}


def settings_of(cls: type) -> list[inspect.Parameter]:
    """The settings `cls(...)` takes: its constructor's named arguments, and those of the base classes its
    `**kwargs` reach, each with its resolved annotation; not those marked `PythonOnly`."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or klass is object:
            continue
        hints = get_type_hints(init, include_extras=True)
        parameters = list(inspect.signature(init).parameters.values())[1:]  # without self
        for parameter in parameters:
            if parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                continue
            hint = hints.get(parameter.name, Any)
            if not _python_only(hint):
                found.setdefault(parameter.name, parameter.replace(annotation=hint))
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return list(found.values())


@cache
def schema_of(cls: type, base: type) -> type:
    """The structured config of the settings `cls` takes, a subclass of the group's `base` whose
    `_target_` is `cls`."""
    fields: list[tuple[str, Any, Any]] = []
    for parameter in settings_of(cls):
        default = parameter.default
        if default is inspect.Parameter.empty:
            default = dataclasses.MISSING
        if isinstance(default, (list, tuple, dict)):
            default = dataclasses.field(default_factory=_copy_of(default))
        else:
            default = dataclasses.field(default=default)
        fields.append((parameter.name, _setting_type(parameter.annotation), default))
    target = dataclasses.field(default=f"{cls.__module__}.{cls.__qualname__}")
    target_type = get_type_hints(base)["_target_"]  # the group's: `tracker._target_: null` turns it off
    schema = dataclasses.make_dataclass(
        _schema_name(cls), [("_target_", target_type, target), *fields], bases=(base,)
    )
    return schema


def _schema_name(cls: type) -> str:
    return f"{cls.__name__}Schema"


def schemas() -> dict[str, dict[str, type]]:
    """group -> option -> its structured config."""
    return {
        group: {
            option: BASES[group] if cls is None else schema_of(cls, BASES[group])
            for option, cls in options.items()
        }
        for group, options in OPTIONS.items()
    }


UNTYPED_GROUPS = ("model", "data", "task", "optimizer", "scheduler")  # no schema: their `_target_`s' own


def path_settings() -> dict[str, dict[str, Exists]]:
    """`_target_` -> its settings that name a path which must exist (`Exists`), of what the untyped groups'
    shipped options build (classes: a function such as `data=digits` names its own files), under the name
    their YAML gives and the class's own."""
    found: dict[str, dict[str, Exists]] = {}
    for group in UNTYPED_GROUPS:
        for option in sorted((CONF_DIR / group).glob("*.yaml")):
            target = (yaml.safe_load(option.read_text()) or {}).get("_target_")
            built = get_object(target) if isinstance(target, str) else None
            if isinstance(built, type) and (declared := declared_paths(built)):
                found[target] = found[f"{built.__module__}.{built.__qualname__}"] = declared
    return dict(sorted(found.items()))


GENERATED = Path(__file__).with_name("group_schemas.py")
HEADER = '''"""The structured configs of the typed groups, as `runner.schemas` derives them from the constructors of
the classes their options build, written out so that composing a command imports none of those classes
(nor torch): a typo is refused before torch loads. Generated by `python -m runner.schemas`; a test keeps it
equal to the derivation. Do not edit by hand."""

from dataclasses import dataclass, field
from typing import Annotated, Any

from hydra.core.config_store import ConfigStore

from runner.config import (
    Exists,
    HardwareConfig,
    LauncherConfig,
    PrecisionConfig,
    Range,
    RunConfig,
    RunnerLauncherConfig,
    RunnerSweeperConfig,
    TrackerConfig,
)
'''
FOOTER = '''

def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (before composing)."""
    store = ConfigStore.instance()
    store.store(name="runner_schema", node=RunConfig)
    store.store(group="hydra/sweeper", name="runner", node=RunnerSweeperConfig, provider="runner")
    store.store(group="hydra/launcher", name="runner", node=RunnerLauncherConfig, provider="runner")
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            store.store(group=f"schema/{group}", name=name, node=node)
'''


def source() -> str:
    """The text of `runner/group_schemas.py`: each derived schema as a dataclass literal, and `SCHEMAS`
    (group -> option -> schema) with `register_configs`."""
    imports: set[tuple[str, str]] = set()
    classes, table = [], []
    for group, options in schemas().items():
        table.append(f"    {json.dumps(group)}: {{")
        for option, schema in options.items():
            table.append(f"        {json.dumps(option)}: {schema.__name__},")
            if schema is not BASES[group]:
                classes.append(_class_source(schema, BASES[group], imports))
        table.append("    },")
    extra = "".join(f"from {module} import {name}\n" for module, name in sorted(imports))
    return (
        HEADER
        + extra
        + "\n\n"
        + "\n\n".join(classes)
        + "\n\n# group -> option -> its structured config\nSCHEMAS: dict[str, dict[str, type]] = {\n"
        + "\n".join(table)
        + "\n}\n"
        + _paths_source(imports)
        + FOOTER
    )


def _paths_source(imports: set[tuple[str, str]]) -> str:
    lines = [
        "\n# `_target_` -> its settings that name a path which must exist: checked as the command composes",
        "PATH_SETTINGS: dict[str, dict[str, Exists]] = {",
    ]
    for target, declared in path_settings().items():
        lines.append(f"    {json.dumps(target)}: {{")
        lines += [f"        {json.dumps(key)}: {_value_source(mark, imports)}," for key, mark in declared.items()]
        lines.append("    },")
    return "\n".join([*lines, "}\n"])


def _class_source(schema: type, base: type, imports: set[tuple[str, str]]) -> str:
    lines = ["@dataclass", f"class {schema.__name__}({base.__name__}):"]
    for f in dataclasses.fields(schema):
        if f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            default = f"field(default_factory={f'lambda: {made!r}' if made else type(made).__name__})"
        else:
            default = _value_source(f.default, imports)
        lines.append(f"    {f.name}: {_type_source(f.type, imports)} = {default}")
    return "\n".join(lines) + "\n"


def _type_source(hint: Any, imports: set[tuple[str, str]]) -> str:
    """`hint` as source that evaluates to an equal type (the imports it needs added to `imports`)."""
    if isinstance(hint, str):  # a base's annotation under `from __future__ import annotations`
        return hint
    if hint is Any:
        return "Any"
    if get_origin(hint) in (Union, types.UnionType):
        return " | ".join(_type_source(arg, imports) for arg in get_args(hint))
    if get_origin(hint) is Annotated:
        kind, *marks = get_args(hint)
        return f"Annotated[{_type_source(kind, imports)}, {', '.join(_value_source(m, imports) for m in marks)}]"
    if get_origin(hint) in (list, dict):
        return f"{get_origin(hint).__name__}[{', '.join(_type_source(arg, imports) for arg in get_args(hint))}]"
    if hint is type(None):
        return "None"
    if hint.__module__ != "builtins":
        imports.add((hint.__module__, hint.__qualname__))
    return hint.__qualname__


def _value_source(value: Any, imports: set[tuple[str, str]]) -> str:
    if isinstance(value, Enum):
        imports.add((type(value).__module__, type(value).__qualname__))
        return f"{type(value).__qualname__}.{value.name}"
    if dataclasses.is_dataclass(value):  # a `Range`: its bounds that are set
        given = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if getattr(value, f.name) is not None}
        return f"{type(value).__qualname__}({', '.join(f'{k}={v!r}' for k, v in given.items())})"
    return json.dumps(value) if isinstance(value, str) else repr(value)  # a string in double quotes


def _python_only(hint: Any) -> bool:
    return get_origin(hint) is Annotated and any(isinstance(m, NotASetting) for m in hint.__metadata__)


def _setting_type(hint: Any) -> Any:
    """`hint` as a structured config holds it: Optional and `Range` kept, an abstract mapping or sequence
    as a dict or list, a union of several types (`str | dict`) as Any."""
    if get_origin(hint) in (Union, types.UnionType):
        kinds = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(kinds) > 1:
            return Any
        inner = _setting_type(kinds[0])
        return inner if inner is Any or len(kinds) == len(get_args(hint)) else inner | None
    origin = get_origin(hint)
    if origin in (Mapping, MutableMapping, dict):
        return dict[str, Any]
    if origin in (Sequence, MutableSequence, list, tuple):
        return list[_setting_type(get_args(hint)[0])] if get_args(hint) else list[Any]
    return hint


def _copy_of(default: list | tuple | dict) -> Any:
    """A default factory: a fresh copy of a container default each time (as a list, for a tuple)."""
    return (lambda: dict(default)) if isinstance(default, dict) else (lambda: list(default))


if __name__ == "__main__":
    GENERATED.write_text(source())
