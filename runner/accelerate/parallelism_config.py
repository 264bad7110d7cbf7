"""Accelerate's layout of the ranks, `ParallelismConfig` (`Accelerator(parallelism_config=...)`), and its
context-parallel settings, `TorchContextParallelConfig`, with Accelerate's names, fields, defaults and
checks; the Accelerator builds runner's strategy from them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class TorchContextParallelConfig:
    """Accelerate's context-parallel settings (`ParallelismConfig(cp_handler=...)`). runner's context
    parallel all-gathers the keys and values of a cp group (`runner.hardware.context_parallel`), which is
    Accelerate's default `cp_comm_strategy="allgather"` (unset: `PARALLELISM_CONFIG_CP_COMM_STRATEGY`);
    "alltoall" (torch's ring of key/value shards) is refused: runner has no ring."""

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "allgather")
        if self.cp_comm_strategy == "alltoall":
            raise ValueError(
                "TorchContextParallelConfig(cp_comm_strategy='alltoall') is not supported: runner's context "
                "parallel all-gathers each layer's keys and values over the cp group (the attention is the same "
                "either way) and has no ring that passes their shards on. Use cp_comm_strategy='allgather' (the "
                "default), or unset PARALLELISM_CONFIG_CP_COMM_STRATEGY."
            )
        if self.cp_comm_strategy != "allgather":
            raise ValueError(
                f"TorchContextParallelConfig(cp_comm_strategy={self.cp_comm_strategy!r}): expected 'allgather'."
            )


@dataclass
class ParallelismConfig:
    """Accelerate's layout of the ranks (`Accelerator(parallelism_config=...)`, or `accelerate launch
    --parallelism_config_*`): `dp_replicate_size` x `dp_shard_size` x `cp_size` x `tp_size` ranks, which
    must be the world size. A size left unset takes `PARALLELISM_CONFIG_<NAME>` (default 1), as under
    Accelerate. Replicas only: DDP; `dp_shard_size` above 1 (or an FSDP plugin): FSDP, HSDP with replicas;
    `tp_size` above 1: tensor parallel by the model's plan, FSDP over the rest; `cp_size` above 1 (with an
    FSDP2 plugin, as Accelerate requires): runner's context parallel, entered per step with
    `accelerator.maybe_context_parallel(...)`. Sequence parallel (`sp_size` above 1, DeepSpeed's Ulysses)
    is refused: runner has none."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: TorchContextParallelConfig | None = None
    sp_handler: Any = None

    def __post_init__(self) -> None:
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size"):
            value = getattr(self, name)
            if value is None:
                value = os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}", "1")
                value = int(value) if value.isdigit() else value
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig({name}={value!r}): expected an integer >= 1.")
            setattr(self, name, value)
        self.cp_backend = self.cp_backend or os.environ.get("PARALLELISM_CONFIG_CP_BACKEND", "torch")
        self.sp_backend = self.sp_backend or os.environ.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed")
        if self.cp_backend != "torch":
            raise ValueError(f"ParallelismConfig(cp_backend={self.cp_backend!r}): expected 'torch'.")
        if self.sp_size > 1:
            raise ValueError(
                f"ParallelismConfig(sp_size={self.sp_size}) is not supported: runner has no sequence parallel "
                "(DeepSpeed's Ulysses). Its context parallel splits sequences too: cp_size, with an FSDP plugin."
            )
        if self.cp_enabled:
            if self.cp_handler is None:
                self.cp_handler = TorchContextParallelConfig()
            elif not isinstance(self.cp_handler, TorchContextParallelConfig):
                raise ValueError(
                    f"ParallelismConfig(cp_handler=...): expected a TorchContextParallelConfig, got "
                    f"{type(self.cp_handler).__name__}."
                )
        if (self.tp_enabled or self.cp_enabled) and self.dp_replicate_enabled and not self.dp_shard_enabled:
            raise ValueError(
                f"ParallelismConfig(dp_replicate_size={self.dp_replicate_size}, tp_size={self.tp_size}, "
                f"cp_size={self.cp_size}): tensor or context parallel over pure replicas is not a layout (as under "
                "Accelerate). Shard instead: dp_shard_size above 1 (FSDP), with dp_replicate_size for HSDP."
            )

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    def _enabled(self, *names: str) -> list[str]:
        return [name for name in names if getattr(self, f"{name}_enabled")]

    @property
    def dp_dim_names(self) -> list[str]:
        """The mesh dimensions that read different data ("dp" in the device mesh, flattened)."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The mesh dimensions whose ranks read the same batches."""
        return self._enabled("tp", "cp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The dimensions FSDP shards over ("dp_shard_cp" in the device mesh)."""
        return self._enabled("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The dimensions a loss is averaged over ("dp_cp" in the device mesh)."""
        return self._enabled("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        return [*self._enabled("dp_replicate"), "dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    @property
    def total_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size * self.cp_size * self.tp_size * self.sp_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size
