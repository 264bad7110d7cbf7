"""The eval loop: a task's per-sample metrics averaged over a whole eval set, across processes, and over
each source's samples where the data is a mixture."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from runner.engine import Engine
from runner.task import SOURCE, Task


class Means:
    """Sums of per-sample values by metric name, over every sample and over each source's (the samples'
    `SOURCE` indices, where given), and the means the task summarizes."""

    def __init__(self, sources: Sequence[str]) -> None:
        self.sources = list(sources)
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.by_source: dict[str, torch.Tensor] = {}  # name -> sums by source index
        self.source_counts = torch.zeros(len(self.sources), dtype=torch.float64)

    def add(self, values: dict[str, torch.Tensor], tags: torch.Tensor | None) -> None:
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0) + value.double().sum()
            if tags is not None:
                sums = self.by_source.get(name, torch.zeros(len(self.sources), dtype=torch.float64))
                per_sample = value.double().reshape(len(value), -1).sum(1)
                self.by_source[name] = sums.to(value.device).index_add(0, tags, per_sample)
        self.count += len(next(iter(values.values())))
        if tags is not None:
            self.source_counts += torch.bincount(tags.cpu(), minlength=len(self.sources))

    def summarized(self, task: Task, prefix: str) -> dict[str, float]:
        """`<prefix>/<metric>` of every sample, then `<prefix>/<metric>/<source>` of each source evaluated."""
        means = {name: (total / self.count).item() for name, total in self.sums.items()}
        out = {f"{prefix}/{name}": value for name, value in task.summarize(means).items()}
        sums = {name: total.cpu() for name, total in self.by_source.items()}
        for index, source in enumerate(self.sources):
            if count := self.source_counts[index].item():
                of_source = task.summarize(
                    {name: (total[index] / count).item() for name, total in sums.items()}
                )
                out |= {f"{prefix}/{name}/{source}": value for name, value in of_source.items()}
        return out


@torch.no_grad()
def evaluate(
    engine: Engine,
    model: torch.nn.Module,
    task: Task,
    loader: Any,
    batch_done: Callable[[], None] = lambda: None,
    prefix: str = "eval",
    sources: Sequence[str] = (),
) -> dict[str, float]:
    """Average the task's per-sample metrics over the whole eval set (all processes), named
    `<prefix>/<metric>`; of a data mixture (`sources`, the names of the indices its samples' `SOURCE`
    give), over each source's samples too, `<prefix>/<metric>/<source>`. `batch_done` is called after each
    batch."""
    model.eval()
    means = Means(sources)
    for batch in loader:
        values = task.evaluation_step(model, batch)
        tagged = bool(sources) and isinstance(batch, dict) and SOURCE in batch
        gathered = engine.gather_for_metrics(values | {SOURCE: batch[SOURCE]} if tagged else values)
        tags = gathered.pop(SOURCE) if tagged else None
        means.add(gathered, tags)
        batch_done()
    model.train()
    return means.summarized(task, prefix)
