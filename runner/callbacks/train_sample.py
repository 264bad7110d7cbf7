"""An evaluation on a sample of the training set beside each evaluation (`trainer.eval_train_batches`, a
built-in callback named `eval_train`)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from runner.callbacks.base import Callback, Run
from runner.errors import ConfigError


class EvaluateTrainSample(Callback):
    """After each evaluation, the same metrics over `batches` batches a process of a fixed sample of the
    training set (drawn once with `trainer.seed`, the same sample on any number of processes), logged as
    `eval_train/...`: nanoGPT's train loss beside the eval loss, measured alike, so that the gap between
    them (overfitting) is read from one pair of curves. Its loader keeps no position in checkpoints."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.loader = None

    def on_fit_start(self, run: Run) -> None:
        dataset, engine = run.train_loader.dataset, run.engine
        if isinstance(dataset, IterableDataset):  # refused before launch (validate._stream_problems)
            raise ConfigError(f"trainer.eval_train_batches={self.batches}: the training data is a stream.")
        loader = run.train_loader  # its batch size, or (sharded over processes) its batch sampler's
        per_process = loader.batch_size or loader.batch_sampler.batch_size
        readers = engine.state.data_parallel_size
        size = min(len(dataset), self.batches * per_process * readers)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(run.settings.seed))
        loader = DataLoader(
            Subset(dataset, order[:size].tolist()),
            batch_size=per_process * (readers if engine.split_batches else 1),
            collate_fn=run.train_loader.collate_fn,
        )
        self.loader = engine.prepare_data_loader(loader, checkpointed=False)

    def on_eval_end(self, run: Run, metrics: dict[str, float]) -> None:
        run.evaluate(loader=self.loader, prefix="eval_train")
