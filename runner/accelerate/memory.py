"""Freeing memory, and finding the batch size that fits in it (Accelerate's `accelerate.utils.memory`)."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

# What out-of-memory errors say, on the devices torch drives (a RuntimeError on some of them).
OUT_OF_MEMORY = (
    "CUDA out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "RESOURCE_EXHAUSTED",
)


def release_memory(*objects: Any) -> list[None]:
    """Drop the references given, collect garbage and empty the device caches; `a, b = release_memory(a, b)`."""
    objects = list(objects)
    for index in range(len(objects)):
        objects[index] = None
    clear_device_cache()
    return objects


def clear_device_cache() -> None:
    """Collect garbage, then return the CUDA allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def should_reduce_batch_size(error: BaseException) -> bool:
    """Whether `error` is an out-of-memory error, which a smaller batch may avoid."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return (
        isinstance(error, RuntimeError)
        and len(error.args) == 1
        and any(m in error.args[0] for m in OUT_OF_MEMORY)
    )


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable:
    """Decorate `function(batch_size, ...)`: call it with `starting_batch_size`, and after each
    out-of-memory error free memory and call it again with 90% of the batch, rounded down (Accelerate
    1.x's step; or `reduce_batch_size_fn()`), until it returns; RuntimeError when the batch size reaches zero. Call the decorated function without
    the batch size: the decorator passes it."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size
    reduce = reduce_batch_size_fn or (lambda: int(batch_size * 0.9))

    @functools.wraps(function)
    def decorated(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache()
        parameters = list(inspect.signature(function).parameters)
        if len(parameters) < len(args) + 1:
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when called: remove it, "
                f"the decorator passes it. Call `{function.__name__}({', '.join(f'{p}={a!r}' for p, a in zip(parameters[1:], args, strict=False))})`."
            )
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
                clear_device_cache()
                batch_size = reduce()

    return decorated
