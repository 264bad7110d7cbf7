"""The generic train/eval loop, written against the public `Accelerator` API only."""

from __future__ import annotations

import inspect
import logging
import math
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from runner.accelerator import Accelerator
from runner.errors import ConfigError
from runner.task import Task
from runner.utils import set_seed
from runner.validate import locate

log = logging.getLogger(__name__)


def train(cfg: DictConfig, output_dir: Path) -> dict[str, float]:
    """Build everything from `cfg`, train, evaluate; return the final metrics.

    `output_dir` is the job's directory (Hydra's): the resolved config is written there once everything
    is built, so a run refused for bad input leaves nothing but its log.
    """
    trainer = cfg.trainer
    accelerator = Accelerator(
        strategy=instantiate(cfg.hardware),
        mixed_precision=instantiate(cfg.precision),
        gradient_accumulation_steps=trainer.gradient_accumulation_steps,
    )
    # Under torchrun or srun each rank ran Hydra itself: the job's dir is rank 0's.
    output_dir = Path(accelerator.broadcast_object_list([str(output_dir)])[0])
    set_seed(trainer.seed)

    data = instantiate(cfg.data)
    with accelerator.main_process_first():
        data.setup()
    train_loader, eval_loader = accelerator.prepare(
        data.train_dataloader(seed=trainer.seed), data.eval_dataloader()
    )
    model = instantiate(cfg.model, **model_dims(cfg.model, data.dims))
    task: Task = instantiate(cfg.task)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    total_steps = num_training_steps(trainer, len(train_loader))  # this rank's share of the batches
    # A prepared scheduler advances once per process on each optimizer step (Accelerate's convention).
    scheduler = instantiate(cfg.scheduler)(
        optimizer, num_training_steps=total_steps * accelerator.num_processes
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if accelerator.is_main_process:
        (output_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    log.info(
        "training %s (%.2fM parameters) for %d steps on %s, %d process(es), precision %s",
        type(accelerator.unwrap_model(model)).__name__,
        sum(p.numel() for p in model.parameters()) / 1e6,
        total_steps,
        accelerator.device,
        accelerator.num_processes,
        accelerator.mixed_precision,
    )

    metrics: dict[str, float] = {}
    progress = tqdm(
        total=total_steps,
        desc="train",
        dynamic_ncols=True,
        disable=not (trainer.progress_bar and accelerator.is_local_main_process),
    )
    step, epoch = 0, 0
    window_loss, window_batches = torch.zeros((), device=accelerator.device), 0
    model.train()
    while step < total_steps:
        train_loader.set_epoch(epoch)
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = task.training_step(model, batch)
                accelerator.backward(loss)
                if trainer.max_grad_norm is not None and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), trainer.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window_loss += loss.detach()
            window_batches += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            progress.update()

            if step % trainer.log_every == 0 or step == total_steps:
                metrics["train/loss"] = accelerator.reduce(window_loss / window_batches, "mean").item()
                metrics["train/lr"] = scheduler.get_last_lr()[0]
                window_loss.zero_()
                window_batches = 0
                progress.set_postfix(loss=f"{metrics['train/loss']:.4f}")
                log.debug("step %d: %s", step, _fmt(metrics))
            if step == total_steps or (trainer.eval_every and step % trainer.eval_every == 0):
                metrics.update(evaluate(accelerator, model, task, eval_loader))
                log.info("step %d/%d: %s", step, total_steps, _fmt(metrics))
            if step >= total_steps:
                break
        epoch += 1
    progress.close()
    accelerator.end_training()
    return metrics


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: torch.nn.Module, task: Task, loader: Any) -> dict[str, float]:
    """Average the task's per-sample metrics over the whole eval set (all processes)."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    count = 0
    for batch in loader:
        values = accelerator.gather_for_metrics(task.evaluation_step(model, batch))
        for name, value in values.items():
            sums[name] = sums.get(name, 0) + value.double().sum()
        count += len(next(iter(values.values())))
    model.train()
    means = {name: (total / count).item() for name, total in sums.items()}
    return {f"eval/{name}": value for name, value in task.summarize(means).items()}


def model_dims(model_cfg: DictConfig, dims: dict[str, int]) -> dict[str, int]:
    """The model arguments the data determines: fill those left null, refuse those that contradict it."""
    filled = {}
    for key, value in dims.items():
        if key not in model_cfg:
            continue
        if model_cfg[key] is None:
            filled[key] = value
        elif model_cfg[key] != value:
            raise ConfigError(
                f"model.{key}={model_cfg[key]} does not match the data, which has {key}={value}. "
                f"Set model.{key}=null to take it from the data, or change the data."
            )
    required = inspect.signature(locate(model_cfg._target_)).parameters.values()
    unset = [
        p.name
        for p in required
        if p.default is p.empty and model_cfg.get(p.name, 0) is None and p.name not in filled
    ]
    if unset:
        raise ConfigError(
            f"model.{unset[0]} is null and the data does not provide it (it provides {sorted(dims) or 'nothing'}). "
            f"Set model.{unset[0]} explicitly, or choose data that matches this model."
        )
    return filled


def num_training_steps(trainer: DictConfig, batches_per_epoch: int) -> int:
    """Optimizer steps to run: `max_steps`, else `max_epochs` epochs of (accumulated) batches."""
    if trainer.max_steps is not None:
        return trainer.max_steps
    return trainer.max_epochs * math.ceil(batches_per_epoch / trainer.gradient_accumulation_steps)


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in metrics.items())
