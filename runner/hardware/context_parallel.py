"""Context parallel: the ranks of a cp group each hold a share of every training sequence, so that the
activations of long sequences are spread over them.

The share is load-balanced for causal attention (torch's head-tail layout, `_HeadTailLoadBalancer`): each
sequence is cut into 2 x cp equal chunks and rank r keeps chunks r and 2cp - 1 - r, so that every rank's
queries see as many keys. A rank attends with its own queries to the keys and values of all ranks,
gathered (an all-gather in the forward, a reduce-scatter of their gradients in the backward), under the
causal mask in the tokens' global positions: the all-gather context parallel of Llama 3, which torch's
flex-attention context parallel also uses. It runs on any device and backend, gloo included (torch's ring
attention needs the CUDA attention kernels, its flex-attention path has no backward on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runner.errors import ConfigError
from runner.ops import apply_to_tensors
from runner.task import HF_LABELS, model_inputs
from runner.torch_internals import gathered_along, summed


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    """Which two of the 2 x `size` chunks of a sequence `rank` holds: one from each end."""
    return rank, 2 * size - 1 - rank


def positions_of(rank: int, size: int, local_length: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of the `local_length` tokens `rank` of `size` holds of each sequence."""
    chunk = local_length // 2
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks_of(rank, size)])


class ContextParallel:
    """The layout of the sequences over the ranks of `group`, and the operations that follow it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.share_length: int | None = None  # tokens of each sequence the last `shard` kept
        self.cutting = False  # inside `cut_in_place`: evaluation runs on the share too

    def applies(self, training: bool) -> bool:
        """Whether a forward runs on this rank's share: in training, and in evaluation inside
        `cut_in_place` (whose buffers are cut for it); evaluation elsewhere runs whole sequences."""
        return training or self.cutting

    def positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """The global positions of the `local_length` tokens this rank holds of each sequence (a model asks
        at the start of its forward). RuntimeError for sequences that were not cut (`shard`,
        `cut_in_place`): a model in training mode given whole sequences would otherwise attend over every
        rank's whole sequences."""
        if local_length != self.share_length:
            raise RuntimeError(
                f"context parallel: the model got sequences of {local_length} tokens in training mode, not the "
                f"share of {self.share_length} tokens cut from each batch. Compute the training loss with "
                "accelerator.training_loss(model, batch, loss_fn), or run the forward inside "
                "`with accelerator.maybe_context_parallel(buffers=[...], buffer_seq_dims=[...])` (Accelerate's "
                "way), or call model.eval() to run whole sequences."
            )
        return positions_of(self.rank, self.size, local_length, device)

    def share(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's share of the sequences of `tensor` along `dim`; ValueError when they do not split
        into 2 x cp equal chunks."""
        length = tensor.shape[dim]
        if length % (2 * self.size):
            raise ValueError(self._indivisible(length, self.size))
        self.share_length = length // self.size
        pieces = tensor.chunk(2 * self.size, dim=dim)
        return torch.cat([pieces[c] for c in chunks_of(self.rank, self.size)], dim=dim)

    def shard(self, batch: Any) -> Any:
        """This rank's share of every sequence in `batch`: each tensor of two or more dimensions (batch,
        sequence, ...) cut along the sequence."""
        return apply_to_tensors(lambda t: self.share(t) if t.dim() >= 2 else t, batch)

    @contextmanager
    def cut_in_place(
        self,
        buffers: list[torch.Tensor],
        seq_dims: list[int],
        no_restore: set[torch.Tensor] | None = None,
    ) -> Iterator[None]:
        """Cut each of `buffers` to this rank's share along its sequence dimension, in place (their shapes
        change), for the body; then put back the whole of each buffer not in `no_restore` (Accelerate's
        `maybe_context_parallel`, torch's `context_parallel` buffers). ValueError, before any buffer
        changes, for a count of dimensions that does not match, a `no_restore` buffer not among them, or
        sequences that do not split into 2 x cp chunks."""
        no_restore = no_restore or set()
        if len(buffers) != len(seq_dims):
            raise ValueError(
                f"maybe_context_parallel: {len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims; give one "
                "sequence dimension per buffer."
            )
        if any(not any(b is kept for b in buffers) for kept in no_restore):
            raise ValueError("maybe_context_parallel: no_restore_buffers must be a subset of buffers.")
        shares = [self.share(buffer, dim) for buffer, dim in zip(buffers, seq_dims, strict=True)]
        originals = [None if any(b is kept for kept in no_restore) else b.clone() for b in buffers]
        if buffers:
            self.share_length = shares[0].shape[seq_dims[0]]
        with torch.no_grad():
            for buffer, share in zip(buffers, shares, strict=True):
                buffer.resize_(share.shape).copy_(share)
        self.cutting = True
        try:
            yield
        finally:
            self.cutting = False
            with torch.no_grad():
                for buffer, original in zip(buffers, originals, strict=True):
                    if original is not None:
                        buffer.resize_(original.shape).copy_(original)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        dropout_p: float = 0.0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of this rank's queries (batch, heads, local sequence, head dim) over the keys
        and values of the whole sequences, gathered from the group (fewer key/value heads than query
        heads: grouped-query attention)."""
        local = query.shape[2]
        keys = gathered_along(key.contiguous(), 2, self.group)
        values = gathered_along(value.contiguous(), 2, self.group)
        mine = self.positions(local, query.device)
        gathered = torch.cat(
            [positions_of(rank, self.size, local, query.device) for rank in range(self.size)]
        )
        causal = mine[:, None] >= gathered[None, :]
        return F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=causal,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=keys.shape[1] != query.shape[1],
        )

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` (this rank's share's mean) with the value of the whole sequences' loss, the mean over the
        group (every share holds as many tokens), and the gradient of this rank's share: data-parallel
        averaging of the gradients over the group completes it."""
        total = summed(loss.detach(), self.group) / self.size
        return loss + (total - loss.detach())

    @staticmethod
    def check_sample(sample: Any, size: int) -> None:
        """ConfigError before launch when the sequences of `sample` (one sample of the training set, its
        model inputs) do not split into 2 x `size` equal chunks, or when its targets are not shifted yet
        (Hugging Face's `labels`, which the task shifts after the cut: each share would lose a token)."""
        if isinstance(sample, Mapping) and HF_LABELS in sample and "inputs" not in sample:
            raise ConfigError(
                f"hardware.cp_size={size}: the samples are Hugging Face's (`labels` equal to the inputs, shifted "
                "by the task after the model), and under context parallel each rank's share of a sequence is cut "
                "before the model, so every share would lose its boundary token. Use runner's samples (`inputs` "
                "and `targets` already shifted: data=sonnets, data=text), or hardware.cp_size=1."
            )
        args, kwargs = model_inputs(sample)
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] % (2 * size):
                raise ConfigError(
                    f"hardware.cp_size={size}: {ContextParallel._indivisible(value.shape[0], size)}"
                )

    @staticmethod
    def _indivisible(length: int, size: int) -> str:
        return (
            f"sequences of {length} tokens do not split into 2 x cp_size = {2 * size} equal chunks (each rank "
            f"keeps two, one from each end, for an even share of the causal attention). Use a sequence length "
            f"that is a multiple of {2 * size} (data.seq_len), or another cp_size."
        )
