"""A small decoder-only transformer (GPT-2 style, pre-LayerNorm, learned positions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runner.config import PositiveInt, Probability
from runner.models.checks import check_sizes
from runner.models.sequence_shares import SequenceShare

if TYPE_CHECKING:  # torch.distributed.tensor takes ~0.5 s to import: tp_plan imports it when asked
    from torch.distributed.tensor.parallel import ParallelStyle


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.n_heads={n_heads}.")
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = dropout
        self.sequence_share: SequenceShare | None = None  # context parallel (GPT.context_parallel)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` (batch, 1, seq, seq; True: attended) in place of the causal one (`document_mask`)."""
        batch, seq, _ = x.shape
        # Heads are inferred (-1) so that a tensor-parallel shard of the projections works unchanged.
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        dropout_p = self.dropout if self.training else 0.0
        if self.sequence_share is not None and self.sequence_share.applies(self.training):
            y = self.sequence_share.attention(q, k, v, dropout_p)
        elif mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d_model, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """One transformer layer: the sharding unit for FSDP and activation checkpointing."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, bias)
        self.ln_2 = nn.LayerNorm(d_model, bias=bias)
        self.mlp = FeedForward(d_model, mlp_ratio * d_model, dropout, bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask=mask)  # by name: a tensor-parallel plan prepares the inputs
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (batch, seq) to next-token logits (batch, seq, vocab_size). `bias=False`: no biases in
    the linear layers and the LayerNorms (nanoGPT's, Llama's); `scaled_init`: GPT-2's init of the
    projections that write into the residual stream (attention's output, the MLP's second layer), std
    0.02 / sqrt(2 n_layers) instead of 0.02, so that the stream's variance does not grow with depth."""

    _no_split_modules = ["Block"]  # kept whole on one device by a device map (the residual stream)
    attends_within_documents = True  # given position_ids (runner.task.attends_within_documents)

    def __init__(
        self,
        vocab_size: PositiveInt,
        max_seq_len: PositiveInt = 128,
        d_model: PositiveInt = 128,
        n_layers: PositiveInt = 2,
        n_heads: PositiveInt = 4,
        mlp_ratio: PositiveInt = 4,
        dropout: Probability = 0.0,
        tie_embeddings: bool = True,
        bias: bool = True,
        scaled_init: bool = False,
    ) -> None:
        super().__init__()
        check_sizes(
            dropout,
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            mlp_ratio=mlp_ratio,
        )
        self.max_seq_len = max_seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio, dropout, bias) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(_init_weights)
        if scaled_init:
            for block in self.blocks:
                for residual in (block.attn.o_proj, block.mlp.fc_out):
                    nn.init.normal_(residual.weight, mean=0.0, std=0.02 / (2 * n_layers) ** 0.5)
        self.sequence_share: SequenceShare | None = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` (batch, seq), each token's position in its document (`data.document_mask`, packed
        chat data): the position embeddings follow them, and each token attends within its document only."""
        x = _embed(self, input_ids, position_ids)
        mask = None if position_ids is None else document_mask(position_ids)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.lm_head(self.ln_f(x))

    def pipeline_stage(self, blocks: range, first: bool, last: bool) -> GPTStage:
        """What one pipeline stage runs: the embeddings if `first`, the blocks numbered `blocks`, the final
        norm and the head if `last`. It holds these modules themselves, under the names they have here."""
        return GPTStage(self, blocks, first, last)

    def context_parallel(self, share: SequenceShare) -> None:
        """Train on a share of each sequence (context parallel, `hardware.cp_size`): the positions of the
        tokens and the attention over the whole sequences follow `share`'s layout. In `eval()` the model
        takes whole sequences again."""
        self.sequence_share = share
        for block in self.blocks:
            block.attn.sequence_share = share

    def tp_plan(self, tp_size: int, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Megatron-style tensor parallelism over `tp_size` ranks: in every block q/k/v and the first MLP
        layer are split column-wise (each rank computes n_heads / tp_size heads and its slice of the
        hidden layer), the output projections row-wise (one all-reduce per sub-layer). Embeddings and the
        head stay replicated. With `sequence_parallel`, inside each block the residual stream and the
        layer norms are split along the sequence (the all-reduces become reduce-scatter + all-gather).
        ValueError if `tp_size` does not divide the heads or the MLP width."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleInputOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        n_heads = (
            self.blocks[0].attn.q_proj.out_features // self.blocks[0].attn.head_dim if self.blocks else 0
        )
        hidden = self.blocks[0].mlp.fc_in.out_features if self.blocks else 0
        if n_heads % tp_size:
            raise ValueError(
                f"tp_size={tp_size} does not divide model.n_heads={n_heads}: each rank computes whole heads."
            )
        if hidden % tp_size:
            raise ValueError(
                f"tp_size={tp_size} does not divide the MLP width {hidden} (model.mlp_ratio x model.d_model)."
            )
        sequence = Shard(1)
        rowwise = (
            RowwiseParallel(output_layouts=sequence, use_local_output=False)
            if sequence_parallel
            else RowwiseParallel()
        )
        plan: dict[str, ParallelStyle] = {
            "blocks.*.attn.q_proj": ColwiseParallel(),
            "blocks.*.attn.k_proj": ColwiseParallel(),
            "blocks.*.attn.v_proj": ColwiseParallel(),
            "blocks.*.attn.o_proj": rowwise,
            "blocks.*.mlp.fc_in": ColwiseParallel(),
            "blocks.*.mlp.fc_out": rowwise,
        }
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(Replicate(),))
            plan |= {
                # Enter a block split along the sequence, leave it whole.
                "blocks.*": PrepareModuleInputOutput(
                    input_layouts=(Replicate(),),
                    desired_input_layouts=(sequence,),
                    output_layouts=(sequence,),
                    desired_output_layouts=(Replicate(),),
                ),
                "blocks.*.ln_1": SequenceParallel(),
                "blocks.*.attn": gather,
                "blocks.*.ln_2": SequenceParallel(),
                "blocks.*.mlp": gather,
            }
        return plan

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0
    ) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after `input_ids` (batch, seq)."""
        for _ in range(max_new_tokens):
            logits = self(input_ids[:, -self.max_seq_len :])[:, -1] / max(temperature, 1e-6)
            next_id = torch.multinomial(F.softmax(logits.float(), dim=-1), 1)
            input_ids = torch.cat([input_ids, next_id], dim=1)
        return input_ids


class GPTStage(nn.Module):
    """A slice of a `GPT` for pipeline parallel: token ids (first stage) or the residual stream in, the
    residual stream or logits (last stage) out. Its parameters' names are the model's (`blocks.3....`),
    so that its state dict is the model's, restricted to this stage."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.max_seq_len, self.first, self.last = model.max_seq_len, first, last
        if first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = _embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """Block-causal attention from each token's position in its document (batch, seq): token i attends to
    token j when j <= i and j is in i's document (j >= i - positions[i]). (batch, 1, seq, seq), True:
    attended."""
    index = torch.arange(positions.shape[1], device=positions.device)
    first = (index - positions)[:, :, None]  # where each token's document starts
    return ((index[None, None, :] >= first) & (index[None, None, :] <= index[None, :, None]))[:, None]


def _embed(
    model: GPT | GPTStage, input_ids: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Token plus position embeddings of `input_ids` (batch, seq: under context parallel, this rank's
    share of the sequences), after dropout; `positions` (batch, seq): each token's, in place of 0, 1, ..."""
    share = getattr(model, "sequence_share", None)
    share = share if share is not None and share.applies(model.training) else None
    local = input_ids.shape[1]
    if positions is None:
        positions = (
            torch.arange(local, device=input_ids.device)
            if share is None
            else share.positions(local, input_ids.device)
        )
    seq = local * (1 if share is None else share.size)
    if seq > model.max_seq_len:
        raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={model.max_seq_len}.")
    return model.drop(model.tok_emb(input_ids) + model.pos_emb(positions))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
