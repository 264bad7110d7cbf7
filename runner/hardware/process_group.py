"""The part every multi-process backend shares: joining the process group and the collectives."""

from __future__ import annotations

import atexit
import gc
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runner.cluster import available_cores, launched_environment
from runner.config import PositiveFloat, PositiveInt, checked
from runner.errors import ConfigError
from runner.hardware.base import ProcessGroupOptions, Strategy
from runner.state import DistributedType, ProcessState

# all_reduce's `op` names ("mean" sums, then divides by the group's size)
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class ParallelStrategy(Strategy):
    """One rank of a `torch.distributed` process group, one device per rank.

    Started by a launcher (ours, torchrun, srun) the rank reads its place from the environment; started as
    a plain process it forms a group of one, so a script runs unchanged without a launcher.

    Args:
        num_processes: ranks the launcher starts on this machine; None: one per visible GPU, or 2 on CPU.
        device: "cuda" or "cpu"; None: cuda when available.
        backend: process-group backend; None: nccl on cuda, gloo on cpu.
        timeout_s: how long a collective waits for the other ranks before failing, and how long the ranks of a
            SLURM job wait for each other to start (the ones that did not are named).
        num_threads: CPU threads per rank; None: `OMP_NUM_THREADS`, else the cores shared out evenly.
        oversubscribe: start more CPU ranks than this machine has cores (refused otherwise: ranks that share
            a core wait on each other at every collective).
        peak_flops: one device's peak FLOP/s that MFU is measured against; None: `runner.perf`'s table.
    """

    @checked("hardware")
    def __init__(
        self,
        *,
        num_processes: PositiveInt | None = None,
        device: str | None = None,
        backend: str | None = None,
        timeout_s: PositiveFloat = 1800.0,
        num_threads: PositiveInt | None = None,
        oversubscribe: bool = False,
        peak_flops: PositiveFloat | None = None,
    ) -> None:
        self.device_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device_type not in ("cuda", "cpu"):
            raise ConfigError(
                f"hardware.device={device!r}: expected 'cuda', 'cpu' or null (cuda when available)."
            )
        gpus = torch.cuda.device_count() if self.device_type == "cuda" else 0
        self.num_processes = num_processes if num_processes is not None else (gpus or 2)
        if self.device_type == "cuda" and self.num_processes > gpus:
            fewer = f"Set hardware.num_processes<={gpus}, or" if gpus else "Set"
            raise ConfigError(
                f"hardware.num_processes={self.num_processes}: this machine has {gpus} visible GPU(s) and each "
                f"rank needs its own. {fewer} hardware.device=cpu to run the ranks on the CPU."
            )
        self.backend = backend or ("nccl" if self.device_type == "cuda" else "gloo")
        self.timeout = timedelta(seconds=timeout_s)
        self.init_method = "env://"
        self.num_threads = num_threads
        self.oversubscribe = oversubscribe
        self.peak_flops = peak_flops
        # A forked rank starts in milliseconds; CUDA does not survive a fork, so GPU ranks are spawned.
        self.start_method = "spawn" if self.device_type == "cuda" else "fork"
        self.device = torch.device(self.device_type)

    def cpu_ranks(self) -> int:
        return self.num_processes if self.device_type == "cpu" else 0

    @property
    def distributed_type(self) -> DistributedType:  # type: ignore[override]
        return DistributedType.MULTI_GPU if self.device_type == "cuda" else DistributedType.MULTI_CPU

    def use_process_group(self, options: ProcessGroupOptions) -> None:
        self.backend = options.backend or self.backend
        self.init_method = options.init_method or self.init_method
        self.timeout = options.timeout or self.timeout

    def setup_environment(self) -> ProcessState:
        env = launched_environment()
        local_rank = env.local_rank if env else 0
        if self.device_type == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            cores = available_cores()
            per_rank = max(1, cores // (env.local_world_size if env else 1))
            torch.set_num_threads(self.num_threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or per_rank)
        if not dist.is_initialized():
            if env is None:
                dist.init_process_group(
                    self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout
                )
            else:
                env.export()
                # where the environment has its own rendezvous (SLURM's tasks), unless an init_method was given
                store = env.rendezvous(self.timeout) if self.init_method == "env://" else None
                if store is not None:
                    dist.init_process_group(
                        self.backend,
                        store=store,
                        rank=env.rank,
                        world_size=env.world_size,
                        timeout=self.timeout,
                    )
                else:
                    dist.init_process_group(self.backend, init_method=self.init_method, timeout=self.timeout)
            # A script that never calls end_training() still leaves the group before the interpreter
            # tears down (the backend's threads otherwise abort the process at exit).
            atexit.register(_release_process_group)
        return ProcessState(
            device=self.device,
            process_index=dist.get_rank(),
            num_processes=dist.get_world_size(),
            local_process_index=local_rank,
        )

    # The data collectives run over the ranks that hold different samples: all of them here; a strategy
    # whose ranks share batches (tensor parallel) names its data-parallel group. The backend may need
    # tensors on its device (NCCL): they move there and back.
    def data_group(self) -> dist.ProcessGroup | None:
        """The process group of the ranks that read different data (None: the world)."""
        return None

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        reduced = self._on_device(tensor)
        dist.all_reduce(reduced, op=REDUCE_OPS[op], group=self.data_group())
        if op == "mean":
            reduced = reduced / dist.get_world_size(self.data_group())
        return reduced.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._gather(tensor, self.data_group())

    def all_gather_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._gather(tensor, None)

    def _gather(self, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        local = self._on_device(tensor if tensor.ndim else tensor[None]).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts).to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        shared = self._on_device(tensor)
        dist.broadcast(shared, src=src)
        if shared is not tensor:
            tensor.copy_(shared)
        return tensor

    def broadcast_object_list(self, objects: list[Any], src: int = 0) -> list[Any]:
        dist.broadcast_object_list(objects, src=src, device=self.device)
        return objects

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size(self.data_group())
        dist.all_gather_object(gathered, obj, group=self.data_group())
        return gathered

    def teardown(self) -> None:
        """Leave the process group together: a rank tearing down while a peer still has work in flight
        can leave the peer's backend threads waiting forever."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _release_process_group() -> None:
    """At exit, while the interpreter still runs: collect the objects in reference cycles that hold
    distributed state (a DDP model and its reducer), which the interpreter's teardown would otherwise free
    at a point where their backend threads abort the process ("terminate called without an active
    exception"), also when `end_training` already left the group; then leave the group if it is there."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
