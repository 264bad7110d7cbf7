"""runner's Ray Train backend: it gives each worker of `launcher=ray`'s worker group its place as torch's
variables (runner forms the process group itself, as under every launcher). Its classes subclass Ray
Train's, so they are made when a job is launched on Ray (`backend_config`): importing Ray Train takes
seconds, which no other command should pay."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from runner.cluster.ray import ATTEMPT


def backend_config() -> Any:
    """A fresh config of runner's backend (a `ray.train.backend.BackendConfig`), for one `fit`."""
    return _backend_classes()()


@functools.cache
def _backend_classes() -> type:
    from ray.train.backend import Backend, BackendConfig

    @dataclass
    class RunnerBackendConfig(BackendConfig):
        """Ray Train's backend for runner's ranks: no process group (runner forms it), only the variables.
        `starts` counts the worker group's starts within one `fit` (the controller keeps this object)."""

        starts: int = 0

        @property
        def backend_cls(self) -> type[Backend]:
            return RunnerBackend

    class RunnerBackend(Backend):
        """Before the ranks run: rank 0's address and a free port on its node for this start of the group,
        and torch's variables from Ray's train context, in every worker."""

        def on_start(self, worker_group: Any, backend_config: RunnerBackendConfig) -> None:
            from ray.train._internal.utils import get_address_and_port

            backend_config.starts += 1
            address, port = worker_group.execute_single(0, get_address_and_port)
            worker_group.execute(_export, address=address, port=port, attempt=backend_config.starts)

    return RunnerBackendConfig


def _export(address: str, port: int, attempt: int) -> None:
    """In a worker: its place, as torch's variables."""
    import ray.train

    context = ray.train.get_context()
    os.environ.update(
        RANK=str(context.get_world_rank()),
        WORLD_SIZE=str(context.get_world_size()),
        LOCAL_RANK=str(context.get_local_rank()),
        LOCAL_WORLD_SIZE=str(context.get_local_world_size()),
        NODE_RANK=str(context.get_node_rank()),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        **{ATTEMPT: str(attempt)},
    )
