"""Text generation from a byte-level language model, streamed token by token."""

from __future__ import annotations

import codecs
import sys
import time

import torch
import torch.nn.functional as F

from runner.config import NonNegativeFloat, PositiveInt, Seed
from runner.errors import ConfigError
from runner.task import InferenceTask, model_outputs


class TextGeneration(InferenceTask):
    """Sample `max_new_tokens` bytes after `prompt` and write each to stdout as it comes.

    Args:
        prompt: the text to continue.
        max_new_tokens: tokens (bytes) to generate.
        temperature: softmax temperature; 0 picks the most likely token every time.
        top_k: sample among the k most likely tokens only; None: all.
        seed: the sampling seed.
    """

    def __init__(
        self,
        prompt: str = "\n",
        max_new_tokens: PositiveInt = 200,
        temperature: NonNegativeFloat = 0.8,
        top_k: PositiveInt | None = None,
        seed: Seed = 0,
    ) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed

    @torch.no_grad()
    def run(self, model: torch.nn.Module) -> dict[str, float]:
        model.eval()
        generator = torch.Generator().manual_seed(self.seed)
        ids = torch.tensor([list(self.prompt.encode())])
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        sys.stdout.write(self.prompt)
        context = _context_length(model)
        started = time.perf_counter()
        for _ in range(self.max_new_tokens):
            logits = model_outputs(model, (ids[:, -context:],))[0, -1].float().cpu()
            next_id = self._pick(logits, generator)
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            sys.stdout.write(text.decode(bytes([int(next_id)])))
            sys.stdout.flush()
        sys.stdout.write(text.decode(b"", final=True) + "\n")
        seconds = time.perf_counter() - started
        return {
            "generate/tokens": float(self.max_new_tokens),
            "generate/tokens_per_s": self.max_new_tokens / seconds,
        }

    def _pick(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax()
        if self.top_k is not None:
            threshold = logits.topk(min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        return torch.multinomial(F.softmax(logits / self.temperature, dim=-1), 1, generator=generator)[0]


def _context_length(model: torch.nn.Module) -> int:
    """The longest input the model takes: runner's GPT's `max_seq_len`, a transformers model's
    `config.max_position_embeddings`."""
    length = getattr(model, "max_seq_len", None) or getattr(
        getattr(model, "config", None), "max_position_embeddings", None
    )
    if length is None:
        raise ConfigError(
            f"task=generate: {type(model).__name__} tells no context length (a `max_seq_len` attribute, or a "
            "transformers config's max_position_embeddings)."
        )
    return int(length)
