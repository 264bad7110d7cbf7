"""`notebook_launcher`: Accelerate's way to train in several processes from a notebook or a Python session."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from runner.cluster import patch_environment
from runner.errors import RankFailedError
from runner.launchers.local import rank_group_config


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
) -> dict[int, Any]:
    """Run `function(*args)` in `num_processes` processes on this machine (forked, so a function defined
    in the notebook works) and return each local rank's result. Each process builds its own
    `Accelerator()`, which joins the group (gloo on CPU, NCCL on GPUs). With `num_processes` None or 1, it
    runs here, in this process.

    As in Accelerate: CUDA must not have been initialised in this process (a forked process cannot use
    it), `mixed_precision` is the default of the processes' `Accelerator()`, `use_port` and `master_addr`
    are where the processes meet ("0": a free port). On CPU each process computes on one thread: a forked
    process cannot use the OpenMP threads of a notebook that has already computed.
    """
    with patch_environment(ACCELERATE_MIXED_PRECISION=mixed_precision):
        if num_processes is None or num_processes == 1:
            return {0: function(*args)}
        if num_processes < 1:
            raise ValueError(f"num_processes={num_processes}: must be >= 1.")
        if torch.cuda.is_initialized():
            raise ValueError(
                "CUDA has been initialised in this process, and processes forked from it cannot use it. Restart "
                "the notebook and call notebook_launcher before anything touches CUDA."
            )
        config = rank_group_config(
            num_processes,
            "fork",  # a function defined in the notebook cannot be pickled for spawn
            tempfile.mkdtemp(prefix="runner-notebook-"),
            endpoint=f"{master_addr}:{use_port}",
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
        )
        threads = {} if torch.cuda.is_available() else {"OMP_NUM_THREADS": "1"}
        with patch_environment(**threads):
            try:
                return elastic_launch(config, function)(*args)
            except ChildFailedError as err:
                rank, failure = min(err.failures.items())
                report = (
                    failure.message if isinstance(failure.message, dict) else {"message": failure.message}
                )
                traceback = report.get("extraInfo", {}).get("py_callstack", "")
                raise RankFailedError(
                    f"process {rank} of {num_processes} failed (exit code {failure.exitcode}): "
                    f"{report['message']}\n{traceback}".rstrip()
                ) from err
