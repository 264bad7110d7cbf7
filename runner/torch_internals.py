"""Every private torch name runner reaches, here only (tests/test_torch_internals.py finds none elsewhere),
each checked against the installed torch by that test: a torch release that renames one fails that test,
not a user's launch (CI runs it on torch 2.13 and on 2.9, the oldest pyproject.toml admits: .ci/tpu.sh).

- `torch.compile`'s wrapper (`OptimizedModule` and its `_orig_mod`), as Accelerate's `is_compiled_module`
  reads it; inductor's modes (`torch._inductor.list_mode_options`, where `torch.compile`'s docstring points).
- The CUDA allocator's history (`torch.cuda.memory._record_memory_history`, `_dump_snapshot`): the API that
  pytorch.org/memory_viz documents.
- The functional collectives (`torch.distributed._functional_collectives`), which dynamo traces and whose
  gather has a gradient: what torch's deprecation of `torch.distributed.nn.functional` points to.
- `DeviceMesh._flatten` (torchtitan's way to name several mesh dimensions as one); a view's `_base`.
- torch elastic's local agent (`ElasticAgent`): how long stopped ranks get, and whether a failed rank group
  restarts, reached through `LocalElasticAgent`'s private steps; `elastic_launch` builds its agent by the
  module global `torch.distributed.launcher.api.LocalElasticAgent` (`launching_with`). Which signals its
  agent passes on to the ranks is `LaunchConfig.signals_to_handle` from torch 2.10 (`forwarding`); torch 2.9's
  agent takes SIGTERM, SIGINT, SIGHUP and SIGQUIT whatever the launch asks, and the agent puts that right.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.launcher import api as launcher_api

# torch 2.10 added the launch's choice of the signals its agent passes on to the ranks.
_SIGNALS_OPTION = "signals_to_handle" in {f.name for f in dataclasses.fields(launcher_api.LaunchConfig)}
_TAKEN_BEFORE_2_10 = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def compiled_module(module: Any) -> torch.nn.Module | None:
    """The model inside `module` when `module` is `torch.compile`'s wrapper, else None."""
    from torch._dynamo.eval_frame import OptimizedModule  # torch._dynamo takes a second to import

    return module._orig_mod if isinstance(module, OptimizedModule) else None


def compiled_wrapper(wrapper: Any, model: torch.nn.Module) -> Any:
    """`torch.compile`'s `wrapper`, around `model` from now on."""
    wrapper._orig_mod = model
    return wrapper


def inductor_modes() -> list[str]:
    """The modes `torch.compile(backend="inductor", mode=...)` takes."""
    import torch._inductor  # what compiling imports anyway

    return list(torch._inductor.list_mode_options())


def record_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start (or stop) recording the CUDA allocator's history."""
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: Path) -> None:
    """Write the recorded history to `path` (a pickle that pytorch.org/memory_viz opens)."""
    torch.cuda.memory._dump_snapshot(str(path))


# torch 2.10 renamed the gathering one (the former name warns there).
_GATHER = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def gathered_along(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The group's `tensor`s joined along `dim` in rank order; its gradient goes back to each rank's share."""
    return _GATHER(tensor, dim, group)


def summed(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of the group's `tensor`s (no gradient)."""
    return funcol.all_reduce(tensor, "sum", group)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The dimensions of `mesh` (a slice of several) as one dimension `name`, which the root mesh then
    also answers to (`root[name]`)."""
    return mesh._flatten(name)


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor that `tensor` is a view of (None: it is no view)."""
    return tensor._base


class ElasticAgent(LocalElasticAgent):
    """torch's local agent whose ranks get `shutdown_timeout_s` to exit before SIGKILL, whatever ended them
    (a signal, a failed peer, a restart), and whose subclasses say whether a failed group restarts
    (`restart_allowed`) and hear of each restart (`restarting`). torch's own `shutdown_timeout` counts only
    after a signal: after a failure its process context waits a fixed 30 s for the other ranks
    (`ProcessContext.join` without a grace period), and its agent 30 s more (`_stop_workers`)."""

    shutdown_timeout_s: float = 30.0
    forwarded_signals: tuple[signal.Signals, ...] = _TAKEN_BEFORE_2_10  # what the launch gave `forwarding`
    _failures: dict[int, ProcessFailure] = {}

    def restart_allowed(self) -> bool:
        """Whether the rank group that just failed may restart (when restarts are left)."""
        return True

    def restarting(self, failures: dict[int, ProcessFailure], restart: int, restarts: int) -> None:
        """Restart `restart` of `restarts` begins, after the ranks of the last attempt failed with `failures`."""

    def starting(self) -> None:
        """The rank group starts: the first time, after a restart, or after the job's nodes changed."""

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.starting()
        before = {sig: signal.getsignal(sig) for sig in _TAKEN_BEFORE_2_10}
        pids = super()._start_workers(worker_group)
        if not _SIGNALS_OPTION:
            _forward_only(self.forwarded_signals, before)
        ranks = self._pcontext
        if isinstance(ranks, MultiprocessContext):  # fork, spawn, forkserver
            # Half the time to exit on their own (they may have lost the failed peer), half after SIGTERM.
            ranks._pc.join = functools.partial(ranks._pc.join, grace_period=self.shutdown_timeout_s / 2)
        if ranks is not None:  # every stop (a signal, a failure, a restart): SIGKILL after the timeout
            close = ranks.close

            def close_within_timeout(death_sig: signal.Signals | None = None, *_: Any, **__: Any) -> None:
                close(death_sig, timeout=int(self.shutdown_timeout_s))

            ranks.close = close_within_timeout  # type: ignore[method-assign]
        return pids

    def stopped_for_nodes(self, failures: dict[int, ProcessFailure]) -> bool:
        """Whether ranks that ended with `failures` stopped for the job's nodes to change (a node waits to
        meet): the agent then takes the nodes in, as after ranks it stopped itself, not as a failure."""
        return False

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if (
            result.is_failed()
            and self.stopped_for_nodes(result.failures)
            and worker_group.spec.rdzv_handler.num_nodes_waiting() > 0
        ):
            result = RunResult(state=WorkerState.HEALTHY)  # the agent's loop meets the waiting node
        self._failures = result.failures
        if result.is_failed() and self._remaining_restarts and not self.restart_allowed():
            self._remaining_restarts = 0
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        restarts = worker_group.spec.max_restarts
        self.restarting(self._failures, restarts - self._remaining_restarts, restarts)
        super()._restart_workers(worker_group)


def forwarding(signals: tuple[signal.Signals, ...]) -> dict[str, Any]:
    """The `LaunchConfig` options by which its agent passes `signals` on to the ranks (and no others); an
    `ElasticAgent` given the same `forwarded_signals` does it on a torch without the option."""
    return {"signals_to_handle": ",".join(sig.name for sig in signals)} if _SIGNALS_OPTION else {}


def _forward_only(signals: tuple[signal.Signals, ...], before: dict[signal.Signals, Any]) -> None:
    """After torch 2.9 started the ranks: `signals` stop the agent as torch's own handler does (which passes
    them on), and the others that it took get back the handlers they had before."""

    def stop_agent(signum: int, frame: Any) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    if threading.current_thread() is not threading.main_thread():
        return  # torch takes none there either
    for sig, handler in before.items():
        if sig not in signals:
            signal.signal(sig, handler)
    for sig in signals:
        if sig not in before:
            signal.signal(sig, stop_agent)


@contextmanager
def launching_with(agent: type[ElasticAgent]) -> Iterator[None]:
    """Inside, `elastic_launch` runs its ranks under `agent`."""
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = agent  # type: ignore[misc]
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]
