"""`runner --help`: the config groups with their options, then every key of the config the command line
composes, with its value, its type and a line on what it does.

A key's description is the first found of: the comment beside it (or on the lines above it) in the YAML
files that composed it, in the order Hydra read them; the `Args:` entry of the docstring of its node's
`_target_` (its class, the classes its `**kwargs` reach, or the function). Its type is the annotation of
that argument, or of the field of runner's typed config (`runner.config`). Runner's internal groups
(`schema/*`, `hydra/*`) are not listed.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from hydra._internal.hydra import Hydra
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig

from runner.build import locate
from runner.compose import CONFIG_NAME, command_hydra
from runner.config import FORMER_NAMES, Range, RunConfig
from runner.schemas import settings_of

INTERNAL_GROUPS = ("hydra", "schema")
SPECIAL_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")
USAGE = (
    "Usage: runner [group=option ...] [key=value ...]\n"
    "  -m: a sweep over comma-separated values (key=a,b); --config-dir DIR: your own groups and options;\n"
    "  plan=true: what the run would do, starting nothing; --cfg job: the composed YAML; --hydra-help: "
    "Hydra's own options\n"
    "  callbacks=[early_stopping,best_checkpoints]: several callbacks at once; "
    "+callbacks.NAME._target_=pkg.Class: your own\n"
    "  runner prepare-data [group=option ...] [key=value ...]: write the token shards data=tokens trains on\n"
    "  runner runs [DIR ...] [--state S] [--last N] [--metrics M,...]: the runs below outputs/ and their state\n"
    "  runner runs compare A B [--metrics M,...] [--out PNG]: the settings two runs differ in, their curves\n"
    "  runner export RUN_DIR --to hf OUT [--checkpoint DIR]: the run's model as a transformers model dir\n"
    "  runner join HOST:PORT: this node joins the launcher=elastic job whose first node serves HOST:PORT"
)


@dataclass
class Setting:
    """One key of the composed config as `--help` shows it."""

    key: str
    value: Any
    type: str = ""
    description: str = ""


@dataclass
class Section:
    """A top-level node: its group's chosen option, its `_target_` and what it is."""

    name: str
    option: str | None = None
    target: str | None = None
    description: str = ""
    settings: list[Setting] = field(default_factory=list)


def help_text(arguments: list[str], width: int = 100) -> str:
    """What `runner <arguments> --help` prints (`arguments` as given, the help flag among them)."""
    args = get_args_parser().parse_args(arguments)
    overrides = first_job(args.overrides) if args.multirun else args.overrides
    hydra = command_hydra(args.config_dir)
    try:
        cfg = hydra.compose_config(CONFIG_NAME, overrides, run_mode=RunMode.RUN)
        comments = _comments(hydra, overrides)
        groups = [g for g in hydra.list_all_config_groups() if not g.startswith(INTERNAL_GROUPS)]
        options = {g: hydra.config_loader.get_group_options(g, ObjectType.CONFIG) for g in groups}
    finally:
        GlobalHydra.instance().clear()
    choices = dict(cfg.hydra.runtime.choices)
    lines = [
        cfg.hydra.help.header.rstrip(),
        "",
        USAGE,
        "",
        "Config groups (group=option; * marks the chosen):",
    ]
    pad = max(map(len, groups), default=0) + 2
    for group in sorted(groups):
        shown = [o for o in options[group] if o not in FORMER_NAMES.get(group, {}) or o == choices.get(group)]
        marked = [f"*{o}" if o == choices.get(group) else o for o in shown]
        lines += textwrap.wrap(
            " ".join(marked), width, initial_indent=f"  {group:<{pad}}", subsequent_indent=" " * (pad + 2)
        )
    lines += ["", "Settings (key=value  type: what it does):"]
    for section in sections(cfg, choices, comments):
        lines.append("")
        title = section.name + (f" ({section.name}={section.option})" if section.option else "")
        title += f": {section.target}" if section.target else ""
        lines.append(title)
        if section.description:
            lines += textwrap.wrap(section.description, width, initial_indent="  ", subsequent_indent="  ")
        for setting in section.settings:
            head = f"  {setting.key}={_value_text(setting.value)}"
            lines.append(head + (f"  ({setting.type})" if setting.type else ""))
            if setting.description:
                lines += textwrap.wrap(
                    setting.description, width, initial_indent=" " * 6, subsequent_indent=" " * 6
                )
    return "\n".join(lines)


