"""The generic train/eval loop, written against the public `Accelerator` API only."""

from __future__ import annotations

import logging
import math
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from runner.accelerator import Accelerator
from runner.build import (
    build_data,
    build_model,
    build_on_meta,
    first_batch,
    load_start_weights,
    meta_training_step,
)
from runner.checkpoint import (
    ProjectConfiguration,
    checkpoint_number,
    latest_checkpoint,
    numbered_checkpoints,
    resume_checkpoint,
)
from runner.data.base import DataSource
from runner.errors import ConfigError, TrainingDiverged, TrainingInterrupted
from runner.hardware.base import Strategy
from runner.perf import Throughput, count_flops, memory_snapshot_on_oom, peak_flops, profiled
from runner.rng import set_seed
from runner.task import Task, batch_units, trains_by_loss

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the loop is, saved with every checkpoint: optimizer steps done, the epoch, micro-batches
    consumed in it, and the loss accumulated since the last log line."""

    window_loss: torch.Tensor  # on the device: adding to it never waits for the device
    step: int = 0
    epoch: int = 0
    batches: int = 0
    window_batches: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self), "window_loss": self.window_loss.item()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window_loss.fill_(state.pop("window_loss"))
        self.__dict__.update(state)


def train(cfg: DictConfig, output_dir: Path, strategy: Strategy | None = None) -> dict[str, float]:
    """Build everything from `cfg`, train, evaluate; return the final metrics.

    `output_dir` is the job's directory (Hydra's): the resolved config is written there once everything
    is built, so a run refused for bad input leaves nothing but its log. Checkpoints go to its
    `checkpoints/`, the final weights to `model/`. `strategy` is the hardware when this process built it
    already (the launching process, which validated it), else it is built from `cfg.hardware`. SIGTERM,
    SIGUSR1 or SIGUSR2 make every rank checkpoint at the next logging step (every `trainer.log_every`
    steps) and raise `TrainingInterrupted`.
    """
    trainer = cfg.trainer
    tracker = instantiate(cfg.tracker) if cfg.tracker._target_ else None
    accelerator = Accelerator(
        strategy=strategy or instantiate(cfg.hardware),
        mixed_precision=instantiate(cfg.precision),
        gradient_accumulation_steps=trainer.gradient_accumulation_steps,
        split_batches=trainer.split_batches,
        project_config=ProjectConfiguration(
            automatic_checkpoint_naming=True, total_limit=trainer.keep_checkpoints
        ),
        log_with=tracker,
        compile=OmegaConf.to_object(trainer.compile),
        activation_checkpointing=OmegaConf.to_object(trainer.activation_checkpointing),
    )
    # Under torchrun or srun each rank ran Hydra itself: the job's dir is rank 0's.
    output_dir = Path(accelerator.broadcast_object_list([str(output_dir)])[0])
    accelerator.project_configuration.project_dir = str(output_dir)
    # Number after what the dir holds (a run with trainer.resume=null in a dir that has checkpoints).
    existing = numbered_checkpoints(output_dir / "checkpoints")
    accelerator.project_configuration.iteration = checkpoint_number(existing[-1]) + 1 if existing else 0
    set_seed(trainer.seed)

    with accelerator.main_process_first():
        data = build_data(cfg)
    train_loader, eval_loader = accelerator.prepare(
        data.train_dataloader(seed=trainer.seed), data.eval_dataloader()
    )
    throughput = throughput_meter(cfg, data, accelerator)
    model = build_model(cfg, data)
    if cfg.checkpoint is not None:  # fine-tune from these weights
        load_start_weights(model, cfg.checkpoint)
    task: Task = instantiate(cfg.task)
    by_loss = trains_by_loss(task)  # a backend may compute it itself (pipeline parallel)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    total_steps = num_training_steps(trainer, len(train_loader))  # this rank's share of the batches
    # A prepared scheduler advances once per data-parallel process on each optimizer step (Accelerate's
    # convention; tensor-parallel ranks share their data), once only with split batches.
    advances = 1 if trainer.split_batches else accelerator.state.data_parallel_size
    scheduler = instantiate(cfg.scheduler)(optimizer, num_training_steps=total_steps * advances)
    num_parameters = sum(p.numel() for p in model.parameters())  # before a sharding backend partitions them
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    done = Progress(window_loss=torch.zeros((), device=accelerator.device))
    accelerator.register_for_checkpointing(done)
    # Rank 0's choice (checked before launch, see `resume_checkpoint`) for every rank.
    resumed = accelerator.broadcast_object_list([str(resume_checkpoint(trainer.resume, output_dir) or "")])[0]
    checkpoint = Path(resumed) if resumed else None
    if checkpoint is not None:
        configured = list(scheduler.scheduler.base_lrs)
        load_checkpoint(accelerator, checkpoint)
        keep_configured_lr(scheduler.scheduler, configured)
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)", checkpoint, done.step, done.epoch, done.batches
        )
    if accelerator.is_main_process:
        (output_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if tracker is not None:
        run_tags = {
            "hardware": type(accelerator.strategy).__name__,
            "precision": accelerator.mixed_precision,
            "world_size": accelerator.num_processes,
        }
        accelerator.init_trackers(
            cfg.tracker.experiment_name,
            config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
            init_kwargs={tracker.name: {"tags": run_tags}},
        )
    log.info(
        "training %s (%.2fM parameters) for %d steps on %s, %d process(es), precision %s",
        type(accelerator.unwrap_model(model)).__name__,
        num_parameters / 1e6,
        total_steps,
        accelerator.device,
        accelerator.num_processes,
        accelerator.mixed_precision,
    )

    metrics: dict[str, float] = {}
    progress = tqdm(
        total=total_steps,
        initial=done.step,
        desc="train",
        dynamic_ncols=True,
        disable=not (trainer.progress_bar and accelerator.is_local_main_process),
    )
    model.train()
    with (
        stop_signals() as received,
        closed_on_failure(accelerator),
        memory_snapshot_on_oom(
            trainer.memory_snapshot,
            accelerator.device,
            output_dir / f"memory_snapshot_rank{accelerator.process_index}.pickle",
        ),
        profiled(
            trainer.profile, output_dir / "profile", accelerator.process_index, accelerator.device
        ) as profiler,
    ):
        throughput.restart()
        while done.step < total_steps:
            train_loader.set_epoch(done.epoch)
            batches = (
                accelerator.skip_first_batches(train_loader, done.batches) if done.batches else train_loader
            )
            for batch in batches:
                with accelerator.accumulate(model):
                    loss = (
                        accelerator.training_loss(model, batch, task.loss)
                        if by_loss
                        else task.training_step(model, batch)
                    )
                    accelerator.backward(loss)
                    if trainer.max_grad_norm is not None and accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), trainer.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                done.batches += 1
                done.window_loss += loss.detach()
                done.window_batches += 1
                throughput.add(batch_units(batch)[1])
                if not accelerator.sync_gradients:
                    continue
                done.step += 1
                throughput.step()
                progress.update()
                if profiler is not None:
                    profiler.step()

                if done.step % trainer.log_every == 0 or done.step == total_steps:
                    window_loss = accelerator.reduce(done.window_loss / done.window_batches, "mean").item()
                    # After the .item(), which waited for the device: the window's time is its work.
                    perf = read_throughput(accelerator, throughput)
                    logged = {"train/loss": window_loss, "train/lr": scheduler.get_last_lr()[0], **perf}
                    metrics.update(logged)
                    done.window_loss.zero_()
                    done.window_batches = 0
                    check_finite(metrics, done.step, trainer, accelerator, output_dir)
                    if trainer.checkpoint_last_finite:
                        save_last_finite(accelerator, output_dir)
                    progress.set_postfix(
                        {"loss": f"{logged['train/loss']:.4f}"}
                        | {
                            name.removeprefix("perf/"): f"{logged[name]:.3g}"
                            for name in PROGRESS_BAR
                            if name in logged
                        }
                    )
                    accelerator.log(logged, step=done.step)
                    log.info("step %d/%d: %s", done.step, total_steps, _fmt(logged))
                if done.step == total_steps or (trainer.eval_every and done.step % trainer.eval_every == 0):
                    evaluated = evaluate(accelerator, model, task, eval_loader)
                    metrics.update(evaluated)
                    check_finite(metrics, done.step, trainer, accelerator, output_dir)
                    accelerator.log(evaluated, step=done.step)
                    log.info("step %d/%d: %s", done.step, total_steps, _fmt(metrics))
                if trainer.checkpoint_every and done.step % trainer.checkpoint_every == 0:
                    log.info("checkpoint %s", accelerator.save_state(blocking=not trainer.async_checkpoint))
                if received:
                    accelerator.set_trigger()
                # Checked where the loss is read anyway: the check waits for the device and the other ranks.
                if done.step % trainer.log_every == 0 and accelerator.check_trigger():
                    path = accelerator.save_state()
                    raise TrainingInterrupted(
                        f"stopped by a signal at step {done.step}/{total_steps}; checkpoint {path}. Run the same "
                        f"command with the same output dir ({output_dir}) to resume.",
                        signum=received[0] if received else None,
                    )
                if done.step >= total_steps:
                    break
            else:  # the epoch ran out before the steps did
                done.epoch += 1
                done.batches = 0
    progress.close()
    if not metrics:  # resumed from a checkpoint of the last step: nothing left to train
        log.info("the checkpoint was written at the last step (%d): evaluating only", done.step)
        metrics.update(evaluate(accelerator, model, task, eval_loader))
        accelerator.log(metrics, step=done.step)
    if trainer.save_model:
        accelerator.save_model(model, str(output_dir / "model"))
        # A transformers model's config next to its weights: from_pretrained loads the dir.
        model_config = getattr(accelerator.unwrap_model(model), "config", None)
        if accelerator.is_main_process and hasattr(model_config, "save_pretrained"):
            model_config.save_pretrained(output_dir / "model")
    for run_tracker in accelerator.trackers:  # the main process's
        for artifact in (output_dir / "resolved_config.yaml", *output_dir.glob("*.log")):  # and Hydra's log
            run_tracker.log_artifact(str(artifact))
        if run_tracker.log_model and trainer.save_model:
            run_tracker.log_artifact(str(output_dir / "model"), "model")
    # Free the prepared model while the process group lives: a DDP reducer collected after the group is
    # gone joins its gloo threads forever (a rank hung at exit).
    del model, optimizer, scheduler
    accelerator.free_memory()
    accelerator.end_training()
    return metrics


# The perf/* metrics the progress bar shows next to the loss.
PROGRESS_BAR = ("perf/tokens_per_s", "perf/samples_per_s", "perf/mfu")


def throughput_meter(cfg: DictConfig, data: DataSource, accelerator: Accelerator) -> Throughput:
    """What `perf/*` is measured with: the unit (tokens for batches of token ids, else samples), the
    model's training FLOPs per unit, counted once by torch's FLOP counter on a meta-device copy (forward
    and backward of the first batch: the model's FLOPs, without activation recomputation), and one
    device's peak FLOP/s (`hardware.peak_flops`, else `runner.perf`'s table)."""
    data_parallel = accelerator.state.data_parallel_size
    per_device = data_parallel if cfg.trainer.split_batches else 1
    unit, units = batch_units(first_batch(data, per_device))
    flops_per_unit = None
    try:
        with torch.random.fork_rng(devices=[]):  # whatever the user's model draws at init
            meta_model = build_on_meta(cfg, data)
            flops_per_unit = (
                count_flops(lambda: meta_training_step(cfg, meta_model, data, per_device)) / units
            )
    except Exception as err:  # a task that reads values (`.item()`) cannot run on meta tensors
        log.warning(
            "perf/mfu is not reported: the training step could not run on the meta device to count its FLOPs (%s)",
            str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
        )
    strategy = accelerator.strategy
    peak = strategy.peak_flops or peak_flops(strategy.device_name(), accelerator.mixed_precision)
    if peak is None:
        log.info(
            "perf/mfu is not reported: no peak FLOP/s is known for %s; set hardware.peak_flops",
            strategy.device_name(),
        )
    return Throughput(
        unit, flops_per_unit, peak, devices_per_batch=accelerator.num_processes // data_parallel
    )


def read_throughput(accelerator: Accelerator, throughput: Throughput) -> dict[str, float]:
    """The `perf/*` metrics over the processes: rates averaged, peak memory the largest."""
    local = throughput.read(accelerator.device)
    values = torch.tensor(list(local.values()), device=accelerator.device)
    every = accelerator.gather(values[None]).view(-1, len(local))
    return {
        name: (every[:, i].max() if "memory" in name else every[:, i].mean()).item()
        for i, name in enumerate(local)
    }


def load_checkpoint(accelerator: Accelerator, checkpoint: Path) -> None:
    """`load_state`, with a checkpoint that does not fit this run reported as a configuration error."""
    try:
        accelerator.load_state(str(checkpoint))
    except (RuntimeError, KeyError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(
            f"trainer.resume: {checkpoint} does not fit this run ({str(err).splitlines()[0][:300]}). Resume with the "
            "model, optimizer and data settings it was written with, or start fresh with trainer.resume=null."
        ) from err


def keep_configured_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, configured: list[float]) -> None:
    """A resumed run takes its learning rate from its config, not from the checkpoint (a lower one after a
    divergence): the schedule's base rates become the configured ones and the current rates are scaled
    alike. With the config unchanged this does nothing (bitwise resume)."""
    saved = list(scheduler.base_lrs)
    if saved == configured:
        return
    for group, before, after in zip(scheduler.optimizer.param_groups, saved, configured, strict=True):
        group["lr"] = group["lr"] * after / before if before else after
        group["initial_lr"] = after
    scheduler.base_lrs = list(configured)
    # What get_last_lr() says (and the log reports) until the next step.
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    log.info("learning rate from the config: %s (the checkpoint had %s)", configured, saved)


@contextmanager
def closed_on_failure(accelerator: Accelerator) -> Iterator[None]:
    """When the loop stops, first finish a checkpoint being written in the background; close the
    trackers' run as KILLED when it stopped on a signal (the run resumes later) and as FAILED when it
    raised; a run that ends well is closed FINISHED by `end_training`."""
    try:
        yield
    except BaseException as err:
        try:  # a checkpoint being written in the background is finished first (the other ranks may be gone)
            accelerator.wait_for_checkpoint(everyone=False)
        except Exception as failed:
            log.error("%s", failed)
        for tracker in accelerator.trackers:
            tracker.close("KILLED" if isinstance(err, TrainingInterrupted | KeyboardInterrupt) else "FAILED")
        accelerator.trackers.clear()
        raise


LAST_FINITE = "last_finite"  # in <output dir>/checkpoints: trainer.checkpoint_last_finite's state
CANDIDATE = ".last_finite.candidate"  # the newest state, until the next window's losses show it finite


def save_last_finite(accelerator: Accelerator, output_dir: Path) -> None:
    """At a logging step whose losses were all finite: the state saved at the previous logging step gave
    those losses, so it becomes checkpoints/last_finite; the state now is saved as the next candidate (its
    weights may already be ruined by this step's update: only the next window's losses can tell). Neither
    is one of the numbered checkpoints that `trainer.resume=auto` picks from."""
    checkpoints = output_dir / "checkpoints"
    if accelerator.is_main_process and (checkpoints / CANDIDATE).is_dir():
        shutil.rmtree(checkpoints / LAST_FINITE, ignore_errors=True)
        (checkpoints / CANDIDATE).rename(checkpoints / LAST_FINITE)
    naming = accelerator.project_configuration
    naming.automatic_checkpoint_naming = False  # save_state writes to the given dir (Accelerate's rule)
    try:
        accelerator.save_state(str(checkpoints / CANDIDATE))
    finally:
        naming.automatic_checkpoint_naming = True


def check_finite(
    metrics: dict[str, float], step: int, trainer: DictConfig, accelerator: Accelerator, output_dir: Path
) -> None:
    """Stop the run (TrainingDiverged, on every rank: the metrics are reduced over all of them) when a
    metric is NaN or infinite, naming the step, the learning rate, the precision and what to resume from.
    Nothing is saved now: the checkpoints written before stay, `latest` the last of them."""
    bad = {name: value for name, value in metrics.items() if not math.isfinite(value)}
    if not bad:
        return
    latest = latest_checkpoint(output_dir / "checkpoints")
    last_finite = output_dir / "checkpoints" / LAST_FINITE
    if last_finite.is_dir():
        resume = (
            f"The state of its last logging step whose loss was finite is in {last_finite}: resume from it with "
            f"trainer.resume={last_finite} and the changes above (a resumed run takes optimizer.lr from its config)."
        )
    elif latest is not None:
        resume = (
            f"Its last checkpoint, {latest}, was written before; resume from an earlier one with "
            "trainer.resume=<dir> if that one is already bad."
        )
    else:
        resume = "It wrote no checkpoint."
    if not trainer.checkpoint_last_finite:
        resume += " trainer.checkpoint_last_finite=true keeps the state of the last logging step whose loss was finite."
    raise TrainingDiverged(
        f"{', '.join(f'{name}={value}' for name, value in bad.items())} at step {step} (train/loss is the mean "
        f"of the last {trainer.log_every} steps' losses; learning rate {metrics.get('train/lr', float('nan')):.3g}, "
        f"precision {accelerator.mixed_precision}): training diverged and was stopped. Lower optimizer.lr, "
        "clip gradients (trainer.max_grad_norm=1.0), prefer precision=bf16 to fp16, and check the data for NaN "
        f"or inf. {resume}"
    )


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@contextmanager
def stop_signals() -> Iterator[list[int]]:
    """Record SIGTERM, SIGINT (Ctrl-C), SIGUSR1 and SIGUSR2 instead of dying, so that the loop checkpoints
    and stops at its next logging step (in the main thread only: elsewhere signals cannot be caught). A
    second Ctrl-C stops at once, without a checkpoint."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def record(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signum in received:
            raise KeyboardInterrupt
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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


def num_training_steps(trainer: DictConfig, batches_per_epoch: int) -> int:
    """Optimizer steps to run: `max_steps`, else `max_epochs` epochs of (accumulated) batches."""
    if trainer.max_steps is not None:
        return trainer.max_steps
    return trainer.max_epochs * math.ceil(batches_per_epoch / trainer.gradient_accumulation_steps)


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in metrics.items())
