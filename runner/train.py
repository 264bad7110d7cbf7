"""The generic train/eval loop (`Trainer`), on runner's `Engine` (the Accelerator's API without
Accelerate's adapters); the periodic parts (logging with the NaN check, evaluation, checkpoints, the stop
signal) are its small named methods."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from runner.build import (
    Blueprint,
    build_data,
    build_model,
    build_optimizer,
    build_scheduler,
    load_start_weights,
    meta_copy,
    records_goodput,
)
from runner.callbacks import Callbacks, built_callbacks
from runner.callbacks.base import LeftOut
from runner.checkpoint.checkpointer import ProjectConfiguration, Schedule
from runner.checkpoint.resume import check_not_past, resume_checkpoint, resume_hint
from runner.cluster import time_before_start
from runner.config import Console, NonFinite, SpikeMetric, TrainerConfig, trainer_settings
from runner.data.base import DataSource, pins_memory
from runner.engine import Accumulation, Engine, Loading
from runner.errors import TrainingDiverged, TrainingInterrupted, signal_name
from runner.evaluation import evaluate
from runner.hardware.base import Strategy
from runner.models.model_dir import write_model_dir
from runner.perf import (
    Throughput,
    memory_snapshot_on_oom,
    mfu_unknown,
    parameters_text,
    peak_flops,
)
from runner.rng import rng_kept, set_rng_state, set_seed
from runner.run_dir import JOB_CONFIG_DIR, MODEL, RESOLVED, record_finished, resume_override
from runner.run_dir.log import FILE_ONLY
from runner.task import Task, batch_units, trains_by_loss
from runner.telemetry.console import metrics_line
from runner.telemetry.goodput import Ledger, job_began
from runner.trackers.base import Tracker

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the loop is, saved with every checkpoint: optimizer steps done, the epoch, micro-batches
    consumed in it, and the loss accumulated since the last log line."""

    window_loss: torch.Tensor  # on the device: adding to it never waits for the device
    last_loss: ClassVar[torch.Tensor | None] = None  # the last step's mean loss, where kept (StepProgress)
    step: int = 0
    epoch: int = 0
    batches: int = 0
    window_batches: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {**asdict(self), "window_loss": self.window_loss.item()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window_loss.fill_(state.pop("window_loss"))
        self.__dict__.update(state)

    def add(self, loss: torch.Tensor) -> None:
        """One micro-batch done, of this loss."""
        self.batches += 1
        self.window_loss += loss.detach()
        self.window_batches += 1

    def next_epoch(self) -> None:
        self.epoch += 1
        self.batches = 0


class StepProgress(Progress):
    """Progress that keeps each optimizer step's own mean loss (`last_loss`, for `trainer.spike`) and, where
    the prepared optimizer leaves out a step that is not finite (`trainer.on_nonfinite=skip`), joins a
    step's losses to the window once its step was taken."""

    def watching(self, engine: Engine) -> StepProgress:
        self.engine, self.step_batches = engine, 0
        self.step_loss, self.last_loss = torch.zeros_like(self.window_loss), torch.zeros_like(self.window_loss)
        return self

    def add(self, loss: torch.Tensor) -> None:
        self.batches += 1
        self.step_loss += loss.detach()
        self.step_batches += 1
        if self.engine.sync_gradients:  # the step's last micro-batch: its optimizer step was taken, or not
            torch.div(self.step_loss, self.step_batches, out=self.last_loss)
            if not (self.engine.skip_nonfinite_steps and self.engine.optimizer_step_was_skipped):
                self.window_loss += self.step_loss
                self.window_batches += self.step_batches
            self.step_loss.zero_()
            self.step_batches = 0


def train(
    cfg: DictConfig, output_dir: Path, strategy: Strategy | None = None, blueprint: Blueprint | None = None
) -> dict[str, float]:
    """Build everything from `cfg`, train, evaluate; return the final metrics (see `Trainer`)."""
    return Trainer(cfg, output_dir, strategy, blueprint).fit()


def evaluate_weights(
    cfg: DictConfig, output_dir: Path, strategy: Strategy | None = None, blueprint: Blueprint | None = None
) -> dict[str, float]:
    """`mode=evaluate`: the run built as for training on any hardware, `checkpoint=`'s weights loaded, its
    eval loop run once and logged (at step 0); nothing trained, checkpointed or saved. The eval metrics."""
    return Trainer(cfg, output_dir, strategy, blueprint).evaluate_only()


class Trainer:
    """One run of the generic loop: built from `cfg` by the constructor, trained by `fit`.

    `output_dir` is the job's directory (Hydra's): the resolved config is written there once everything
    is built, so a run refused for bad input leaves nothing but its log. Checkpoints go to its
    `checkpoints/`, the final weights to `model/`. `strategy` and `blueprint` are the hardware and the
    data (with the FLOP count) when this process built them already (the launching process, whose checks
    built them), else they are built from `cfg`. SIGTERM,
    SIGINT, SIGUSR1 or SIGUSR2 make every rank checkpoint at the next logging step (every
    `trainer.log_every` steps) and raise `TrainingInterrupted`.
    """

    def __init__(
        self,
        cfg: DictConfig,
        output_dir: Path,
        strategy: Strategy | None = None,
        blueprint: Blueprint | None = None,
    ) -> None:
        began = time.time()
        # Typed (a dataclass): the loop reads these settings at every step, and a DictConfig's attribute
        # costs microseconds where a dataclass's costs nanoseconds.
        self.settings = trainer = trainer_settings(cfg.trainer)
        tracker = instantiate(cfg.tracker) if cfg.tracker._target_ else None
        self.engine = engine = built_engine(cfg, trainer, strategy, tracker)
        self.checkpointer = engine.checkpointer
        self.checkpointer.schedule = Schedule.of(trainer)
        self.checkpointer.keep_trained_only()  # frozen weights (a PEFT model's base) come from the config
        # Under torchrun or srun each rank ran Hydra itself: the job's dir is rank 0's.
        self.output_dir = output_dir = Path(engine.broadcast_object_list([str(output_dir)])[0])
        engine.project_configuration.project_dir = str(output_dir)
        self.checkpointer.number_after_existing()
        # The goodput ledger: the main process's phases.
        recorded = engine.is_main_process and records_goodput(cfg)
        ledger = Ledger(
            output_dir if recorded else None, job_began(), time_before_start("startup")
        )
        ledger.lap("startup", until=began)
        ledger.lap("rendezvous", world_size=engine.num_processes)
        set_seed(trainer.seed)

        data = self.prepare_loaders(cfg, blueprint)
        ledger.lap("data")
        described = self.prepare_training(cfg, data, blueprint)
        self.done = progress_of(engine, trainer)
        self.clip_to = clip_norm(trainer)
        self.grad_norm: torch.Tensor | None = None
        self.rolling_back: Path | None = None  # the checkpoint a callback asked the run to return to
        evaluating = cfg.get("mode") == "evaluate"  # the eval loop only (`evaluate_only`): the watchdog only
        named = built_callbacks(
            cfg.get("callbacks"), trainer, evaluating, ledger, engine.num_processes, data.mixture
        )
        self.callbacks = Callbacks(named)
        self.stopped: str | None = None  # why a callback ended the run early
        self.evaluated_at: int | None = None  # the step of the latest evaluation
        engine.register_for_checkpointing(self.done, self.callbacks)
        ledger.lap("setup")
        self.resume(enabled=not evaluating)
        ledger.lap("restore", resumed_at=self.done.step)
        self.config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        if engine.is_main_process:
            (output_dir / RESOLVED).write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if tracker is not None:
            self.start_tracking(tracker)
        ledger.lap("setup")
        what = f"from {cfg.checkpoint}" if evaluating else f"for {self.total_steps} steps"
        log.info("%s %s %s on %s, %d process(es), precision %s", "evaluating" if evaluating else "training",
                 described, what, engine.device, engine.num_processes, engine.precision.name)  # fmt: skip
        if engine.num_processes > 1:
            log.info("layout: %s", engine.strategy.layout(engine.num_processes))
        self.metrics: dict[str, float] = {}

    def prepare_training(self, cfg: DictConfig, data: DataSource, blueprint: Blueprint | None) -> str:
        """Build the model (its FLOPs counted on a meta copy; the starting weights of `checkpoint=` loaded),
        the task, the optimizer and the LR schedule over the run's steps, and prepare them; the model
        described for the log ("GPT (1.2M parameters)", as built: before a backend wraps or partitions it)."""
        engine, trainer = self.engine, self.settings
        model = build_model(cfg, data)
        per_device = engine.state.data_parallel_size if trainer.split_batches else 1
        blueprint = blueprint or Blueprint(cfg, data, meta_copy(model), per_device)
        self.throughput = throughput_meter(blueprint, engine)
        if cfg.checkpoint is not None:  # fine-tune from these weights
            load_start_weights(model, cfg.checkpoint)
        self.task: Task = instantiate(cfg.task)
        optimizer = build_optimizer(cfg, model)
        self.total_steps = num_training_steps(trainer, self.train_loader)
        # A prepared scheduler advances once per data-parallel process on each optimizer step (Accelerate's
        # convention; tensor-parallel ranks share their data), once only with split batches.
        advances = 1 if trainer.split_batches else engine.state.data_parallel_size
        scheduler = build_scheduler(cfg, optimizer, self.total_steps * advances, advances)
        described = f"{type(model).__name__} ({parameters_text(model)})"
        self.model, self.optimizer, self.scheduler = engine.prepare(model, optimizer, scheduler)
        # The loss of a batch, for `backward`: by the task's `loss` the strategy computes it (pipeline
        # parallel runs its schedule there), else by the task's own `training_step`.
        self.loss_of = (
            engine.loss_of_batch(self.model, self.task.loss)
            if trains_by_loss(self.task)
            else partial(self.task.training_step, self.model)
        )
        return described

    def prepare_loaders(self, cfg: DictConfig, blueprint: Blueprint | None) -> DataSource:
        """The run's data (the blueprint's, else read here: the first process of each node first) with its
        train and eval loaders prepared, `trainer.overfit_batches` and `limit_*_batches` applied. What it
        read (`DataSource.identity`) goes into every checkpoint, checked against the data of a run resuming
        it."""
        engine, trainer = self.engine, self.settings
        if blueprint is not None:  # read after this seed: the RNGs go on as reading it left them
            data = blueprint.data
            if blueprint.rng is not None:
                set_rng_state(blueprint.rng)
        else:
            with engine.main_process_first():
                data = build_data(cfg)
        if (identity := data.identity()) is not None:
            engine.checkpointer.facts["data"] = identity
        if trainer.overfit_batches:  # each process's first N batches
            processes = 1 if trainer.split_batches else engine.state.data_parallel_size
            data.overfit(trainer.overfit_batches * data.batch_size * processes)
        self.train_loader, self.eval_loader = engine.prepare(
            data.train_dataloader(seed=trainer.seed), data.eval_dataloader()
        )
        self.train_loader.limit_batches = trainer.limit_train_batches
        self.eval_loader.limit_batches = trainer.limit_eval_batches
        self.sources = list(data.mixture)  # a mixture's: evaluated each on its own too
        return data

    def start_tracking(self, tracker: Tracker) -> None:
        """Open the tracker's run (each tracker's own project setting), named and tagged after the job, with
        the resolved config; resumed, the steps past the checkpoint that the stopped run logged come again."""
        engine = self.engine
        run_tags = {
            "hardware": type(engine.strategy).__name__,
            "precision": engine.mixed_precision,
            "world_size": engine.num_processes,
        }
        run_name, job_tags = job_identity(self.output_dir)
        engine.init_trackers(
            None,
            config=self.config,
            init_kwargs={
                tracker.name: {
                    "tags": run_tags | job_tags,
                    "resumed_at": self.resumed_at,
                    "run_name": run_name,
                }
            },
        )

    def resume(self, enabled: bool = True) -> None:
        """Continue from the checkpoint `trainer.resume` names (rank 0's choice, checked before launch by
        `check_resume`, for every rank), with the configured learning rate; not `enabled`: start afresh."""
        chosen = resume_checkpoint(self.settings.resume, self.output_dir) if enabled else None
        resumed = self.engine.broadcast_object_list([str(chosen or "")])[0]
        self.resumed_at: int | None = None
        if resumed:
            steps = self.checkpointer.resume(Path(resumed))
            done = self.done
            # The loop's count of optimizer steps (its Progress) is the one a checkpoint records.
            self.engine.optimizer_step, self.engine.micro_step = done.step, steps.micro
            check_not_past(resumed, done.step, self.total_steps)  # a length in epochs: known here
            self.resumed_at = done.step
            log.info(
                "resumed from %s at step %d (epoch %d, batch %d)",
                resumed,
                done.step,
                done.epoch,
                done.batches,
            )

    def fit(self) -> dict[str, float]:
        """Train to `total_steps`, logging, evaluating and checkpointing on the way; then `finish`."""
        done = self.done
        self.model.train()
        self.sync = self.engine.gradient_state  # read at every micro-batch: its attribute, not a property
        self.before_save = partial(self.callbacks.on_checkpoint_start, self)
        with self.running() as received:
            self.callbacks.on_fit_start(self)
            self.throughput.restart(done.step)
            self.checkpointer.restart_clock()  # `trainer.checkpoint_every_s` counts from here
            while done.step < self.total_steps and self.stopped is None:
                self.train_loader.set_epoch(done.epoch)
                for batch in self.callbacks.train_batches(self, self.batches_left_in_epoch()):
                    if not self.train_step(batch):
                        continue  # a micro-batch of an accumulation
                    if self.step_done(received):
                        break
                else:  # the epoch ran out before the steps did
                    done.next_epoch()
            if self.stopped is not None and done.step < self.total_steps:
                self.end_early()
            self.callbacks.on_train_end(self)
        return self.finish()

    def step_done(self, received: list[int]) -> bool:
        """After an optimizer step: its progress told (the callbacks), then what is due at it
        (the log line, the evaluation, the checkpoints, a stop signal's checkpoint and exit) and the
        callbacks. Whether the epoch's pass ends here: its last step, a callback stopped the run, or rolled
        it back (the pass starts again)."""
        done, trainer = self.done, self.settings
        done.step += 1
        self.callbacks.on_optimizer_step(self)
        if self.rolling_back is not None:  # the epoch's pass starts again, at the data's position
            self.roll_back_now(self.rolling_back)
            return True
        last = done.step >= self.total_steps
        log_step = done.step % trainer.log_every == 0
        if last or log_step:
            self.log_window()
        if last or (trainer.eval_every and done.step % trainer.eval_every == 0):
            self.evaluate()
        stopping = log_step and self.stop_requested(received)
        path = self.checkpoint(logging=last or log_step, stop=stopping)
        if stopping:
            raise self.interrupted(received, path)
        self.callbacks.on_step_end(self)
        return last or self.stopped is not None

    def end_early(self) -> None:
        """A callback stopped the run before its last step: the loss since the last log line and the final
        evaluation a run's end makes, unless this step had one."""
        done = self.done
        log.info("stopped at step %d/%d: %s", done.step, self.total_steps, self.stopped)
        if done.window_batches:
            self.log_window()
        if self.evaluated_at != done.step:
            self.evaluate()

    def evaluate_only(self) -> dict[str, float]:
        """`mode=evaluate`: the eval loop once on the weights loaded ("evaluated: ..."; tracked at step 0),
        then the model is released as `finish` releases it. The eval metrics."""
        with self.running():
            self.callbacks.on_fit_start(self)
            self.evaluate(heading="evaluated")
            self.callbacks.on_train_end(self)
        del self.model, self.optimizer, self.scheduler, self.loss_of
        self.engine.free_memory()
        self.engine.end_training()
        self.callbacks.on_fit_end(self, self.metrics)
        return self.metrics

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.done.step

    def stop(self, reason: str) -> None:
        """End the run after this step (a callback's call, made alike on every rank)."""
        self.stopped = reason

    def roll_back(self, checkpoint: Path) -> None:
        """Return to `checkpoint` after this step (a callback's call, made alike on every rank)."""
        self.rolling_back = checkpoint

    def roll_back_now(self, checkpoint: Path) -> None:
        """Return to `checkpoint` with the data where it is (`Checkpointer.roll_back_to`; the Progress's
        position too): the batches since the checkpoint are left out; the callbacks' `on_rollback`."""
        done, self.rolling_back = self.done, None
        from_step, end = done.step, (done.epoch, done.batches)
        steps = self.checkpointer.roll_back_to(checkpoint)
        self.engine.optimizer_step, self.engine.micro_step = done.step, steps.micro
        left_out = LeftOut((done.epoch, done.batches), end)
        done.epoch, done.batches = end
        self.throughput.restart(done.step)
        self.callbacks.on_rollback(self, from_step, left_out)

    @property
    def step_loss(self) -> torch.Tensor | None:
        return self.done.last_loss

    def batches_left_in_epoch(self) -> Any:
        """The train loader, past the batches of this epoch a resumed run consumed already (a loader that
        resumes by itself, a stream's, is past them)."""
        skip = 0 if self.train_loader.resumes_itself else self.done.batches
        return self.engine.skip_first_batches(self.train_loader, skip) if skip else self.train_loader

    def train_step(self, batch: Any) -> bool:
        """Forward and backward of one micro-batch; at a synchronisation step, clip and step. Whether the
        optimizer stepped (the last micro-batch of an accumulation). An error names the step it was in."""
        engine, done = self.engine, self.done
        try:
            with engine.accumulate(self.model):
                loss = self.loss_of(batch)
                engine.backward(loss)
                if self.clip_to is not None and engine.sync_gradients:
                    self.grad_norm = engine.clip_grad_norm_(self.model.parameters(), self.clip_to)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
        except Exception as err:  # which step, for the user's report of it (describe_exception)
            err.add_note(f"(at optimizer step {done.step + 1} of {self.total_steps}, epoch {done.epoch})")
            raise
        done.add(loss)
        self.throughput.add(batch_units(batch)[1])
        return self.sync.sync_gradients

    def checkpoint(self, logging: bool, stop: bool) -> Path | None:
        """The checkpoints the Checkpointer finds due after this step (`save_if_due`: `logging`, a step
        whose losses were logged finite; `stop`, the run ends next); for a numbered one, the log line and
        the callbacks' `on_checkpoint`. Its path, else None."""
        engine = self.engine
        path = self.checkpointer.save_if_due(
            engine.optimizer_step, engine.micro_step, logging, stop, self.before_save
        )
        if path is not None:
            log.info("checkpoint %s", path)
            self.callbacks.on_checkpoint(self, path)
        return path

    def log_window(self) -> None:
        """The mean loss over the steps since the last log line, the learning rate and the `perf/*`
        metrics: checked finite, logged, and (`trainer.checkpoint_last_finite`) the state kept."""
        engine, done = self.engine, self.done
        # None when every step of the window was left out (`trainer.on_nonfinite=skip`: alike on every rank).
        loss = {"train/loss": done.window_loss.item() / done.window_batches} if done.window_batches else {}
        # After the .item(), which waited for the device: the window's time is its work.
        window = across_processes(engine, loss | self.throughput.read(engine.device, done.step))
        logged = {
            **{name: window.pop(name) for name in loss},
            "train/lr": self.scheduler.get_last_lr()[0],
            **window,
        }
        done.window_loss.zero_()
        done.window_batches = 0
        if log.isEnabledFor(logging.INFO):  # before the callbacks' words on this window (a straggler named)
            log.info("step %d/%d: %s", done.step, self.total_steps, metrics_line(logged, self.full_console))
        self.log_metrics(logged)

    def evaluate(self, heading: str | None = None, loader: Any = None, prefix: str = "eval") -> None:
        """The task's metrics over the whole eval set (or a prepared `loader` of other samples, its metrics
        named `<prefix>/...`), checked finite and logged, under `heading` (default: the step, "step
        40/200"); the eval set's then go to `on_eval_end`. What it draws from the RNGs (the eval loader's
        seed, say) is not training's: how often a run evaluates does not change it."""
        batches = self.eval_loader if loader is None else loader
        with rng_kept():
            evaluated = self.eval_metrics(batches, prefix)
        self.log_metrics(evaluated)
        step = heading or f"step {self.done.step}/{self.total_steps}"
        log.info("%s: %s", step, metrics_line(evaluated, self.full_console))
        if loader is None:
            self.evaluated_at = self.done.step
            self.callbacks.on_eval_end(self, evaluated)

    @property
    def full_console(self) -> bool:
        """Whether the console says every figure (`trainer.console=full`)."""
        return self.settings.console == Console.full

    def eval_metrics(self, loader: Any, prefix: str = "eval") -> dict[str, float]:
        """The task's metrics over `loader`'s samples (`evaluate`; a mixture's, of each source too)."""
        return evaluate(self.engine, self.model, self.task, loader, self.eval_batch_done, prefix, self.sources)

    def eval_batch_done(self) -> None:
        self.callbacks.on_eval_batch_end(self)

    def log_metrics(self, values: dict[str, float]) -> None:
        """Log `values` at this step: the run's latest metrics, checked finite (a NaN or infinity stops the
        run here, `check_finite`), then the trackers and the callbacks (the history, `history.jsonl`)."""
        self.metrics.update(values)
        self.check_finite()
        self.log(values)

    def log(self, values: dict[str, float]) -> None:
        """Log `values` at this step to the trackers and the callbacks, not as the run's metrics."""
        self.engine.log(values, step=self.done.step)
        self.callbacks.on_log(self, values)

    def check_finite(self) -> None:
        """Stop the run (TrainingDiverged, on every rank: the metrics are reduced over all of them) when a
        metric is NaN or infinite, naming the step, the learning rate, the precision and what to resume from.
        Nothing is saved now: the checkpoints written before stay, `latest` the last of them."""
        metrics, trainer = self.metrics, self.settings
        bad = {name: value for name, value in metrics.items() if not math.isfinite(value)}
        if not bad:
            return
        raise TrainingDiverged(
            f"{', '.join(f'{name}={value}' for name, value in bad.items())} at step {self.done.step} "
            f"(train/loss is the mean of the last {trainer.log_every} steps' losses; learning rate "
            f"{metrics.get('train/lr', float('nan')):.3g}, precision {self.engine.precision.name}): training "
            "diverged and was stopped. Lower optimizer.lr, clip gradients (trainer.max_grad_norm=1.0), "
            "prefer precision=bf16 to fp16, and check the data for NaN or inf. "
            f"{resume_hint(self.checkpointer.project.checkpoints_dir, trainer.checkpoint_last_finite)}"
        )

    def stop_requested(self, received: list[int]) -> bool:
        """Asked at a logging step (where the loss is read anyway: the check waits for the device and the
        other ranks): whether a stop signal reached any rank."""
        if received:
            self.engine.set_trigger()
        return self.engine.check_trigger()

    def interrupted(self, received: list[int], path: Path | None) -> TrainingInterrupted:
        """The error that ends a run stopped by a signal, once its checkpoint `path` is saved."""
        signum = received[0] if received else None  # None: another rank was signalled
        return TrainingInterrupted(
            f"stopped by {signal_name(signum)} at step {self.done.step}/{self.total_steps}; checkpoint {path}. Run "
            f"the same command with {resume_override(self.output_dir)} to resume.",
            signum=signum,
        )

    @contextmanager
    def running(self) -> Iterator[list[int]]:
        """What surrounds the loop: the stop signals it records, the trackers' runs closed on failure, the
        memory snapshot on an out-of-memory error."""
        engine, trainer, rank = self.engine, self.settings, self.engine.process_index
        with (
            stop_signals() as received,
            closed_on_failure(engine),
            memory_snapshot_on_oom(
                trainer.memory_snapshot,
                engine.device,
                self.output_dir / f"memory_snapshot_rank{rank}.pickle",
            ),
        ):
            try:
                yield received
            except BaseException as err:
                self.callbacks.on_exception(self, err)
                raise

    def finish(self) -> dict[str, float]:
        """Evaluate a run that had nothing left to train, save the model, log the artifacts, and release
        everything; the final metrics."""
        engine, output_dir = self.engine, self.output_dir
        if not self.metrics:  # resumed from a checkpoint of the last step: nothing left to train
            log.info("the checkpoint was written at the last step (%d): evaluating only", self.done.step)
            self.log_metrics(self.eval_metrics(self.eval_loader))
        if self.settings.save_model:
            weights = engine.get_state_dict(self.model)  # a collective
            if engine.is_main_process:
                write_model_dir(engine.unwrap_model(self.model), weights, output_dir / MODEL)
            engine.wait_for_everyone()
        engine.wait_for_checkpoint()  # one of the last step, written in the background, is whole
        if self.settings.fast_dev_run:
            log.info("trainer.fast_dev_run: everything ran; no results recorded")
        elif engine.is_main_process:  # the results are whole: a run in this dir now finds them finished
            final = self.checkpointer.latest_at(self.done.step)
            record_finished(output_dir, self.done.step, self.config, self.metrics, final)
        for run_tracker in engine.trackers:  # the main process's
            for artifact in (output_dir / RESOLVED, *output_dir.glob("*.log")):  # and Hydra's
                run_tracker.log_artifact(str(artifact))
            if run_tracker.log_model and self.settings.save_model:
                run_tracker.log_artifact(str(output_dir / MODEL), "model")
        self.callbacks.on_fit_end(self, self.metrics)
        # Free the prepared model while the process group lives: a DDP reducer collected after the group is
        # gone joins its gloo threads forever (a rank hung at exit).
        del self.model, self.optimizer, self.scheduler, self.loss_of
        engine.free_memory()
        engine.end_training()
        return self.metrics


def progress_of(engine: Engine, trainer: TrainerConfig) -> Progress:
    """The loop's Progress: one that keeps each step's loss where a step may be left out
    (`trainer.on_nonfinite=skip`) or spikes are watched (`trainer.spike`)."""
    window_loss = torch.zeros((), device=engine.device)
    if engine.skip_nonfinite_steps or trainer.spike.window:
        return StepProgress(window_loss).watching(engine)
    return Progress(window_loss)


def clip_norm(trainer: TrainerConfig) -> float | None:
    """What the loop clips the gradients' total norm to, measuring it: `trainer.max_grad_norm`, else
    infinity (measured, not clipped) where `trainer.spike` watches it; None: neither."""
    watched = trainer.spike.window and SpikeMetric.grad_norm in trainer.spike.metrics
    return math.inf if trainer.max_grad_norm is None and watched else trainer.max_grad_norm


def built_engine(
    cfg: DictConfig, trainer: TrainerConfig, strategy: Strategy | None, tracker: Tracker | None
) -> Engine:
    """The Engine a run trains on: the hardware (`strategy` where the launching process built it already),
    the precision, the accumulation, how batches are loaded, numbered checkpoints (`trainer.keep_*`), the
    tracker, the compute options."""
    return Engine(
        strategy or instantiate(cfg.hardware),
        instantiate(cfg.precision),
        accumulation=Accumulation(steps=trainer.gradient_accumulation_steps),
        # batches from pinned memory are copied to the device without waiting
        loading=Loading(
            split_batches=trainer.split_batches, non_blocking=pins_memory(cfg.data.get("pin_memory"))
        ),
        project_config=ProjectConfiguration(
            automatic_checkpoint_naming=True, total_limit=trainer.keep_checkpoints
        ),
        trackers=[tracker] if tracker is not None else [],
        compile=trainer.compile,
        activation_checkpointing=trainer.activation_checkpointing,
        skip_nonfinite_steps=trainer.on_nonfinite == NonFinite.skip,
    )


def job_identity(output_dir: Path) -> tuple[str, dict[str, str]]:
    """The tracker run's name and the tags that lead back to the job: a sweep's job is named `<sweep
    dir>/<job dir>` (`<date>_<time>/<job number>`), a run by its dir; tags `runner.run_dir`,
    `runner.overrides` (the command line's) and, in a sweep, `runner.sweep_job`. Read from the job's
    `.hydra/hydra.yaml`, which the command wrote before it launched the ranks (wherever they run); without
    it, the dir alone."""
    tags = {"runner.run_dir": str(output_dir.resolve())}
    written = output_dir / JOB_CONFIG_DIR / "hydra.yaml"
    if not written.is_file():
        return output_dir.name, tags
    hydra = OmegaConf.load(written).hydra
    tags["runner.overrides"] = " ".join(hydra.overrides.task)
    if str(hydra.mode) == "MULTIRUN":
        tags["runner.sweep_job"] = str(hydra.job.num)
        return f"{output_dir.parent.name}/{output_dir.name}", tags  # <sweep dir>/<its subdir, the number>
    return output_dir.name, tags


def throughput_meter(blueprint: Blueprint, engine: Engine) -> Throughput:
    """What `perf/*` is measured with: the unit (tokens for batches of token ids, else samples), the
    model's training FLOPs per unit (the blueprint's count: forward and backward of the first batch, on a
    meta model, without activation recomputation), and one device's peak FLOP/s (`hardware.peak_flops`,
    else `runner.perf`'s table)."""
    unit, units = batch_units(blueprint.batch)
    flops_per_unit = None
    try:
        flops_per_unit = blueprint.flops / units
    except Exception as err:  # a task that reads values (`.item()`) cannot run on meta tensors
        log.warning(
            "perf/mfu is not reported: the training step could not run on the meta device to count its FLOPs (%s)",
            str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
        )
    strategy = engine.strategy
    peak = strategy.peak_flops or peak_flops(strategy.device_name(), engine.mixed_precision)
    if peak is None:  # said by plan=true; here in the log file only (every CPU run would say it)
        log.info(
            "perf/mfu is not reported: %s",
            mfu_unknown(strategy.device_name()),
            extra=FILE_ONLY,
        )
    return Throughput(unit, flops_per_unit, peak, devices_per_batch=engine.num_processes // engine.state.data_parallel_size)


def across_processes(engine: Engine, local: dict[str, float]) -> dict[str, float]:
    """This process's window metrics over all processes, in one gather: memory peaks the largest, the
    others (the loss, the rates) averaged."""
    if not engine.use_distributed:
        return local
    every = engine.gather(torch.tensor([list(local.values())], device=engine.device)).tolist()
    return {
        name: max(column) if "memory" in name else sum(column) / len(column)
        for name, column in zip(local, zip(*every, strict=True), strict=True)
    }


@contextmanager
def closed_on_failure(engine: Engine) -> Iterator[None]:
    """When the loop stops, first finish a checkpoint being written in the background; close the
    trackers' run as KILLED when it stopped on a signal (the run resumes later) and as FAILED when it
    raised; a run that ends well is closed FINISHED by `end_training`."""
    try:
        yield
    except BaseException as err:
        try:  # a checkpoint being written in the background is finished first (the other ranks may be gone)
            engine.wait_for_checkpoint(everyone=False)
        except Exception as failed:
            log.error("%s", failed)
        engine.close_trackers(
            "KILLED" if isinstance(err, TrainingInterrupted | KeyboardInterrupt) else "FAILED"
        )
        raise


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# The running loops' lists of stop requests (`request_stop`).
_RUNNING: list[list[int]] = []


def request_stop(signum: int) -> None:
    """Stop the loop running in this process as the signal `signum` would: it checkpoints and stops at its
    next logging step. For a loop outside the main thread, where signals cannot be caught (a Ray worker
    runs it in a thread of its own): its launcher hears of the stop its own way and calls this."""
    for received in _RUNNING:
        received.append(signum)


@contextmanager
def stop_signals() -> Iterator[list[int]]:
    """Record SIGTERM, SIGINT (Ctrl-C), SIGUSR1 and SIGUSR2 instead of dying, so that the loop checkpoints
    and stops at its next logging step (in the main thread only: elsewhere signals cannot be caught, and
    `request_stop` does the same). A second Ctrl-C stops at once, without a checkpoint."""
    received: list[int] = []
    _RUNNING.append(received)
    try:
        with _caught(received):
            yield received
    finally:
        _RUNNING.remove(received)


@contextmanager
def _caught(received: list[int]) -> Iterator[None]:
    """The stop signals recorded in `received` inside, in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signum in received:
            raise KeyboardInterrupt
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def num_training_steps(trainer: TrainerConfig, train_loader: Any) -> int:
    """Optimizer steps to run: `max_steps`, else `max_epochs` epochs of (accumulated) batches of
    `train_loader` (this rank's share)."""
    if trainer.max_steps is not None:
        return trainer.max_steps
    return trainer.max_epochs * math.ceil(len(train_loader) / trainer.gradient_accumulation_steps)