def first_job(overrides: list[str]) -> list[str]:
    """A sweep's overrides (`-m`) as its first job has them: each list of values its first; a range that
    a sweeper samples (`interval(...)`) left at the config's value."""
    job = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_sweep_override():
            job.append(override.input_line or "")
        elif override.is_discrete_sweep():
            job.append(f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}")
    return job


def sections(cfg: DictConfig, choices: Mapping[str, str], comments: Mapping[str, str]) -> list[Section]:
    """The composed config (without `hydra`) as sections: one per top-level node, then the top-level
    keys that hold a value."""
    found: list[Section] = []
    loose = Section("run")
    hints = _field_hints(RunConfig)
    for name in cfg:
        name = str(name)
        node = cfg._get_node(name)
        if name == "hydra":
            continue
        if not isinstance(node, DictConfig):
            described = (hints.get(name), field_comments(RunConfig).get(name, ""))
            loose.settings.append(_setting(name, node, described, comments))
            continue
        target = node.get("_target_")
        described = _target_settings(target)
        section = Section(
            name,
            option=choices.get(name),
            target=target,
            description=comments.get(name) or _summary(target),
        )
        section.settings = list(_settings(name, node, hints.get(name), described, comments))
        found.append(section)
    if loose.settings:
        found.append(loose)
    return found


def _settings(
    prefix: str,
    node: DictConfig,
    hint: Any,
    described: Mapping[str, tuple[Any, str]],
    comments: Mapping[str, str],
) -> Iterator[Setting]:
    """The leaves under `node`: a nested node without a `_target_` of its own is walked with its
    dataclass's field types; one with a `_target_` with its target's arguments."""
    fields = _field_hints(hint)
    notes = field_comments(hint) if _is_dataclass(hint) else {}
    for name in node:
        name = str(name)
        if name in SPECIAL_KEYS:
            continue
        key = f"{prefix}.{name}"
        child = node._get_node(name)
        if isinstance(child, DictConfig) and len(child) > 0 and not child._is_missing():
            target = child.get("_target_")
            inner = _target_settings(target) if target else {}
            yield from _settings(key, child, fields.get(name), inner, comments)
            continue
        yield _setting(key, child, described.get(name) or (fields.get(name), notes.get(name, "")), comments)


def _setting(key: str, node: Any, described: tuple[Any, str], comments: Mapping[str, str]) -> Setting:
    """`key` with its value, the type `described` gives and the first description found."""
    annotation, text = described
    value = node._value() if not isinstance(node, (DictConfig, ListConfig)) else node
    return Setting(key, value, type_text(annotation), comments.get(key) or text)


def type_text(hint: Any) -> str:
    """An annotation as help writes it: `int >= 1 | null`, `list[str]`, `'a' | 'b'`; "" where unknown."""
    if hint is None or hint is Any or hint is inspect.Parameter.empty:
        return ""
    origin = get_origin(hint)
    if origin is Annotated:
        base, *metadata = get_args(hint)
        bounds = next((m for m in metadata if isinstance(m, Range)), None)
        text = type_text(base)
        return f"{text} {bounds}" if bounds is not None and text else text
    if origin in (Union, types.UnionType):
        kinds = [type_text(arg) for arg in get_args(hint) if arg is not type(None)]
        optional = type(None) in get_args(hint)
        return " | ".join([k or "any" for k in kinds] + (["null"] if optional else []))
    if origin is Literal:
        return " | ".join(str(v) for v in get_args(hint))
    if origin in (list, tuple, Sequence) or (origin is not None and _is_sequence(origin)):
        inner = [type_text(arg) for arg in get_args(hint) if arg is not Ellipsis]
        return f"list[{inner[0]}]" if len(inner) == 1 and inner[0] else "list"
    if origin in (dict, Mapping) or (origin is not None and _is_mapping(origin)):
        return "dict"
    if isinstance(hint, type) and issubclass(hint, Enum):
        return " | ".join(str(member.value) for member in hint)
    if isinstance(hint, type):
        return "float" if hint is float else hint.__name__
    return str(hint).replace("typing.", "")


