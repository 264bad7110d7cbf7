"""A training script written for Accelerate's FSDP and `ParallelismConfig`: the same model and data under
each layout named on the command line. `tests/test_accelerate_compat.py` runs it ported to runner (the
import lines changed) under torchrun with 2 processes; under Accelerate itself it cannot be the
reference: on CPU ranks Accelerate wraps the model in DDP whatever the plugin says.

Usage: python sharded.py <out dir> <layout> [<layout> ...]  (each in turn, in the same processes)
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

LAYOUTS = {
    "ddp": {},
    "fsdp": {
        "fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=2,
            reshard_after_forward=False,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Block"],
            activation_checkpointing=True,
        )
    },
    "fsdp1_names": {"fsdp_plugin": FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP")},
    "replicas": {"parallelism_config": ParallelismConfig(dp_replicate_size=2)},
    "shards": {"parallelism_config": ParallelismConfig(dp_shard_size=2)},
    "launch_config": {},  # what `accelerate launch --use_fsdp ...` set in the environment
}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


def main(out: Path, layout: str) -> None:
    accelerator = Accelerator(**LAYOUTS[layout])
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), Block(), Block(), torch.nn.Linear(16, 1))
    block_forwards = []
    model[1].fc.register_forward_hook(lambda *args: block_forwards.append(1))  # recomputed: called again
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(64, 8, generator=data)
    loader = DataLoader(TensorDataset(inputs, inputs.sum(dim=1, keepdim=True)), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
    weight = accelerator.unwrap_model(model)[1].fc.weight
    mesh = accelerator.torch_device_mesh
    result = {
        "losses": losses,
        "distributed_type": str(accelerator.distributed_type),
        "sharded": [str(p) for p in getattr(weight, "placements", [])],
        "local_rows": weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0],
        "mesh": list(mesh.mesh_dim_names) if mesh is not None else None,
        "block_forwards_per_step": len(block_forwards) / len(losses),
        "data_parallel_rank": accelerator.data_parallel_rank,
        "flattened": {name: mesh[name].size() for name in ("dp", "dp_shard_cp", "dp_cp")} if mesh else None,
    }
    (out / f"{layout}_{accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        main(Path(sys.argv[1]), name)
