"""runner's `GPT` as transformers' `GPT2LMHeadModel` (`runner export --to hf`): the same architecture
exactly (learned positions, pre-LayerNorm blocks, exact GELU, scaled dot-product attention, LayerNorm eps
1e-5, tied or untied head), so the model is GPT-2's config and the same tensors under GPT-2's names. GPT-2
keeps q, k and v in one `Conv1D` (`c_attn`) and stores every `Conv1D` weight as (in, out): transposed. A
model built with `bias=false` gets zero biases, which compute what no bias does."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from runner.models.gpt import GPT


def gpt2_config(model: GPT) -> GPT2Config:
    """The `GPT2Config` of `model`'s sizes (no special tokens: runner's vocabularies have none)."""
    block = model.blocks[0]
    d_model = model.tok_emb.embedding_dim
    return GPT2Config(
        vocab_size=model.tok_emb.num_embeddings,
        n_positions=model.max_seq_len,
        n_embd=d_model,
        n_layer=len(model.blocks),
        n_head=d_model // block.attn.head_dim,
        n_inner=block.mlp.fc_in.out_features,
        activation_function="gelu",  # torch's exact GELU, F.gelu's default (GPT-2's own is the tanh one)
        resid_pdrop=model.drop.p,
        embd_pdrop=model.drop.p,
        attn_pdrop=block.attn.dropout,
        layer_norm_epsilon=block.ln_1.eps,
        tie_word_embeddings=model.lm_head.weight is model.tok_emb.weight,
        bos_token_id=None,
        eos_token_id=None,
        dtype=model.tok_emb.weight.dtype,
    )


def gpt2_weights(model: GPT) -> dict[str, torch.Tensor]:
    """`model`'s tensors under GPT-2's names, `Conv1D` weights transposed, absent biases as zeros."""

    def bias(linear: torch.nn.Module) -> torch.Tensor:
        if linear.bias is not None:
            return linear.bias.detach()
        return torch.zeros(linear.weight.shape[0], dtype=linear.weight.dtype)

    def conv1d(prefix: str, *linears: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}.weight": torch.cat([linear.weight.detach() for linear in linears]).T.contiguous(),
            f"{prefix}.bias": torch.cat([bias(linear) for linear in linears]),
        }

    weights = {
        "transformer.wte.weight": model.tok_emb.weight.detach(),
        "transformer.wpe.weight": model.pos_emb.weight.detach(),
        **_layer_norm("transformer.ln_f", model.ln_f),
        "lm_head.weight": model.lm_head.weight.detach(),
    }
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        weights |= _layer_norm(f"transformer.h.{i}.ln_1", block.ln_1)
        weights |= conv1d(f"transformer.h.{i}.attn.c_attn", attn.q_proj, attn.k_proj, attn.v_proj)
        weights |= conv1d(f"transformer.h.{i}.attn.c_proj", attn.o_proj)
        weights |= _layer_norm(f"transformer.h.{i}.ln_2", block.ln_2)
        weights |= conv1d(f"transformer.h.{i}.mlp.c_fc", mlp.fc_in)
        weights |= conv1d(f"transformer.h.{i}.mlp.c_proj", mlp.fc_out)
    return weights


def as_gpt2(model: GPT) -> GPT2LMHeadModel:
    """A `GPT2LMHeadModel` computing what `model` computes, in eval mode, holding copies of its tensors."""
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(gpt2_config(model))
    gpt2.load_state_dict(gpt2_weights(model), strict=True, assign=True)
    if gpt2.config.tie_word_embeddings:
        gpt2.lm_head.weight = gpt2.transformer.wte.weight
    return gpt2.eval()


def _layer_norm(prefix: str, norm: torch.nn.LayerNorm) -> dict[str, torch.Tensor]:
    weight = norm.weight.detach()
    return {
        f"{prefix}.weight": weight,
        f"{prefix}.bias": norm.bias.detach() if norm.bias is not None else torch.zeros_like(weight),
    }
