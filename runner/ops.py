"""One walker over nested containers of tensors, and the small operations built on it."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from functools import partial
from typing import Any

import torch


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], data: Any, strict: bool = False) -> Any:
    """Return `data` with `fn(tensor)` applied to every tensor inside it.

    Walks lists, tuples (namedtuples keep their type), mappings (their type is kept: mutable ones are
    copied and refilled, so constructors with other signatures are never called) and dataclass instances.
    Anything else passes through unchanged, or raises TypeError with `strict`.
    """
    kind = type(data)
    # Every batch walks through here: the common cases first, by exact type (an isinstance against
    # torch.Tensor's metaclass takes longer), and a tensor in a list or a dict is applied without a call.
    if kind is torch.Tensor:
        return fn(data)
    if kind is list or kind is tuple:
        return kind([fn(v) if type(v) is torch.Tensor else apply_to_tensors(fn, v, strict) for v in data])
    if kind is dict:
        return {
            k: fn(v) if type(v) is torch.Tensor else apply_to_tensors(fn, v, strict) for k, v in data.items()
        }
    return _apply_to_container(fn, data, strict)


def _apply_to_container(fn: Callable[[torch.Tensor], Any], data: Any, strict: bool) -> Any:
    """`apply_to_tensors` past its common cases: tensor subclasses, namedtuples, other mappings and
    sequences, dataclasses."""
    if isinstance(data, torch.Tensor):  # a subclass: a parameter, a DTensor
        return fn(data)
    if isinstance(data, (list, tuple)):
        items = [apply_to_tensors(fn, v, strict) for v in data]
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, MutableMapping):
        out = copy.copy(data)
        for k, v in data.items():
            out[k] = apply_to_tensors(fn, v, strict)
        return out
    if isinstance(data, Mapping):
        return {k: apply_to_tensors(fn, v, strict) for k, v in data.items()}
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {
            f.name: apply_to_tensors(fn, getattr(data, f.name), strict)
            for f in dataclasses.fields(data)
            if f.init
        }
        return dataclasses.replace(data, **changes)
    if strict:
        raise TypeError(f"{type(data).__name__} is neither a tensor nor a container of tensors")
    return data


def host_copy(data: Any) -> Any:
    """`data` with every tensor copied into CPU memory (a snapshot that later updates do not change);
    containers are rebuilt (`apply_to_tensors`)."""
    return apply_to_tensors(lambda t: t.detach().to("cpu", copy=True), data)


def is_tensor_structure(data: Any) -> bool:
    """True when `data` is a tensor or a nested container holding only tensors."""
    try:
        apply_to_tensors(lambda t: t, data, strict=True)
    except TypeError:
        return False
    return True


def find_batch_size(data: Any) -> int | None:
    """The first dimension of the first tensor in `data` with one (Accelerate's `find_batch_size`), or
    None when it holds none."""
    sizes: list[int] = []
    apply_to_tensors(lambda t: sizes.append(len(t)) if t.ndim else None, data)
    return sizes[0] if sizes else None


def send_to_device(
    data: Any,
    device: torch.device | str,
    non_blocking: bool = False,
    skip_keys: str | list[str] | None = None,
) -> Any:
    """Move every tensor in `data` to `device` (one already there is kept, without a `.to` call); the
    entries of a top-level mapping named in `skip_keys` stay where they are (Accelerate's signature)."""
    place = _placing(torch.device(device), non_blocking)
    if skip_keys is None or not isinstance(data, Mapping):
        return apply_to_tensors(place, data)
    skipped = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
    return type(data)(
        {key: value if key in skipped else apply_to_tensors(place, value) for key, value in data.items()}
    )


def _placing(device: torch.device, non_blocking: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor on `device`: itself where it is there already, else moved."""

    def place(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == device else tensor.to(device, non_blocking=non_blocking)

    return place


def concatenate(data: list[Any], dim: int = 0) -> Any:
    """Concatenate a list of equally nested structures (lists, tuples, mappings) of tensors, tensor by
    tensor along `dim` (Accelerate's `concatenate`)."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        return type(first)(concatenate([d[i] for d in data], dim) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)({key: concatenate([d[key] for d in data], dim) for key in first})
    if not isinstance(first, torch.Tensor):
        raise TypeError(
            f"can only concatenate nested lists, tuples or mappings of tensors, not {type(first).__name__}."
        )
    return torch.cat(data, dim=dim)


def convert_to_fp32(data: Any) -> Any:
    """Cast every fp16 and bf16 tensor in `data` to float32 (outputs of an autocast forward); other dtypes,
    fp64 included, stay as they are (Accelerate's)."""
    return apply_to_tensors(_half_to_fp32, data)


def _half_to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def on_device(batches: Iterator[Any], device: torch.device, non_blocking: bool = False) -> Iterator[Any]:
    """Each batch of `batches` moved to `device` (asynchronously from pinned memory with `non_blocking`)."""
    return map(partial(apply_to_tensors, _placing(torch.device(device), non_blocking)), batches)
