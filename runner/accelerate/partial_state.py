"""`PartialState`: a process's place in its job and the ways to order work across processes, without the
training machinery (Accelerate's light handle for inference scripts), and the strategy that the function
forms in `runner.utils` (`gather`, `wait_for_everyone`, ...) run through.

The process group is the process's one shared resource: the first `Accelerator` or `PartialState` to set
it up becomes the active one (`runner.engine.process_control`); every later `PartialState()` is a handle on it."""

from __future__ import annotations

import torch

from runner.engine.process_control import ProcessControl, activate, active, deactivate
from runner.hardware import Strategy, default_strategy


class PartialState(ProcessControl):
    """This process's place in its job (Accelerate's `PartialState`): a handle on the process group that
    an `Accelerator` set up, else on one it sets up itself as `Accelerator()` would (`cpu` forces the
    CPU). Every instance in a process shares it."""

    def __init__(self, cpu: bool = False) -> None:
        if active() is None:
            strategy = default_strategy(cpu)
            activate(strategy, strategy.setup_environment())
        self.strategy, self.state = active()  # type: ignore[misc]

    @property
    def initialized(self) -> bool:
        current = active()
        return current is not None and current[0] is self.strategy

    @property
    def default_device(self) -> torch.device:
        return self.device

    def destroy_process_group(self) -> None:
        """Leave the process group (every process together); a later `PartialState()` joins a new one."""
        self.strategy.teardown()
        deactivate(self.strategy)


def active_strategy() -> Strategy:
    """The strategy of the process's `Accelerator` or `PartialState` (set up as `PartialState()` would
    where there is none yet)."""
    return PartialState().strategy
