"""A pod of a Kubeflow Trainer TrainJob (runtime `torch-distributed`): one node of the job, whose ranks
runner starts itself. The runtime gives every pod the variables torchrun reads (their `PET_` prefix) and
no rank of its own: a pod is a node, not a rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class TrainJobNode:
    """This pod's place in its TrainJob, from the runtime's variables.

    Args:
        nodes: the job's pods (`PET_NNODES`: the TrainJob's `numNodes`).
        procs_per_node: the ranks each pod runs (`PET_NPROC_PER_NODE`: the TrainJob's `numProcPerNode`, a
            number where runner wrote the TrainJob; "auto", "cpu" or "gpu" are the runtime's other values).
        node_rank: this pod's index (`PET_NODE_RANK`: its Job's completion index).
        master_addr, master_port: where the pods meet: the first pod's name in the JobSet's headless
            service and the runtime's trainer port (`PET_MASTER_ADDR`, `PET_MASTER_PORT`).
    """

    nodes: int
    procs_per_node: str
    node_rank: int
    master_addr: str
    master_port: int

    variables: ClassVar[tuple[str, ...]] = (
        "PET_NNODES",
        "PET_NPROC_PER_NODE",
        "PET_NODE_RANK",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
    )

    @classmethod
    def detect(cls) -> TrainJobNode | None:
        """This pod's place; None outside a TrainJob's pod, and in a rank started there (by runner or torchrun)."""
        env = os.environ
        if any(name not in env for name in cls.variables) or "RANK" in env:
            return None
        return cls(
            nodes=int(env["PET_NNODES"]),
            procs_per_node=env["PET_NPROC_PER_NODE"],
            node_rank=int(env["PET_NODE_RANK"]),
            master_addr=env["PET_MASTER_ADDR"],
            master_port=int(env["PET_MASTER_PORT"]),
        )