def docstring_args(obj: Any) -> dict[str, str]:
    """The `Args:` entries of `obj`'s docstring (Google style: `name (type): text`, continued on more
    indented lines), as name -> text on one line."""
    doc = inspect.getdoc(obj) or ""
    found: dict[str, str] = {}
    lines = doc.splitlines()
    for index, line in enumerate(lines):
        if not re.match(r"^\s*(Args|Arguments|Parameters)\b[^:]*:\s*$", line):
            continue
        header = _indent(line)
        entry_indent: int | None = None
        name: str | None = None
        for body in lines[index + 1 :]:
            if not body.strip():
                continue
            indent = _indent(body)
            if indent <= header:
                break
            if entry_indent is None:
                entry_indent = indent
            match = re.match(r"^\s*\**([A-Za-z_]\w*)\s*(\([^)]*\))?\s*:\s*(.*)$", body)
            if indent == entry_indent and match:
                name = match.group(1)
                found[name] = match.group(3).strip()
            elif name is not None and indent > entry_indent:
                found[name] = f"{found[name]} {body.strip()}".strip()
    return found


def yaml_comments(text: str, package: str = "") -> dict[str, str]:
    """The comments of a YAML config file: the comment after `key:` (or on the lines just above it) by
    the key's dotted path under `package`; the file's opening comment (before its first line of YAML)
    by `package` itself. The `defaults` list and `# @package` lines describe nothing."""
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    in_defaults = False
    for name, indent, rest, above in _key_lines(text):
        if name is None:
            found[package] = above
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == 0:
            in_defaults = name == "defaults"
        stack.append((indent, name))
        comment = _trailing_comment(rest) or above
        if comment and not in_defaults:
            found.setdefault(".".join(part for part in [package, *(n for _, n in stack)] if part), comment)
    return found


def _key_lines(text: str) -> Iterator[tuple[str | None, int, str, str]]:
    """Each `key:` line of a YAML file: (key, its indent, what follows the colon, the comment on the lines
    just above it); first, where the file opens with a comment, (None, 0, "", that comment)."""
    above: list[str] = []
    opening = True
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if not stripped.lstrip("#").strip().startswith("@package"):
                above.append(stripped.lstrip("#").strip())
            continue
        if opening and (above or stripped):
            if above:
                yield None, 0, "", " ".join(above)
            above, opening = [], False
        match = re.match(r"^([\w./-]+)\s*:(.*)$", stripped)
        if match is not None:  # not a blank line nor a list item
            yield match.group(1), _indent(line), match.group(2), " ".join(above)
        above = []


def _comments(hydra: Hydra, overrides: list[str]) -> dict[str, str]:
    """The comments of every YAML file the composition read, by dotted key: the first file's, then
    those of the files that set the key again, each named (`experiment/mine: ...`)."""
    loader = hydra.config_loader
    found: dict[str, str] = {}
    for default in loader.compute_defaults_list(CONFIG_NAME, overrides, RunMode.RUN).defaults:
        path, package = default.config_path, default.package or ""
        if path is None or package.startswith("hydra") or path.startswith(INTERNAL_GROUPS):
            continue
        text = _source_text(loader.get_sources(), path)
        if text is not None:
            for key, comment in yaml_comments(text, package).items():
                found[key] = f"{found[key]}; {path}: {comment}" if key in found else comment
    return found


