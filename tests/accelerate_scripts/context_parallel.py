"""A training script written for Accelerate's context parallel, in the shape of its example
(examples/torch_native_parallelism/nd_parallel.py) made small: a Llama built from a config, packed sequences
with `shift_labels`, each step inside `accelerator.maybe_context_parallel(...)`, the loss averaged over
`torch_device_mesh["dp_cp"]`. tests/test_accelerate_compat.py runs it ported to runner (the import lines
changed) with 2 processes and `cp_size=2` against one process; under Accelerate itself it cannot run on CPU
ranks (torch's ring attention has no rule for the CPU attention kernel).

Usage: python context_parallel.py <out dir> <layout>   (layout: single | cp | launch_config, the last from
`accelerate launch --use_fsdp --fsdp_version=2 --use_parallelism_config --parallelism_config_cp_size=2`)
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN, VOCAB = 16, 64


def packed_dataset(sequences: int) -> list[dict]:
    """Sequences of SEQ_LEN + 1 tokens: inputs and their next tokens (no -100: every share counts alike)."""
    tokens = torch.randint(VOCAB, (sequences, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row[:-1].tolist(), "shift_labels": row[1:].tolist()} for row in tokens]


def collate_fn(batch: list[dict]) -> dict:
    input_ids = torch.tensor([item["input_ids"] for item in batch], dtype=torch.long)
    shift_labels = torch.tensor([item["shift_labels"] for item in batch], dtype=torch.long)
    return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels}


def main(out: Path, layout: str) -> None:
    parallelism_config, fsdp_plugin = None, None
    if layout == "cp":
        parallelism_config = ParallelismConfig(cp_size=2)
        fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
    accelerator = Accelerator(parallelism_config=parallelism_config, fsdp_plugin=fsdp_plugin)
    set_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(packed_dataset(16), batch_size=4, collate_fn=collate_fn)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []  # the sequence length the model's embedding sees, per forward
    accelerator.unwrap_model(model).model.embed_tokens.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[1])
    )

    losses, positions = [], []
    for _ in range(2):
        for batch in loader:
            batch["position_ids"] = torch.arange(0, batch["input_ids"].size(1)).unsqueeze(0)
            buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
            with accelerator.maybe_context_parallel(
                buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
            ):
                pc = accelerator.parallelism_config
                group = (
                    accelerator.torch_device_mesh["dp_cp"].get_group() if pc and pc.dp_cp_dim_names else None
                )
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                loss = loss.detach()
                if group is not None:  # gloo has no AVG
                    dist.all_reduce(loss, group=group)
                    loss /= dist.get_world_size(group)
            losses.append(loss.item())
            positions.append(batch["position_ids"][0].tolist())

    # A buffer left out of no_restore_buffers is whole again after the body.
    whole, kept = torch.arange(SEQ_LEN).unsqueeze(0), torch.arange(SEQ_LEN).unsqueeze(0)
    with accelerator.maybe_context_parallel(
        buffers=[whole, kept], buffer_seq_dims=[1, 1], no_restore_buffers={kept}
    ):
        inside = whole.shape[1]
    restored = {"inside": inside, "after": whole[0].tolist(), "kept": kept[0].tolist()}

    model.eval()
    with torch.no_grad():  # evaluation runs whole sequences
        batch = collate_fn(packed_dataset(4))
        eval_loss = model(**batch).loss.item()
        # ... or each rank's share of them, inside the context (the loss averaged as in training)
        batch["position_ids"] = torch.arange(0, SEQ_LEN).unsqueeze(0)
        buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1, 1]):
            shared_eval = model(**batch).loss
            if group is not None:
                dist.all_reduce(shared_eval, group=group)
                shared_eval /= dist.get_world_size(group)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save(state, out / f"{layout}_weights.pt")
    result = {
        "losses": losses,
        "eval_loss": eval_loss,
        "shared_eval_loss": shared_eval.item(),
        "positions": positions[0],
        "seen": sorted(set(seen)),
        "restored": restored,
        "mesh": list(accelerator.torch_device_mesh.mesh_dim_names) if accelerator.torch_device_mesh else None,
        "cp_rank": accelerator.context_parallel_rank if accelerator.parallelism_config else None,
    }
    (out / f"{layout}_{accelerator.process_index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
