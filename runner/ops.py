"""One walker over nested containers of tensors, and the small operations built on it."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Return `data` with `fn(tensor)` applied to every tensor inside it.

    Walks lists, tuples (namedtuples keep their type), mappings (their type is kept: mutable ones are
    copied and refilled, so constructors with other signatures are never called) and dataclass instances.
    Anything that is not a tensor or a container passes through unchanged.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if type(data) is dict:  # the common case first
        return {k: apply_to_tensors(fn, v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        items = [apply_to_tensors(fn, v) for v in data]
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, MutableMapping):
        out = copy.copy(data)
        for k, v in data.items():
            out[k] = apply_to_tensors(fn, v)
        return out
    if isinstance(data, Mapping):
        return {k: apply_to_tensors(fn, v) for k, v in data.items()}
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {
            f.name: apply_to_tensors(fn, getattr(data, f.name)) for f in dataclasses.fields(data) if f.init
        }
        return dataclasses.replace(data, **changes)
    return data


def send_to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in `data` to `device`."""
    return apply_to_tensors(lambda t: t.to(device, non_blocking=non_blocking), data)


def convert_to_fp32(data: Any) -> Any:
    """Cast every floating point tensor in `data` to float32 (outputs of an autocast forward)."""
    return apply_to_tensors(_float_to_fp32, data)


def _float_to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor
