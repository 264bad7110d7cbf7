"""A process's place in its job and the ways to order work across processes (`ProcessControl`, which the
Engine and Accelerate's `PartialState` share), and the one strategy of the process that set up its process
group: the first Engine (or `PartialState`) to do so becomes the active one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch

import runner.engine.collectives as collectives
from runner.hardware import Strategy
from runner.state import DistributedType, ProcessState

_active: tuple[Strategy, ProcessState] | None = None


def activate(strategy: Strategy, state: ProcessState) -> None:
    """Make `strategy` (already set up, at `state`) the one `PartialState()` and `runner.utils` use."""
    global _active
    _active = (strategy, state)


def active() -> tuple[Strategy, ProcessState] | None:
    """The strategy the process's `Engine` set up (and its place), or None where none has yet."""
    return _active


def deactivate(strategy: Strategy) -> None:
    """Forget `strategy` after its teardown (the next `PartialState()` sets up a new one)."""
    global _active
    if _active is not None and _active[0] is strategy:
        _active = None


class ProcessControl:
    """Where this process sits and how processes wait for each other; needs `strategy` and `state`."""

    strategy: Strategy
    state: ProcessState

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def distributed_type(self) -> DistributedType:
        """How the processes share the work, as the strategy reports it (`DistributedType.FSDP`, ...)."""
        return self.strategy.distributed_type

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def multi_device(self) -> bool:
        """Whether the job's processes compute on several accelerators (GPUs, TPU cores): Accelerate's
        name for data parallel on devices other than the CPU."""
        return self.use_distributed and self.device.type != "cpu"

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this line (no-op with one process)."""
        self.strategy.barrier()

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Any:
        """Context manager giving this process its contiguous share of `inputs` (list, tuple, tensor, or a
        dict of them); see `runner.engine.collectives.split_between_processes`."""
        return collectives.split_between_processes(
            inputs, self.num_processes, self.process_index, apply_padding
        )

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the body on the main process first, then on the others."""
        with self._goes_first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the body on each machine's local main process first, then on the others."""
        with self._goes_first(self.is_local_main_process):
            yield

    @contextmanager
    def _goes_first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def on_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the main process only."""
        return _run_on(function, self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the main process of each machine only."""
        return _run_on(function, self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorator: run `function` on the last process only."""
        return _run_on(function, self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int = 0) -> Callable:
        """Decorator: run `function` on process `process_index` only (usable with or without arguments)."""
        if function is None:
            return lambda fn: self.on_process(fn, process_index=process_index)
        return _run_on(function, self.process_index == process_index)

    def on_local_process(
        self,
        function: Callable | None = None,
        local_process_index: int | None = None,
        *,
        local_process_idx: int | None = None,
    ) -> Callable:
        """Decorator: run `function` on local process `local_process_index` of each machine only (default
        0; `local_process_idx` is the spelling of Accelerate's documentation)."""
        if local_process_index is not None and local_process_idx is not None:
            raise ValueError("on_local_process: give local_process_index or local_process_idx, not both.")
        index = local_process_index if local_process_index is not None else local_process_idx or 0
        if function is None:
            return lambda fn: self.on_local_process(fn, local_process_index=index)
        return _run_on(function, self.local_process_index == index)


def _run_on(function: Callable, here: bool) -> Callable:
    @wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs) if here else None

    return wrapper
