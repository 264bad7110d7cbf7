"""Building what the config describes: locating `_target_`s, the model with the sizes its data gives it
(on a device, on the meta device, or empty), the run's blueprint, its starting weights, and which kind of
task runs."""

from __future__ import annotations

import copy
import fnmatch
import importlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import IterableDataset

from runner.checkpoint.weights import load_weights
from runner.data.base import DataSource
from runner.engine.data_loader import loader_like
from runner.errors import ConfigError
from runner.ops import apply_to_tensors, send_to_device
from runner.perf import count_flops
from runner.task import InferenceTask

log = logging.getLogger(__name__)


def build_data(cfg: DictConfig) -> DataSource:
    """The configured data source, set up (its datasets read, its `dims` known)."""
    data = instantiate(cfg.data)
    data.setup()
    return data


def fast_dev_run(cfg: DictConfig) -> None:
    """`trainer.fast_dev_run=N` (N > 0) sets `cfg` for a quick check that everything runs: N training
    steps, each logged, then an eval of at most N batches; nothing resumed and nothing kept (no
    checkpoints, tracker, callbacks, plots or saved model; `Trainer.finish` records no results). A
    checkpoint named to resume from (not the default `auto`) is refused: it would be dropped."""
    trainer = cfg.trainer
    if not trainer.fast_dev_run:
        return
    steps = trainer.fast_dev_run
    if trainer.resume not in (None, "auto"):
        raise ConfigError(
            f"trainer.fast_dev_run={steps} with trainer.resume={trainer.resume}: a check run starts fresh and keeps "
            "nothing, so it would resume nothing. Leave trainer.resume out; to check a resume itself, run it in a "
            "new dir for a few steps past the checkpoint (trainer.resume=<checkpoint> hydra.run.dir=<new dir> "
            "trainer.max_steps=<its step + 2>)."
        )
    trainer.max_steps, trainer.max_epochs, trainer.log_every, trainer.eval_every = steps, None, 1, 0
    trainer.limit_eval_batches = min(steps, trainer.limit_eval_batches or steps)
    trainer.checkpoint_every, trainer.checkpoint_every_s = 0, 0.0
    trainer.checkpoint_last_finite, trainer.async_checkpoint = False, False
    trainer.resume, trainer.save_model, trainer.plots = None, False, False
    cfg.tracker._target_ = None
    cfg.callbacks = {}


def records_goodput(cfg: DictConfig) -> bool:
    """Whether the run keeps a goodput ledger (`runner.telemetry.goodput`): a training run that records its results
    (not an inference task, `mode=evaluate` or `trainer.fast_dev_run`)."""
    return not (is_inference(cfg.task._target_) or cfg.get("mode") == "evaluate" or cfg.trainer.fast_dev_run)


# Settings of the `optimizer` node that runner reads itself (the rest are its `_target_`'s arguments).
OPTIMIZER_SETTINGS = ("no_decay",)


