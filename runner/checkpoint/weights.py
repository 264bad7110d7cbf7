"""Model weights as files: safetensors (or torch) shards with an index, read back tensor by tensor, and
loaded into a model by name (checked first; tied weights stay tied)."""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from runner.checkpoint.files import atomic_directory, load_torch, save_torch
from runner.errors import ConfigError
from runner.files import replacing

log = logging.getLogger(__name__)

SAFE_NAME, TORCH_NAME = "model.safetensors", "pytorch_model.bin"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "10GB", "500MB", "2GiB"."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if match is None:
        raise ValueError(
            f"max_shard_size={size!r}: expected bytes as an int or a string like '10GB' or '500MB'."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def distinct_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` without the names that alias an earlier tensor (tied weights are stored once)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().cpu().contiguous()
    return out


def without_frozen(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (of `model`, by its names) without the parameters that do not require grad (under
    any of their names); buffers kept."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {name: tensor for name, tensor in state_dict.items() if name not in frozen}


def write_weights(
    state_dict: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str, safe_serialization: bool
) -> list[str]:
    """Write `state_dict` into `directory` as one file or as shards with an index; return the file names."""
    tensors = distinct_tensors(state_dict)
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    base = SAFE_NAME if safe_serialization else TORCH_NAME
    stem, suffix = base.rsplit(".", 1)
    names = (
        [base]
        if len(shards) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{suffix}" for i in range(len(shards))]
    )
    for shard, name in zip(shards, names, strict=True):
        if safe_serialization:
            save_file(shard, directory / name, metadata={"format": "pt"})
        else:
            save_torch(shard, directory / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {key: name for shard, name in zip(shards, names, strict=True) for key in shard},
        }
        (directory / f"{base}.index.json").write_text(json.dumps(index, indent=1))
    return names


def save_model_files(
    state_dict: dict[str, torch.Tensor],
    save_directory: str | Path,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> None:
    """Write a model's weights to `save_directory` atomically (see `write_weights`)."""
    with atomic_directory(Path(save_directory)) as staging:
        write_weights(state_dict, staging, max_shard_size, safe_serialization)


def save_object(obj: Any, path: Path, safe_serialization: bool = False) -> None:
    """Write `obj` to `path` whole or not at all (`replacing`): `torch.save`, or safetensors for
    a dict of tensors with `safe_serialization` (`Accelerator.save`)."""
    with replacing(path) as staging:
        if safe_serialization:
            save_file(distinct_tensors(obj), staging)
        else:
            save_torch(obj, staging)


# safetensors' dtype names
_SAFE_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """A tensor in a safetensors file, read on demand straight into fresh memory (no mapping, no copy)."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read(self) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype)
        if tensor.numel():
            with open(self.file, "rb", buffering=0) as f:
                f.seek(self.offset)
                got = f.readinto(tensor.reshape(-1).view(torch.uint8).numpy())
            if got != tensor.nbytes:  # the file shrank since its header was read
                raise DamagedFileError(f"{self.file} ended after {got} of a tensor's {tensor.nbytes} bytes.")
        return tensor


class DamagedFileError(ConfigError):
    """A weights file whose bytes do not add up to what its header describes."""


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Where each tensor of a safetensors file lies, from its header alone, checked against the file's
    length: a truncated or damaged file raises DamagedFileError naming it, instead of being read as if whole."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            if not 2 <= header_size <= size - 8:
                raise ValueError(f"its header claims {header_size} bytes of a {size}-byte file")
            header = json.loads(f.read(header_size))
        header.pop("__metadata__", None)
        stored = {}
        for name, entry in header.items():
            dtype, shape = _SAFE_DTYPES[entry["dtype"]], tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            nbytes = math.prod(shape) * dtype.itemsize
            if end - begin != nbytes or not 0 <= begin <= end <= size - 8 - header_size:
                raise ValueError(
                    f"tensor {name!r} needs bytes {begin}-{end} of {size - 8 - header_size} stored"
                    + ("" if end - begin == nbytes else f" and should have {nbytes}")
                )
            stored[name] = StoredTensor(path, 8 + header_size + begin, dtype, shape)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise DamagedFileError(
            f"{path} is not a whole safetensors file ({str(err).splitlines()[0][:200]}): it was cut short or "
            "damaged after it was written. Use an intact copy."
        ) from err
    return stored


def weight_files(checkpoint: str | Path) -> list[Path]:
    """The weight files of a checkpoint: a file, a directory holding one file or shards with an index, or a
    run's dir (its final weights, `model/`)."""
    path = Path(checkpoint)
    if path.is_file():
        return [path]
    if path.is_dir() and (path / "model").is_dir() and not any(path.glob("*.safetensors")):
        path = path / "model"
    if path.is_dir():
        for base in (SAFE_NAME, TORCH_NAME):
            if (path / f"{base}.index.json").is_file():
                weight_map = json.loads((path / f"{base}.index.json").read_text())["weight_map"]
                return [path / shard for shard in dict.fromkeys(weight_map.values())]
            if (path / base).is_file():
                return [path / base]
        raise FileNotFoundError(f"{path} holds no {SAFE_NAME}, {TORCH_NAME} or an index of their shards.")
    raise FileNotFoundError(f"no such weights file or directory: {path}")


def read_weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file (.safetensors, or a torch file read with weights_only), or of a
    directory holding one such file or shards with an index."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(checkpoint):
        state.update(load_file(path) if path.suffix == ".safetensors" else load_torch(path))
    return state


# ------------------------------------------------------------------------------------ into a model


def load_weights(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    frozen_optional: bool = False,
) -> None:
    """Load a weights file or directory (see `weight_files`) into `model`, each tensor where the model's is
    (the CPU for meta tensors), in place where device and dtype agree. Every name and shape is checked
    first (`check_against_model`): on a mismatch nothing is loaded. `frozen_optional`: the checkpoint may
    leave out frozen parameters (a PEFT model's base), which keep their values."""
    place_weights(model, checkpoint_tensors(checkpoint), checkpoint, dtype, strict, frozen_optional)


def place_weights(
    model: nn.Module,
    sources: dict[str, StoredTensor | torch.Tensor],
    checkpoint: Any,
    dtype: torch.dtype | None = None,
    strict: bool = True,
    frozen_optional: bool = False,
) -> None:
    """`load_weights` of tensors at hand (`sources`, by name; `checkpoint`: where they are from)."""
    for name in check_against_model(model, checkpoint, sources, strict, frozen_optional):
        del sources[name]
    current, aliases = dict(named_tensors(model, True)), tensor_aliases(model)
    for name, source in sources.items():
        place_tensor(model, name, read_tensor(source, dtype), None, current, aliases)


def place_tensor(
    model: nn.Module,
    name: str,
    tensor: torch.Tensor,
    target: torch.device | None,
    current: Mapping[str, torch.Tensor],
    aliases: Mapping[str, list[str]],
) -> None:
    """Make `tensor` the model's `name` (and its aliases) on `target` (None: where the model's tensor is; the
    CPU for a meta one): copied in place when device and dtype agree (optimizers and ties keep their
    tensor), else one new Parameter or buffer for all its names (ties stay ties)."""
    own = current[name]
    target = own.device if target is None else target
    if target.type == "meta":
        target = torch.device("cpu")
    if own.device == target and own.dtype == tensor.dtype:
        with torch.no_grad():
            own.copy_(tensor)
        return
    tensor = tensor.to(target)
    if isinstance(own, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=own.requires_grad)
    for alias in aliases.get(name, [name]):
        set_module_tensor(model, alias, tensor)


def named_tensors(model: nn.Module, with_aliases: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=not with_aliases)
    yield from model.named_buffers(remove_duplicate=not with_aliases)


def tensor_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each tensor's first name to all its names (tied weights have several)."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, tensor in named_tensors(model, True):
        key = first.setdefault(id(tensor), name)
        names.setdefault(key, []).append(name)
    return names


def checkpoint_tensors(checkpoint: str | os.PathLike) -> dict[str, StoredTensor | torch.Tensor]:
    """Every tensor of the checkpoint, not yet read: safetensors from their headers, torch files mapped."""
    sources: dict[str, StoredTensor | torch.Tensor] = {}
    for path in weight_files(checkpoint):
        if path.suffix == ".safetensors":
            sources.update(stored_tensors(path))
            continue
        try:
            sources.update(load_torch(path, mmap=True))
        except (RuntimeError, EOFError, pickle.UnpicklingError) as err:
            raise DamagedFileError(
                f"{path} is not a whole torch weights file ({str(err).splitlines()[0][:200]}). Use an intact copy."
            ) from err
    return sources


def check_against_model(
    model: nn.Module,
    checkpoint: Any,
    sources: Mapping[str, StoredTensor | torch.Tensor],
    strict: bool,
    frozen_optional: bool = False,
) -> list[str]:
    """ValueError, before anything is loaded, for a checkpoint tensor whose shape differs from the
    model's, and with `strict` for one the model lacks or one the checkpoint lacks (but a frozen one,
    with `frozen_optional`); without `strict` those two are logged as a warning (Accelerate's default).
    Returns the checkpoint's names the model lacks."""
    own = model.state_dict(keep_vars=True)  # persistent tensors, tied ones under each of their names
    aliases = tensor_aliases(model)
    unexpected = [name for name in sources if name not in own]
    wrong_shape = [
        f"{name} {tuple(source.shape)} (the model has {tuple(own[name].shape)})"
        for name in own  # in the model's order
        if (source := sources.get(name)) is not None and tuple(source.shape) != tuple(own[name].shape)
    ]
    covered = {alias for name in sources if name in aliases for alias in aliases[name]} | set(sources)
    if frozen_optional:
        covered |= {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    missing = [name for name in own if name not in covered]
    named = {"not in the model": unexpected, "missing from the checkpoint": missing}
    problems = _listed({"with another shape": wrong_shape, **(named if strict else {})})
    if problems:
        raise ValueError(
            f"checkpoint {checkpoint} does not match {type(model).__name__} ({problems}). Build the model "
            "with the settings the checkpoint was saved with; nothing was loaded."
        )
    if not strict and (unexpected or missing):
        log.warning(
            "checkpoint %s does not match %s (%s): loading the rest (strict=True refuses it).",
            checkpoint,
            type(model).__name__,
            _listed(named),
        )
    return unexpected


def _listed(groups: Mapping[str, list[str]]) -> str:
    return "; ".join(
        f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        for label, names in groups.items()
        if names
    )


def read_tensor(source: StoredTensor | torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = source.read() if isinstance(source, StoredTensor) else source
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor


def tensor_owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module `name` names, or the module holding the tensor `name` names, and that tensor's name."""
    if name == "":
        return model, ""
    modules = dict(model.named_modules())
    if name in modules:
        return modules[name], ""
    parent, _, attribute = name.rpartition(".")
    return model.get_submodule(parent), attribute


def get_module_tensor(model: nn.Module, name: str) -> torch.Tensor:
    module, attribute = tensor_owner(model, name)
    return getattr(module, attribute)


def set_module_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in `model` as the parameter or buffer `name` (a Parameter keeps its requires_grad)."""
    module, attribute = tensor_owner(model, name)
    if is_parameter(model, name) and not isinstance(tensor, nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=getattr(module, attribute).requires_grad)
    setattr(module, attribute, tensor)


def is_parameter(model: nn.Module, name: str) -> bool:
    module, attribute = tensor_owner(model, name)
    return attribute in dict(module.named_parameters(recurse=False, remove_duplicate=False))
