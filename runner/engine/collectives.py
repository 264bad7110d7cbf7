"""Collectives over nested structures of tensors, run through a hardware strategy: what the Accelerator's
methods and the function forms in `runner.utils` (Accelerate's `gather`, `reduce`, ...) both call."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from runner.hardware import Strategy
from runner.ops import apply_to_tensors

REDUCTIONS = ("sum", "mean", "max", "min", "none")


def gather(strategy: Strategy, data: Any) -> Any:
    """Every tensor in `data` concatenated from all processes along its first dimension (scalars become
    one element per process)."""
    return apply_to_tensors(strategy.all_gather, data)


def gather_object(strategy: Strategy, obj: Any) -> list[Any]:
    """Every process's picklable `obj`, in process order; lists and tuples are concatenated."""
    gathered = strategy.all_gather_object(obj)
    if isinstance(obj, (list, tuple)):
        return [item for part in gathered for item in part]
    return gathered


def reduce(strategy: Strategy, data: Any, reduction: str, scale: float = 1.0) -> Any:
    """Every tensor in `data` reduced across processes ("sum", "mean", "max", "min"; "none" keeps this
    process's), times `scale`. The inputs are left as they are."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {', '.join(map(repr, REDUCTIONS))}.")

    def _reduce(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor if reduction == "none" else strategy.all_reduce(tensor.clone(), op=reduction)
        return out * scale if scale != 1.0 else out

    return apply_to_tensors(_reduce, data)


def broadcast(strategy: Strategy, data: Any, from_process: int = 0) -> Any:
    """Every tensor in `data` overwritten, in place, with process `from_process`'s."""
    return apply_to_tensors(lambda t: strategy.broadcast(t, src=from_process), data)


def broadcast_object_list(strategy: Strategy, objects: list[Any], from_process: int = 0) -> list[Any]:
    """The picklable objects of `objects` replaced, in place, by process `from_process`'s."""
    return strategy.broadcast_object_list(objects, src=from_process)


def pad_across_processes(
    strategy: Strategy, data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False
) -> Any:
    """Every tensor in `data` padded with `pad_index` along `dim` to the largest size any process has
    there (at the start with `pad_first`), so that it can be gathered. A collective: one exchange of
    shapes per tensor."""

    def _pad(tensor: torch.Tensor) -> torch.Tensor:
        if dim >= tensor.ndim or dim < -tensor.ndim:
            return tensor
        size = torch.tensor(tensor.shape)
        longest = int(strategy.all_gather(size).view(-1, size.numel())[:, dim].max())
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest
        padded = tensor.new_full(shape, pad_index)
        start = longest - tensor.shape[dim] if pad_first else 0
        padded.narrow(dim, start, tensor.shape[dim]).copy_(tensor)
        return padded

    return apply_to_tensors(_pad, data)


def synchronize_rng_states(strategy: Strategy, generators: Sequence[torch.Generator]) -> None:
    """Give every process process 0's state of each of `generators`."""
    for generator in generators:
        generator.set_state(strategy.broadcast(generator.get_state(), src=0))


def rng_generators(
    rng_types: Sequence[Any], device: torch.device, samplers: Sequence[torch.Generator] = ()
) -> list[torch.Generator]:
    """The generators that Accelerate's `rng_types` (`RNGType` members or their values) name: "torch"
    (the default CPU one), "cuda" (this process's device's, on CUDA), "generator" (`samplers`)."""
    named = {
        "torch": [torch.default_generator],
        "cuda": [_cuda_generator(device)] if device.type == "cuda" else [],
        "generator": list(samplers),
    }
    rng_types = [str(getattr(t, "value", t)) for t in rng_types]
    unknown = [str(t) for t in rng_types if str(t) not in named]
    if unknown:
        raise ValueError(f"rng_types: unknown {unknown}; use 'torch', 'cuda' or 'generator'.")
    return [g for rng_type in rng_types for g in named[rng_type]]


def _cuda_generator(device: torch.device) -> torch.Generator:
    """`device`'s default CUDA generator; torch fills `default_generators` when CUDA is initialised."""
    torch.cuda.init()
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.default_generators[index]


@contextmanager
def split_between_processes(
    inputs: Any, num_processes: int, process_index: int, apply_padding: bool = False
) -> Iterator[Any]:
    """This process's contiguous share of `inputs` (a list, tuple, tensor, or a dict of them of one
    length): the first `len % num_processes` processes get one item more. With `apply_padding` every
    share has the same length, the short ones repeating the last item (drop those results after
    gathering)."""
    lengths = {len(v) for v in inputs.values()} if isinstance(inputs, Mapping) else {len(inputs)}
    if len(lengths) != 1:
        raise ValueError(
            f"split_between_processes: the values of a dict must have one length, got {sorted(lengths)}."
        )
    (length,) = lengths
    per_process, extra = divmod(length, num_processes)
    start = process_index * per_process + min(process_index, extra)
    end = start + per_process + (process_index < extra)
    longest = per_process + (extra > 0)

    def share(values: Any) -> Any:
        part = values[start:end]
        if not apply_padding or len(part) == longest or length == 0:
            return part
        missing = longest - len(part)
        if isinstance(values, torch.Tensor):
            last = (part if len(part) else values)[-1:]
            return torch.cat([part, last.expand(missing, *last.shape[1:])])
        last_item = (part if len(part) else values)[-1]
        return part + type(part)([last_item] * missing)

    if isinstance(inputs, Mapping):
        yield {key: share(values) for key, values in inputs.items()}
    else:
        yield share(inputs)