def _source_text(sources: Sequence[Any], config_path: str) -> str | None:
    """The text of `<config_path>.yaml` in the first search path entry that holds it (None for a
    structured config)."""
    for source in sources:
        if not source.is_config(config_path):
            continue
        name = f"{config_path}.yaml"
        if source.scheme() == "file":
            return (Path(source.path) / name).read_text(encoding="utf-8")
        if source.scheme() == "pkg":
            return resources.files(source.path).joinpath(name).read_text(encoding="utf-8")
        return None
    return None


def _target_settings(target: str | None) -> dict[str, tuple[Any, str]]:
    """A `_target_`'s arguments: name -> (annotation, its docstring's text); empty where the target
    does not import (the run's own checks say why)."""
    if not target:
        return {}
    try:
        obj = locate(target)
    except ImportError:
        return {}
    docs: dict[str, str] = {}
    try:
        if isinstance(obj, type):
            parameters = settings_of(obj)
            for klass in reversed(obj.__mro__):
                docs.update(docstring_args(klass))
                if "__init__" in vars(klass):
                    docs.update(docstring_args(vars(klass)["__init__"]))
        else:
            hints = get_type_hints(obj, include_extras=True)
            parameters = [
                p.replace(annotation=hints.get(p.name, Any))
                for p in inspect.signature(obj).parameters.values()
            ]
            docs = docstring_args(obj)
    except (NameError, TypeError, ValueError):  # annotations that do not resolve, a builtin's signature
        return {}
    return {p.name: (p.annotation, docs.get(p.name, "")) for p in parameters}


def _summary(target: str | None) -> str:
    """The first sentence of a `_target_`'s docstring ("" where there is none or it does not import)."""
    try:
        doc = inspect.getdoc(locate(target)) if target else None
    except ImportError:
        return ""
    first = (doc or "").split("\n\n")[0].replace("\n", " ")
    return first.split(". ")[0].rstrip(".") + "." if first else ""


@cache
def field_comments(cls: type) -> dict[str, str]:
    """The comments of a dataclass's fields in its source: the one after the field, or the comment lines
    just above it."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    body = ast.parse(textwrap.dedent("".join(lines))).body[0]
    found: dict[str, str] = {}
    for statement in body.body if isinstance(body, ast.ClassDef) else []:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        span = lines[statement.lineno - 1 : statement.end_lineno]
        trailing = [comment for line in span if (comment := _trailing_comment(line))]
        above = []
        for line in reversed(lines[: statement.lineno - 1]):
            if not line.strip().startswith("#"):
                break
            above.insert(0, line.strip().lstrip("#").strip())
        if text := " ".join(trailing) or " ".join(above):
            found[statement.target.id] = text
    return found


def _field_hints(cls: Any) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True) if _is_dataclass(cls) else {}


def _is_dataclass(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _is_sequence(origin: Any) -> bool:
    return isinstance(origin, type) and issubclass(origin, Sequence) and not issubclass(origin, str)


def _is_mapping(origin: Any) -> bool:
    return isinstance(origin, type) and issubclass(origin, Mapping)


def _value_text(value: Any) -> str:
    """A value as an override writes it: `null`, `true`, `[a, b]`, `{k: v}`."""
    if isinstance(value, DictConfig):
        return "{" + ", ".join(f"{k}: {_value_text(value._get_node(k)._value())}" for k in value) + "}"
    if isinstance(value, ListConfig):
        return "[" + ", ".join(_value_text(value._get_node(i)._value()) for i in range(len(value))) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def _trailing_comment(rest: str) -> str:
    """The comment after a YAML value (a `#` after a space, outside quotes)."""
    quote: str | None = None
    for index, char in enumerate(rest):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or rest[index - 1].isspace()):
            return rest[index + 1 :].strip()
    return ""


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