def build_optimizer(cfg: DictConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The configured optimizer over `model`'s parameters, its settings as plain Python: a YAML list is a
    list, not omegaconf's ListConfig, which some optimizers keep in their param groups (RAdam's `betas`),
    where the weights-only load of a resume refuses it. `optimizer.no_decay` (glob patterns of parameter
    names, `*.bias`): those parameters in a second group with weight_decay 0, as GPT recipes keep biases,
    norms and embeddings; a pattern that matches no parameter is a ConfigError naming them. Frozen
    parameters (a PEFT model's base) are not the optimizer's."""
    settings = OmegaConf.to_container(cfg.optimizer, resolve=True)
    patterns = settings.pop("no_decay", None) or []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    optimizer = instantiate(settings, _convert_="all")
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not patterns:
        return optimizer(list(named.values()))
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in named)]
    if unmatched:
        shown = ", ".join(list(named)[:24]) + (f", ... ({len(named)} in all)" if len(named) > 24 else "")
        raise ConfigError(
            f"optimizer.no_decay: {', '.join(map(repr, unmatched))} match(es) no parameter of "
            f"{type(model).__name__}, whose parameters are: {shown}. Give glob patterns of these names "
            "(`*.bias`, `*ln_*`), or optimizer.no_decay=[]."
        )
    kept = {name for name in named if any(fnmatch.fnmatchcase(name, p) for p in patterns)}
    return optimizer(
        [
            {"params": [p for name, p in named.items() if name not in kept]},
            {"params": [p for name, p in named.items() if name in kept], "weight_decay": 0.0},
        ]
    )


def build_scheduler(
    cfg: DictConfig, optimizer: torch.optim.Optimizer, num_training_steps: int, steps_per_update: int = 1
) -> Any:
    """The configured LR schedule of `optimizer` over `num_training_steps` scheduler steps, its settings as
    plain Python (as `build_optimizer`'s); `steps_per_update` (scheduler steps per optimizer step) to a
    schedule that takes it (`runner.schedulers`)."""
    schedule = instantiate(cfg.scheduler, _convert_="all")
    takes = "steps_per_update" in inspect.signature(schedule).parameters
    extra = {"steps_per_update": steps_per_update} if takes else {}
    return schedule(optimizer, num_training_steps=num_training_steps, **extra)


def build_model(cfg: DictConfig, data: DataSource) -> torch.nn.Module:
    """The configured model, with the sizes the (set up) data determines (see `model_dims`); built on the
    current default device (`with torch.device("meta")`, `init_empty_weights()` ...)."""
    return instantiate(cfg.model, **model_dims(cfg.model, data.dims, data.withheld))


def build_on_meta(cfg: DictConfig, data: DataSource | None = None) -> torch.nn.Module:
    """The configured model on the meta device: counted, not allocated."""
    data = data or build_data(cfg)
    with torch.device("meta"):
        return build_model(cfg, data)


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes and dtypes (tied
    ones stay tied): its modules copied, not constructed again, and no memory allocated for its values;
    what it caches while it runs stays in the copy."""
    copies: dict[int, Any] = {
        id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in model.parameters()
    }
    copies |= {id(b): torch.empty_like(b, device="meta") for b in model.buffers()}
    return copy.deepcopy(model, copies)


def first_batch(data: DataSource, per_device: int = 1) -> Any:
    """The first training batch of `data` (seed 0), loaded in this process (no loader workers started for
    one batch); `per_device` > 1 cuts it to one process's share (`trainer.split_batches`)."""
    loader = data.train_dataloader(seed=0)
    if loader.num_workers:
        if isinstance(loader.dataset, IterableDataset):
            batching = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
        elif loader.batch_sampler is not None:
            batching = {"batch_sampler": loader.batch_sampler}
        else:  # unbatched
            batching = {"batch_size": None, "sampler": loader.sampler}
        loader = loader_like(loader, num_workers=0, **batching)
    batch = next(iter(loader))
    if per_device > 1:
        batch = apply_to_tensors(lambda t: t[: len(t) // per_device], batch)
    return batch


@dataclass
class Blueprint:
    """What a run is made of, built once per process and read by every check, `plan=true`, the FLOP count
    behind `perf/mfu` and a rank that runs in the launching process: the configured data (set up), the
    model on the meta device, and one device's first batch (`per_device` > 1: its share of a global batch,
    `trainer.split_batches`), on meta too: the real shapes, no values and no memory. `rng`: the RNG states
    as reading the data left them, after the run's seed (`runner.rng.seeded`), for a rank that trains on
    this data to go on from as if it had read it itself (None: not seeded so)."""

    cfg: DictConfig
    data: DataSource
    model: torch.nn.Module
    per_device: int = 1
    rng: dict[str, Any] | None = None

    @cached_property
    def batch(self) -> Any:
        return send_to_device(first_batch(self.data, self.per_device), torch.device("meta"))

    def training_step(self) -> torch.Tensor:
        """The configured task's training step (forward and loss) on the first batch: the (meta) loss. A task
        that reads values (`.item()`) cannot run so: that raises NotImplementedError or RuntimeError naming
        the meta device. No backward here: the autograd engine sizes its device queues on its first
        backward, and one before an XLA device exists breaks the backward of a rank that runs in this
        process (`flops` runs one: never before launch)."""
        with value_free_attention(self.model):
            return instantiate(self.cfg.task).training_step(self.model.train(), self.batch)

    @cached_property
    def flops(self) -> int:
        """The training step's FLOPs, forward and backward (torch's counter; activation recomputation not
        counted); what the step raises on meta is raised."""
        with torch.random.fork_rng(devices=[]):  # whatever the user's forward draws
            return count_flops(self.training_step)

    def eval_metrics(self) -> list[str]:
        """The final eval metrics the configured task reports (`eval/<name>`): its evaluation step on the
        first batch (the names, no values), then its summary of those names."""
        task = instantiate(self.cfg.task)
        with value_free_attention(self.model), torch.no_grad():
            names = task.evaluation_step(self.model.eval(), self.batch)
        self.model.train()
        return [f"eval/{name}" for name in task.summarize(dict.fromkeys(names, 1.0))]


@contextmanager
def value_free_attention(model: torch.nn.Module) -> Iterator[None]:
    """A transformers model's attention in its eager implementation while inside: the SDPA path asks
    whether the padding mask is all ones (`.item()`), which a meta tensor cannot answer; the eager one
    computes the same shapes without asking."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if previous in (None, "eager"):
        yield
        return
    config._attn_implementation = "eager"  # type: ignore[union-attr]
    try:
        yield
    finally:
        config._attn_implementation = previous  # type: ignore[union-attr]


def load_start_weights(model: torch.nn.Module, checkpoint: str) -> None:
    """`checkpoint=`'s weights into `model`, or a ConfigError naming what does not match."""
    try:
        load_weights(model, checkpoint, frozen_optional=True)  # a PEFT run's checkpoint: its adapter
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"checkpoint={checkpoint}: {err}") from None
    log.info("weights from %s", checkpoint)


def is_inference(task_target: str) -> bool:
    """Whether the task class at `task_target` is an inference task (else a training one, or a target that
    cannot be imported: the check of the task node says so)."""
    try:
        task = locate(task_target)
    except ImportError:
        return False
    return isinstance(task, type) and issubclass(task, InferenceTask)


def model_dims(
    model_cfg: DictConfig, dims: dict[str, int], withheld: Mapping[str, str] | None = None
) -> dict[str, int]:
    """The model arguments the data determines: fill those left null or not given (where the model takes
    them), refuse those that contradict it, and those left null that the data does not provide (saying
    why, where its settings withhold one: `DataSource.withheld`)."""
    parameters = inspect.signature(locate(model_cfg._target_)).parameters
    filled = {}
    for key, value in dims.items():
        if key not in model_cfg:
            if key in parameters:
                filled[key] = value
            continue
        if model_cfg[key] is None:
            filled[key] = value
        elif model_cfg[key] != value:
            raise ConfigError(
                f"model.{key}={model_cfg[key]} does not match the data, which has {key}={value}. "
                f"Set model.{key}=null to take it from the data, or change the data."
            )
    unset = [
        p.name
        for p in parameters.values()
        if p.default is p.empty and model_cfg.get(p.name, 0) is None and p.name not in filled
    ]
    reasons = withheld or {}
    if unset and unset[0] in reasons:
        raise ConfigError(f"model.{unset[0]} is null and the data does not provide it: {reasons[unset[0]]}.")
    if unset:
        raise ConfigError(
            f"model.{unset[0]} is null and the data does not provide it (it provides {sorted(dims) or 'nothing'}). "
            f"Set model.{unset[0]} explicitly, or choose data that matches this model."
        )
    return filled


def locate(path: str | None) -> Any:
    """The object at a dotted `path` (module attributes included), or ImportError saying what failed."""
    if not path:
        raise ImportError("no _target_ given")
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and not module_name.startswith(err.name):
                raise ImportError(f"importing {module_name!r} failed: {err}") from err
            continue
        except Exception as err:  # the module itself raised: a syntax error, a failing import-time statement
            raise ImportError(f"importing {module_name!r} raised {type(err).__name__}: {err}") from err
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                raise ImportError(f"{'.'.join(parts[:split])!r} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module named {parts[0]!r}")
