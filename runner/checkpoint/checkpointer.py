"""`Checkpointer`: what a checkpoint holds and how it is written and read back.

It keeps the registry of stateful objects (the prepared models, optimizers, schedulers and dataloaders,
the objects registered with `register_for_checkpointing`), writes them with every process's RNG state
and the precision's loss scaler into one directory (`save`: blocking, or staged into host memory and
written in the background), commits it atomically, marks it `latest` and keeps the last k (`files`), and
loads it back after checking that it fits (`resume`). Models and optimizers are written in the format the
strategy names (`runner.checkpoint.formats`), from the state only the strategy can give (full weights).
`Accelerator.save_state`/`load_state` and the training loop call it.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from runner.checkpoint.accelerate_layout import (
    accelerate_files,
    is_accelerate_checkpoint,
    link_accelerate_names,
    load_accelerate_checkpoint,
)
from runner.checkpoint.files import (
    PendingWrite,
    checkpoint_files,
    checkpoint_number,
    commit_staging,
    damage,
    file_digest,
    latest_checkpoint,
    load_torch,
    mark_latest,
    numbered_checkpoints,
    prune,
    read_meta,
    save_torch,
    staging_path,
    start_staging,
    write_meta,
)
from runner.checkpoint.formats import format_of
from runner.checkpoint.resume import (
    check_checkpoint_fits,
    check_optimizer_classes,
    damaged_error,
    keep_configured_lr,
    qualified_name,
)
from runner.config import TrainerConfig
from runner.errors import ConfigError
from runner.hardware import Strategy
from runner.ops import host_copy
from runner.precision import Precision
from runner.rng import rng_state, set_rng_state
from runner.run_dir import CANDIDATE, CHECKPOINTS, LAST_FINITE
from runner.state import ProcessState


class Steps(NamedTuple):
    """Where a checkpoint was written: the optimizer steps done (what `trainer.max_steps` counts; None in
    checkpoints that recorded only the micro-batches: runner's before it recorded both, Accelerate's), and
    the micro-batches of the accumulation (Accelerate's `step`)."""

    optimizer: int | None
    micro: int


log = logging.getLogger(__name__)

# What a checkpoint holds, by kind: models and optimizers in the strategy's format, each other object's
# `state_dict` in `<kind>_<i>.pt` (the registered objects' kind has Accelerate's name).
KINDS = ("model", "optimizer", "scheduler", "dataloader", "custom_checkpoint")


@dataclass
class ProjectConfiguration:
    """Where `Accelerator.save_state` puts checkpoints when it is given no directory (Accelerate's).

    Args:
        project_dir: the project's directory; checkpoints go to `<project_dir>/checkpoints/`.
        automatic_checkpoint_naming: name checkpoints `checkpoint_<iteration>` and count `iteration` up.
        total_limit: keep at most this many numbered checkpoints, deleting the oldest.
        iteration: the number the next automatic checkpoint gets.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0

    @property
    def checkpoints_dir(self) -> Path:
        if self.project_dir is None:
            raise ValueError("ProjectConfiguration.project_dir is not set: save_state() needs a directory.")
        return Path(self.project_dir) / CHECKPOINTS


@dataclass
class Schedule:
    """When a training loop's checkpoints are due (`Checkpointer.save_if_due`; `trainer.checkpoint_*`):
    every `every` optimizer steps (0: never by steps) and, asked at logging steps, once `every_s` seconds
    passed since the last (0: never by time); `background`: written in a background thread;
    `last_finite`: keep `checkpoints/last_finite`, the last state whose losses were finite."""

    every: int = 0
    every_s: float = 0.0
    background: bool = False
    last_finite: bool = False

    @classmethod
    def of(cls, trainer: TrainerConfig) -> Schedule:
        return cls(
            trainer.checkpoint_every,
            trainer.checkpoint_every_s,
            trainer.async_checkpoint,
            trainer.checkpoint_last_finite,
        )


class Checkpointer:
    """Saves and loads the state of everything registered, on every process of the job.

    Args:
        strategy: the hardware backend: its process group, its model and optimizer state.
        precision: the precision plugin, whose state (the fp16 loss scaler) is saved.
        state: where this process sits in the job.
        project: where checkpoints without a directory go, how they are numbered and how many are kept.
        split_batches: whether the dataloaders' batch size is the global one (recorded: a checkpoint
            reshards onto another data-parallel layout only then).
    """

    def __init__(
        self,
        strategy: Strategy,
        precision: Precision,
        state: ProcessState,
        project: ProjectConfiguration,
        split_batches: bool = False,
    ) -> None:
        self.strategy = strategy
        self.precision = precision
        self.state = state
        self.project = project
        self.split_batches = split_batches
        self.format = format_of(strategy)
        # The registry: "<kind>_<i>" -> the i-th object of that kind (`KINDS`), in the order objects were
        # prepared or registered (a checkpoint loads into the same objects in the same order); each has
        # `state_dict`/`load_state_dict`. Optimizers are prepared ones (`.optimizer`: the torch one).
        self.states: dict[str, Any] = {}
        # OrderedDicts: a hook's RemovableHandle holds a weak reference to them
        self._save_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._load_hooks: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self._pending: PendingWrite | None = None  # a background save's write
        self.schedule = Schedule()  # when a loop's `save_if_due` saves
        self._saved_at = time.monotonic()  # the latest numbered save's time, or the clock's restart
        # what the run records in every checkpoint's meta.json beside its own facts ("data": what it read)
        self.facts: dict[str, Any] = {}
        self._group: Any = None  # its process group

    def keep_trained_only(self) -> None:
        """From now on write the models' trained state only, not their frozen parameters (a PEFT model's
        base, which a run builds again from its config), and load it so: runner's loop. Accelerate's
        `save_state` writes whole models."""
        self.format = format_of(self.strategy, trained_only=True)

    # ------------------------------------------------------------------------------------- registry
    def add(self, kind: str, obj: Any) -> None:
        """Save and load `obj` as the next object of `kind` (one of `KINDS`)."""
        if kind not in KINDS:
            raise ValueError(f"Checkpointer.add: kind {kind!r} is not one of {', '.join(KINDS)}.")
        self.states[f"{kind}_{len(self.of_kind(kind))}"] = obj

    def of_kind(self, kind: str) -> list[Any]:
        """The objects of `kind` registered, in order."""
        return [obj for name, obj in self.states.items() if _kind(name) == kind]

    def register(self, *objects: Any) -> None:
        """Save and load these objects too (each needs `state_dict` and `load_state_dict`)."""
        invalid = [
            obj for obj in objects if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"))
        ]
        if invalid:
            raise ValueError(
                f"register_for_checkpointing() takes objects with state_dict() and load_state_dict(); "
                f"these have not: {', '.join(type(obj).__name__ for obj in invalid)}."
            )
        for obj in objects:
            self.add("custom_checkpoint", obj)

    def clear(self) -> None:
        """Forget every prepared object (`Accelerator.free_memory`); registered objects stay."""
        self.states = {name: obj for name, obj in self.states.items() if _kind(name) == "custom_checkpoint"}

    def add_save_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """`hook(models, weights, output_dir)` at the start of every save (see
        `Accelerator.register_save_state_pre_hook`)."""
        handle = RemovableHandle(self._save_hooks)
        self._save_hooks[handle.id] = hook
        return handle

    def add_load_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """`hook(models, input_dir)` at the start of every load (see
        `Accelerator.register_load_state_pre_hook`)."""
        handle = RemovableHandle(self._load_hooks)
        self._load_hooks[handle.id] = hook
        return handle

    def _part_file(self, name: str, obj: Any) -> str:
        """The file `obj`'s state is kept in: `<name>.pt`, or this process's own where it has one."""
        return f"{name}.rank{self.state.process_index}.pt" if _per_process(obj) else f"{name}.pt"

    def _parts(self) -> dict[str, Any]:
        """The registered objects other than models and optimizers (which the format writes), by name:
        each is written to `<name>.pt`."""
        return {name: obj for name, obj in self.states.items() if _kind(name) not in ("model", "optimizer")}

    def _counts(self, models: list[torch.nn.Module]) -> dict[str, int]:
        """How many objects of each kind a checkpoint holds (`meta.json`'s `counts`; `models`: those the
        save or load hooks left)."""
        return {
            "models": len(models),
            "optimizers": len(self.of_kind("optimizer")),
            **{kind: len(self.of_kind(kind)) for kind in KINDS[2:]},
        }

    # ----------------------------------------------------------------------------------------- save
    def save(
        self, target: Path | None = None, step: int = 0, blocking: bool = True, micro_step: int = 0
    ) -> Path:
        """Write a checkpoint of everything registered, at optimizer step `step` and micro-batch
        `micro_step` of the accumulation (0: at the end of an optimizer step), atomically; its directory.

        `target` None: the next numbered checkpoint, `<project_dir>/checkpoints/checkpoint_<iteration>`,
        marked latest once complete, at most `total_limit` kept. A directory: a named checkpoint there
        (best-k's, last_finite), which is not numbered, marked or pruned: not one `trainer.resume=auto`
        picks from. A crash during the save leaves the previous checkpoint untouched. `blocking=False`: the
        state is copied into host memory here and written by a background thread (`wait`)."""
        self.wait()
        if not blocking and not self.strategy.async_checkpoints:
            raise ValueError(
                f"save_state(blocking=False): {type(self.strategy).__name__} writes its checkpoints itself, "
                "synchronously. Save with blocking=True."
            )
        numbered = target is None
        final = self._numbered() if target is None else Path(target)
        if self.state.is_main_process:
            start_staging(final)
        self.strategy.barrier()
        staging = staging_path(final)
        commit = partial(self._commit, final, numbered, self.project.total_limit)
        discard = partial(self._discard, staging)
        try:
            write = self._writer(staging, Steps(step, micro_step), blocking)
            if blocking:
                write()
                commit()
        except BaseException:
            discard()
            raise
        if not blocking:
            self._pending = PendingWrite(final, write, commit, discard)
        if numbered:
            self.project.iteration += 1
            self._saved_at = time.monotonic()
        if blocking:
            self.strategy.barrier()
        return final

    def _commit(self, final: Path, numbered: bool, limit: int | None) -> None:
        """The main process renames the staged checkpoint into `final`; a numbered one becomes latest and
        the oldest beyond `limit` are pruned."""
        if not self.state.is_main_process:
            return
        commit_staging(final)
        if numbered:
            mark_latest(final)
            if limit is not None:
                prune(final.parent, limit)

    def _discard(self, staging: Path) -> None:
        """No half-written checkpoint is left behind (a full disk, a signal): the main process removes it."""
        if self.state.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)

    def _writer(self, staging: Path, steps: Steps, blocking: bool) -> Callable[[], None]:
        """What writes every process's part of a checkpoint into `staging`, then the main process's
        `meta.json` (once every part is there). Blocking, the weights are written here; else they and
        the other states are copied into host memory here (`CheckpointFormat.stage`), and the writer
        runs in a background thread, its collectives over a process group of its own."""
        main = self.state.is_main_process
        optimizers = [opt.optimizer for opt in self.of_kind("optimizer")]
        models = self._models_to_save(staging)
        if blocking:
            self.format.save(staging, models, optimizers, main)
            write_weights, copy, barrier = (lambda: None), (lambda state: state), self.strategy.barrier
        else:
            group = self._background_group()
            write_weights = self.format.stage(staging, models, optimizers, main, group)
            copy = host_copy
            barrier = (lambda: dist.barrier(group=group)) if group is not None else (lambda: None)
        rank = self.state.process_index
        files = {f"random_states_{rank}.pt": rng_state()}
        for name, obj in self._parts().items():
            if main or _per_process(obj):
                files[self._part_file(name, obj)] = copy(obj.state_dict())
        if main:
            files["precision.pt"] = copy(self.precision.state_dict())
        for_accelerate = self.format.accelerate_readable
        if for_accelerate:
            precision_state = files.get("precision.pt", {})
            files |= accelerate_files(rank, steps.micro, main, precision_state, self.of_kind("dataloader"))
        counts = self._counts(models)
        meta = {
            "num_processes": self.state.num_processes,
            "data_parallel_size": self.state.data_parallel_size,
            "split_batches": self.split_batches,
            "checkpoint_format": self.strategy.checkpoint_format,
            "step": steps.optimizer,
            "micro_step": steps.micro,
            "counts": counts,
            "optimizer_classes": [qualified_name(opt) for opt in optimizers],
            **({"facts": dict(self.facts)} if self.facts else {}),
        }

        def write() -> None:
            write_weights()
            for name, state in files.items():
                save_torch(state, staging / name)
            barrier()
            if main:
                # Accelerate's names are the same files (hard links): recorded as such, checked once.
                aliases = link_accelerate_names(staging, counts) if for_accelerate else {}
                digests = {
                    name: file_digest(staging / name)
                    for name in checkpoint_files(staging)
                    if name not in aliases
                }
                write_meta(staging, meta | {"files": digests, "accelerate_names": aliases})

        return write

    def _models_to_save(self, staging: Path) -> list[torch.nn.Module]:
        """The prepared models that `save` writes, after the save hooks took theirs."""
        if not self._save_hooks:
            return self.of_kind("model")
        prepared = self.of_kind("model")
        models = [self.strategy.unwrap_module(m) for m in prepared]
        weights = [self.strategy.full_state_dict(m) for m in prepared]
        kept_before = {id(w): i for i, w in enumerate(weights)}
        for hook in self._save_hooks.values():
            hook(models, weights, str(staging))
        return [prepared[kept_before[id(w)]] for w in weights if id(w) in kept_before]

    def _background_group(self) -> Any:
        """A gloo process group for the background writes (None in a single process): their collectives
        must not interleave with training's on the default group."""
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    @property
    def in_progress(self) -> bool:
        """Whether a background save is still being written."""
        return self._pending is not None and self._pending.running

    def wait(self, everyone: bool = True) -> None:
        """Wait until the background save is complete (and marked latest: with `everyone`, every process
        waits for the main process's commit); raise what failed in its writing."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
            if everyone:
                self.strategy.barrier()

    def _numbered(self) -> Path:
        """The next numbered checkpoint's directory."""
        final = self.project.checkpoints_dir / f"checkpoint_{self.project.iteration}"
        if final.exists():
            raise ValueError(
                f"{final} already exists: set accelerator.project_configuration.iteration to the next free number."
            )
        return final

    def number_after_existing(self) -> None:
        """Number the next automatic checkpoint after those the project's dir holds (a run started fresh
        in a dir that has checkpoints)."""
        existing = numbered_checkpoints(self.project.checkpoints_dir)
        self.project.iteration = (checkpoint_number(existing[-1]) or 0) + 1 if existing else 0

    def save_last_finite(self, step: int) -> None:
        """At a logging step whose losses were all finite: the state saved at the previous logging step
        gave those losses, so it becomes `checkpoints/last_finite`; the state now is saved as the next
        candidate (its weights may already be ruined by this step's update: only the next window's losses
        can tell). Neither is one of the numbered checkpoints that `trainer.resume=auto` picks from."""
        checkpoints = self.project.checkpoints_dir
        if self.state.is_main_process and (checkpoints / CANDIDATE).is_dir():
            shutil.rmtree(checkpoints / LAST_FINITE, ignore_errors=True)
            (checkpoints / CANDIDATE).rename(checkpoints / LAST_FINITE)
        self.save(checkpoints / CANDIDATE, step=step)

    def restart_clock(self) -> None:
        """`schedule.every_s` counts from now (a loop's start)."""
        self._saved_at = time.monotonic()

    def save_if_due(
        self,
        step: int,
        micro_step: int = 0,
        logging: bool = False,
        stop: bool = False,
        before_save: Callable[[], None] = lambda: None,
    ) -> Path | None:
        """After optimizer step `step`, what `schedule` asks: at a logging step (`logging`: its losses were
        read and found finite) the last-finite candidate, then the numbered checkpoint where it is due by
        steps, or by time (asked at logging steps only, in one collective, so that every rank saves at the
        same step), or a `stop` (blocking: the run ends next), `before_save` called first. The numbered
        checkpoint's path, else None."""
        schedule = self.schedule
        if logging and schedule.last_finite:
            self.save_last_finite(step)
        due = stop or (schedule.every > 0 and step % schedule.every == 0)
        if not due and logging and schedule.every_s:
            passed = float(time.monotonic() - self._saved_at >= schedule.every_s)
            due = bool(self.strategy.all_reduce(torch.tensor(passed, device=self.state.device), "max").item())
        if not due:
            return None
        before_save()
        return self.save(step=step, micro_step=micro_step, blocking=stop or not schedule.background)

    # ----------------------------------------------------------------------------------------- load
    def load(self, input_dir: str | None = None) -> Steps:
        """Restore a checkpoint that `save` wrote (without `input_dir`: the project's latest) into the
        objects registered, in the same order; return the steps it was written at. A sharded (DCP)
        checkpoint loads onto another number of ranks or another layout: DCP reshards it."""
        directory = Path(input_dir) if input_dir is not None else self._latest()
        if is_accelerate_checkpoint(directory):
            return self._load_accelerate(directory)
        meta = check_checkpoint_fits(
            directory,
            self.state.num_processes,
            self.strategy.checkpoint_format,
            key="load_state input_dir",
            reshards=self.strategy.reshards_checkpoints,
            readers=self.state.data_parallel_size if self.of_kind("dataloader") else None,
            split_batches=self.split_batches,
        )
        # Sizes here; `python -m runner` also checks the contents (CRC-32) before any rank starts.
        if problems := damage(directory, meta, contents=False):
            raise damaged_error(directory, problems, key="load_state input_dir")
        models = self._models_to_load(directory)
        optimizers = [opt.optimizer for opt in self.of_kind("optimizer")]
        check_optimizer_classes(directory, meta, [qualified_name(opt) for opt in optimizers])
        if meta["counts"] != (counts := self._counts(models)):
            raise ConfigError(
                f"{directory} holds {meta['counts']}, but this Accelerator has {counts} prepared/registered: "
                "prepare and register the same objects, in the same order, as the run that saved it."
            )
        self.format.load(directory, models, optimizers)
        for name, obj in self._parts().items():
            obj.load_state_dict(load_torch(directory / self._part_file(name, obj)))
        self.precision.load_state_dict(load_torch(directory / "precision.pt"))
        # On another number of ranks (a resharded checkpoint) a new rank takes the states of rank i % N.
        set_rng_state(
            load_torch(directory / f"random_states_{self.state.process_index % meta['num_processes']}.pt")
        )
        if self.project.automatic_checkpoint_naming and (number := checkpoint_number(directory)) is not None:
            # Past a newer one the dir may hold (written by a run killed before it was marked latest).
            self.project.iteration = max(self.project.iteration, number + 1)
        if "micro_step" not in meta:  # written before both were recorded: its `step` counted micro-batches
            return Steps(None, meta["step"])
        return Steps(meta["step"], meta["micro_step"])

    def _load_accelerate(self, directory: Path) -> Steps:
        """Restore what Accelerate's `save_state` wrote (`accelerate_layout.load_accelerate_checkpoint`);
        the micro-batch step it recorded."""
        if not self.format.accelerate_readable:
            raise ConfigError(
                f"load_state input_dir={directory}: a checkpoint of Accelerate's save_state holds whole models, which "
                f"runner loads where every process holds the whole model (one process, DDP), not into "
                f"{type(self.strategy).__name__}'s shards. Load it with one of those and save_state again, or pass "
                "the weights to load_checkpoint_in_model."
            )
        modules = [self.strategy.unwrap_module(m) for m in self._models_to_load(directory)]
        micro = load_accelerate_checkpoint(
            directory,
            modules,
            self.of_kind,
            self.precision,
            self.state.process_index,
            self.state.num_processes,
        )
        return Steps(None, micro)

    def resume(self, checkpoint: Path) -> Steps:
        """`load` for `trainer.resume`: a checkpoint that does not fit this run is a ConfigError, and the
        learning rates stay the configured ones (`keep_configured_lr`); the steps it was written at."""
        schedulers = self.of_kind("scheduler")
        configured = [list(s.scheduler.base_lrs) for s in schedulers]
        try:
            steps = self.load(str(checkpoint))
        except (RuntimeError, KeyError, ValueError) as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(
                f"trainer.resume: {checkpoint} does not fit this run ({str(err).splitlines()[0][:300]}). Resume "
                "with the model, optimizer and data settings it was written with, or start fresh with "
                "trainer.resume=null."
            ) from err
        for scheduler, lrs in zip(schedulers, configured, strict=True):
            keep_configured_lr(scheduler.scheduler, lrs)
        return steps

    def _models_to_load(self, directory: Path) -> list[torch.nn.Module]:
        """The prepared models that `load` fills, after the load hooks took theirs."""
        if not self._load_hooks:
            return self.of_kind("model")
        prepared = self.of_kind("model")
        unwrapped = [self.strategy.unwrap_module(m) for m in prepared]
        models = list(unwrapped)
        for hook in self._load_hooks.values():
            hook(models, str(directory))
        left = {id(m) for m in models}
        return [model for model, m in zip(prepared, unwrapped, strict=True) if id(m) in left]

    def latest_at(self, step: int) -> Path | None:
        """The project's latest checkpoint when it holds the state at optimizer step `step`, else None."""
        latest = latest_checkpoint(self.project.checkpoints_dir) if self.project.project_dir else None
        if latest is None:
            return None
        meta = read_meta(latest)
        return latest if "micro_step" in meta and meta["step"] == step else None

    def newest_at_or_before(self, step: int) -> Path | None:
        """The project's newest whole numbered checkpoint written at optimizer step `step` or before, else
        None (one numbered past `latest` was never completed)."""
        checkpoints = self.project.checkpoints_dir
        latest = latest_checkpoint(checkpoints)
        whole = checkpoint_number(latest) if latest is not None else None
        if whole is None:
            return None
        for path in reversed(numbered_checkpoints(checkpoints)):
            meta = read_meta(path)
            if (checkpoint_number(path) or 0) <= whole and "micro_step" in meta and meta["step"] <= step:
                return path
        return None

    def roll_back_to(self, checkpoint: Path) -> Steps:
        """`resume` from `checkpoint` in a run that goes on, its data where it is (the dataloaders'
        positions put back after the load: the batches since are left out); `checkpoint` made the latest
        again and the numbered ones written after it deleted (the states they hold were left behind:
        `trainer.resume=auto` must not pick one). The steps it was written at."""
        self.wait()  # one being written in the background is whole
        loaders = self.of_kind("dataloader")
        positions = [loader.state_dict() for loader in loaders]
        steps = self.resume(checkpoint)
        for loader, position in zip(loaders, positions, strict=True):
            loader.load_state_dict(position)
        if self.state.is_main_process:
            for path in numbered_checkpoints(self.project.checkpoints_dir):
                if path != checkpoint and read_meta(path).get("step", -1) > steps.optimizer:
                    shutil.rmtree(path, ignore_errors=True)
            mark_latest(checkpoint)
        return steps

    def _latest(self) -> Path:
        latest = latest_checkpoint(self.project.checkpoints_dir) if self.project.project_dir else None
        if latest is None:
            raise ValueError(
                "load_state() needs a directory: the project has no checkpoint marked latest yet."
            )
        return latest


def _kind(name: str) -> str:
    """The kind of the registry's object named `name` ("<kind>_<i>")."""
    return name.rpartition("_")[0]


def _per_process(obj: Any) -> bool:
    """Whether each process keeps a state of its own for `obj` (a streamed dataset's position)."""
    return bool(getattr(obj, "per_process", False))
