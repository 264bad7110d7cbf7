"""`hardware=deepspeed`: ZeRO stages 1-3 through a DeepSpeed engine that owns backward and the optimizer
step."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from runner.cluster import export_local_rank
from runner.config import PositiveFloat, PositiveInt, PythonOnly, Range, checked
from runner.errors import ConfigError, install_command
from runner.hardware.base import DummyOptim, DummyScheduler
from runner.hardware.process_group import ParallelStrategy
from runner.precision import Float16MixedPrecision, MixedPrecision, Precision, refuse_fp8
from runner.state import DistributedType, ProcessState

# DS_BUILD_OPS=0: DeepSpeed compiles its ops when one is first used, not while installing
INSTALL = f"DS_BUILD_OPS=0 {install_command('deepspeed', '--no-build-isolation')}"
CHECKPOINT_DIR, CHECKPOINT_TAG = "deepspeed", "state"  # inside a save_state directory


class DeepSpeed(ParallelStrategy):
    """Data parallel with ZeRO: optimizer states (stage 1), gradients (2) and parameters (3) partitioned
    over the ranks by one DeepSpeed engine built from the model and its optimizer.

    The DeepSpeed config is generated from the run: micro batch (the prepared dataloader's per-process
    batch), gradient accumulation (the Accelerator's), precision (the precision group) and gradient
    clipping (`gradient_clipping`, which the runner's YAML takes from `trainer.max_grad_norm`; None: none,
    where DeepSpeed alone would clip to 1.0). A user's own DeepSpeed JSON (`config`) may set anything
    else; a value of it that contradicts the run must be "auto" or agree, or the run is refused.

    `Accelerator.backward` runs the engine's backward and, at the end of an accumulation, its step (clip,
    optimizer step, zero grad): the prepared optimizer's `step()`/`zero_grad()` then do nothing, as in
    Accelerate. Checkpoints are DeepSpeed's (every rank writes its partitions); `save_model` writes the
    consolidated fp32 weights.

    Args (beyond `ParallelStrategy`'s):
        zero_stage: 1, 2 or 3; None: the stage of `config`, else 2.
        offload_optimizer: keep optimizer states (and their fp32 weights) in CPU memory.
        offload_params: keep parameters in CPU memory (stage 3 only).
        gradient_clipping: max total gradient norm; None: no clipping.
        micro_batch_size: per-process batch; None: the first prepared dataloader's (only DeepSpeed's
            throughput accounting reads it: the loop, not DeepSpeed, feeds the batches).
        config: a DeepSpeed JSON file, or its contents as a mapping.
        declared_optimizer: the config's `optimizer` and `scheduler` blocks are used, for Accelerate's
            `DummyOptim` and `DummyScheduler` (a `DeepSpeedPlugin`'s config); False: refused, the optimizer
            and schedule being the run's own.
    """

    distributed_type = DistributedType.DEEPSPEED

    checkpoint_format = "deepspeed"

    @property
    def sharded_states(self) -> frozenset[str]:  # type: ignore[override]
        return _sharded_at(self.zero_stage)

    @classmethod
    def states_sharded_by(cls, settings: Mapping[str, Any]) -> frozenset[str]:
        return _sharded_at(settings.get("zero_stage") or 2)  # unset: DeepSpeed's stage 2

    @checked("hardware")
    def __init__(
        self,
        zero_stage: Annotated[int, Range(ge=1, le=3)] | None = None,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        gradient_clipping: PositiveFloat | None = None,
        micro_batch_size: PositiveInt | None = None,
        config: str | dict[str, Any] | None = None,
        declared_optimizer: PythonOnly[bool] = False,
        **process_group: Any,
    ) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"hardware=deepspeed needs DeepSpeed, which is not installed: run `{INSTALL}`.")
        super().__init__(**process_group)
        self.user_config = _read_user_config(config)
        for block, group in (("optimizer", "optimizer"), ("scheduler", "scheduler")):
            if block in self.user_config and not declared_optimizer:
                raise ConfigError(
                    f"hardware.config has a {block!r} block: the {block} comes from the `{group}` config group "
                    f"(a torch {block} the engine steps). Remove the block from the DeepSpeed JSON."
                )
        if zero_stage is None:
            zero_stage = self.user_config.get("zero_optimization", {}).get("stage", 2)
        if zero_stage not in (1, 2, 3):
            raise ConfigError(
                f"hardware.zero_stage={zero_stage}: expected 1 (optimizer states partitioned), 2 (and "
                "gradients) or 3 (and parameters)."
            )
        if offload_params and zero_stage != 3:
            raise ConfigError(
                f"hardware.offload_params=true needs hardware.zero_stage=3 (parameters are partitioned "
                f"only there); this run has zero_stage={zero_stage}."
            )
        self.zero_stage = zero_stage
        self.offload_optimizer = offload_optimizer
        self.offload_params = offload_params
        self.gradient_clipping = gradient_clipping
        self.micro_batch_size = micro_batch_size
        self.precision_config: dict[str, Any] = {}
        self.config: dict[str, Any] = {}  # what the engine was built with
        self.engine: Any = None
        _check_agreement(
            self.user_config,
            self._settings_from_yaml(),
            "hardware.config",
            "hardware.zero_stage/offload_*/gradient_clipping (gradient_clipping is trainer.max_grad_norm)",
        )

    def _settings_from_yaml(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.zero_stage}
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
        if self.offload_params:
            zero["offload_param"] = {"device": "cpu"}
        return {"zero_optimization": zero, "gradient_clipping": self.gradient_clipping or 0.0}

    def setup_precision(self, precision: Precision) -> Precision:
        """DeepSpeed keeps fp32 master weights and casts the model itself (`bf16`/`fp16` blocks); the
        forward still runs under autocast, so fp32 inputs meet low-precision weights safely."""
        refuse_fp8(precision, "deepspeed", "DeepSpeed's engine casts the model to its own dtype")
        if not isinstance(precision, MixedPrecision):
            self.precision_config = {}
        elif precision.mixed_precision == "bf16":
            self.precision_config = {"bf16": {"enabled": True}}
        elif self.device_type == "cpu":
            raise ConfigError(
                "precision=fp16 with hardware=deepspeed on the CPU: DeepSpeed cannot train in fp16 there. "
                "Use precision=bf16 or precision=fp32, or run on GPUs."
            )
        else:
            self.precision_config = {"fp16": _loss_scaling(precision)}
            precision = MixedPrecision("float16")  # autocast only: the engine scales the loss
        _check_agreement(
            self.user_config,
            {
                "bf16": {"enabled": "bf16" in self.precision_config},
                "fp16": {"enabled": "fp16" in self.precision_config},
            },
            "hardware.config",
            "the precision group",
        )
        return precision

    def setup_environment(self) -> ProcessState:
        os.environ.setdefault("DS_ACCELERATOR", self.device_type)
        state = super().setup_environment()
        import deepspeed
        import deepspeed.ops

        # On the CPU, DeepSpeed would JIT-compile a shared-memory all-reduce (a minute, or a crash
        # without a compiler); the process group's own collectives are what we want.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        warnings.filterwarnings(
            "ignore", message=r".*`torch\.distributed\.\w+` is deprecated", category=FutureWarning
        )
        deepspeed.init_distributed(dist_backend=self.backend, timeout=self.timeout)
        export_local_rank(state.local_process_index)  # its engine asserts LOCAL_RANK, even in a group of one
        return state

    def check_batches(self, batch_size: int, gradient_accumulation_steps: int, world_size: int) -> None:
        """The user's JSON against the run's micro batch (`micro_batch_size`, else `batch_size`),
        accumulation and global batch."""
        micro = self.micro_batch_size or batch_size
        _check_agreement(
            self.user_config,
            {
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": gradient_accumulation_steps,
            },
            "hardware.config",
            "data.batch_size per process and trainer.gradient_accumulation_steps",
        )
        _check_agreement(
            self.user_config,
            {"train_batch_size": micro * gradient_accumulation_steps * world_size},
            "hardware.config",
            f"data.batch_size x trainer.gradient_accumulation_steps x {world_size} ranks",
        )

    def deepspeed_config(
        self, micro_batch_size: int | None, gradient_accumulation_steps: int, world_size: int
    ) -> dict[str, Any]:
        """The config the engine is built with on `world_size` ranks: the user's JSON with the run's settings
        filled in (after `setup_precision`)."""
        micro = self.micro_batch_size or micro_batch_size or 1
        self.check_batches(micro, gradient_accumulation_steps, world_size)
        run = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            **self.precision_config,
            **self._settings_from_yaml(),
        }
        _check_agreement(self.user_config, run, "hardware.config", "the run's settings")
        config = _fill(copy.deepcopy(self.user_config), run)
        config.pop("train_batch_size", None)  # DeepSpeed derives it: micro batch x accumulation x ranks
        config.setdefault("steps_per_print", 2**62)  # the runner logs progress itself
        config.setdefault("zero_allow_untested_optimizer", True)  # any torch optimizer the user configured
        if config["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none":
            config.setdefault("zero_force_ds_cpu_optimizer", False)  # offload the user's optimizer, as it is
        return config

    def setup_module_and_optimizers(
        self,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        micro_batch_size: int | None,
        gradient_accumulation_steps: int,
    ) -> torch.nn.Module:
        import deepspeed

        if self.engine is not None:
            raise ValueError("hardware=deepspeed trains one model per Accelerator: prepare a single model.")
        if len(optimizers) > 1:
            raise ValueError("hardware=deepspeed steps one optimizer per model: prepare a single optimizer.")
        optimizer = optimizers[0] if optimizers else None
        self.config = self.deepspeed_config(
            micro_batch_size, gradient_accumulation_steps, dist.get_world_size()
        )
        kwargs: dict[str, Any] = {"optimizer": optimizer}
        if isinstance(optimizer, DummyOptim):
            kwargs = declared_optimizer(self.config, optimizer, dist.get_world_size())
        elif optimizer is not None and "optimizer" in self.config:
            raise ValueError(
                "The DeepSpeed config declares an optimizer (its optimizer block) and the script prepares one too. "
                "Prepare runner.utils.DummyOptim(model.parameters(), lr=...) for the config's, or remove the block."
            )
        self.apply_compute(module)
        self.engine, *_ = deepspeed.initialize(
            model=module, config=self.config, dist_init_required=False, **kwargs
        )
        return self.engine

    def prepared_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        """For a `DummyOptim`: the optimizer the engine built from the config."""
        return self.engine.optimizer if isinstance(optimizer, DummyOptim) else optimizer

    def prepared_scheduler(self, scheduler: Any) -> Any:
        """For a `DummyScheduler`: the schedule the engine built, which the engine steps (its `step()`
        here does nothing, as Accelerate's DeepSpeedSchedulerWrapper)."""
        if not isinstance(scheduler, DummyScheduler):
            return scheduler
        if self.engine is None or self.engine.lr_scheduler is None:
            raise ValueError(
                "DummyScheduler: no engine schedule to prepare. Prepare it in the same call as the model and its "
                "DummyOptim, with a scheduler block in the DeepSpeed config or lr_scheduler_callable."
            )
        return SteppedByEngine(self.engine.lr_scheduler)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        raise ValueError(
            "hardware=deepspeed builds one engine of the model and its optimizer: prepare them in the same "
            "call, `model, optimizer = accelerator.prepare(model, optimizer)`."
        )

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.module if module is self.engine else module

    def backward(
        self,
        loss: torch.Tensor,
        precision: Precision,
        sync_gradients: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.engine.set_gradient_accumulation_boundary(sync_gradients)
        self.engine.backward(loss, scale_wrt_gas=False, **(options or {}))  # the Accelerator divided the loss
        if sync_gradients:
            self.engine.step()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, precision: Precision, closure: Any = None
    ) -> bool:
        """The engine stepped in `backward`: report whether it applied the update (not an fp16 overflow)."""
        if closure is not None:
            raise ValueError("hardware=deepspeed cannot step an optimizer with a closure.")
        return self.engine.was_step_applied()

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """The engine zeroes the gradients after its step."""

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """The engine clipped inside its step at `gradient_clipping`; return the norm it measured."""
        if norm_type != 2.0 or max_norm != self.gradient_clipping:
            raise ConfigError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) with hardware=deepspeed: the "
                f"engine clips the 2-norm at hardware.gradient_clipping={self.gradient_clipping}. Set "
                "hardware.gradient_clipping to the same value (the runner's YAML takes trainer.max_grad_norm)."
            )
        norm = self.engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        raise ConfigError(
            "clip_grad_value_ with hardware=deepspeed: the engine clips by norm only, inside its step. "
            "Use clip_grad_norm_ with hardware.gradient_clipping."
        )

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The fp32 weights assembled from every rank's partition (a collective): DeepSpeed's fp32 master
        copy of each trained parameter, the module's own value of the others, buffers as they are."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        full: dict[int, torch.Tensor] = {}  # by parameter: tied weights stay one tensor
        state: dict[str, torch.Tensor] = {}
        for name, tensor in self.unwrap_module(module).state_dict(keep_vars=True).items():
            if id(tensor) not in full:
                value = safe_get_full_fp32_param(tensor) if _has_fp32_master(tensor) else None
                if value is None:
                    with deepspeed.zero.GatheredParameters([tensor], enabled=hasattr(tensor, "ds_id")):
                        value = tensor.detach().clone()
                full[id(tensor)] = value.float().cpu() if value.is_floating_point() else value.cpu()
            state[name] = full[id(tensor)]
        return state

    @staticmethod
    def checkpoint_weights(directory: Path) -> dict[str, torch.Tensor]:
        """The fp32 weights of the model in a checkpoint `save_checkpoint` wrote, assembled in this process
        from every rank's partitions (DeepSpeed's `zero_to_fp32`; no process group, no engine)."""
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(directory / CHECKPOINT_DIR), tag=CHECKPOINT_TAG)

    async_checkpoints = False  # DeepSpeed's engine writes its own checkpoints, synchronously
    skips_steps = False  # its engine takes every step itself (fp16: its loss scaler skips overflows)

    def save_checkpoint(self, directory: Path, trained_only: bool = False) -> None:
        """Every rank writes its partitions through the engine (`deepspeed/state/`): the "deepspeed" format
        (`runner.checkpoint.formats.EngineOwned`); `trained_only`: without the frozen parameters."""
        self.engine.save_checkpoint(
            str(directory / CHECKPOINT_DIR),
            tag=CHECKPOINT_TAG,
            save_latest=False,
            exclude_frozen_parameters=trained_only,
        )

    def load_checkpoint(self, directory: Path, trained_only: bool = False) -> None:
        """Load what `save_checkpoint` wrote (`trained_only`: the frozen parameters keep their values)."""
        try:
            loaded, _ = self.engine.load_checkpoint(
                str(directory / CHECKPOINT_DIR),
                tag=CHECKPOINT_TAG,
                load_module_strict=not trained_only,
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        except (AssertionError, FileNotFoundError):  # DeepSpeed asserts that its files exist
            loaded = None
        if loaded is None:  # or it logs a warning and carries on untouched
            raise ConfigError(
                f"{directory} has no complete DeepSpeed state in {CHECKPOINT_DIR}/{CHECKPOINT_TAG}. Resume from "
                "another checkpoint, or start fresh with trainer.resume=null."
            )


def declared_optimizer(config: dict[str, Any], optimizer: DummyOptim, world_size: int) -> dict[str, Any]:
    """`deepspeed.initialize`'s arguments for the optimizer and schedule that `config` declares, its "auto"
    values filled from Accelerate's `DummyOptim` and `DummyScheduler` (in place), as Accelerate fills them."""
    if "optimizer" not in config:
        raise ValueError(
            "DummyOptim stands for the optimizer the DeepSpeed config declares, and this config has no optimizer "
            "block. Add one, or prepare a torch optimizer."
        )
    fill_auto(
        config, {"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay}
    )
    kwargs: dict[str, Any] = {"model_parameters": optimizer.param_groups}
    scheduler = optimizer.scheduler
    if scheduler is not None and scheduler.lr_scheduler_callable is not None:
        kwargs["lr_scheduler"] = scheduler.lr_scheduler_callable
    elif scheduler is not None:
        if "scheduler" not in config:
            raise ValueError(
                "DummyScheduler without lr_scheduler_callable stands for the DeepSpeed config's scheduler block, "
                "and this config has none. Add one, or pass lr_scheduler_callable."
            )
        schedule = {
            "scheduler.params.warmup_min_lr": 0,
            "scheduler.params.warmup_max_lr": optimizer.lr,
            "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps),  # DeepSpeed refuses 0
        }
        if scheduler.total_num_steps is not None:  # Accelerate's: per process
            schedule["scheduler.params.total_num_steps"] = math.ceil(scheduler.total_num_steps / world_size)
        fill_auto(config, schedule)
    elif "scheduler" in config:
        raise ValueError(
            "The DeepSpeed config declares a scheduler block: prepare runner.utils.DummyScheduler(optimizer, ...) "
            "with the DummyOptim, or remove the block."
        )
    return kwargs


class SteppedByEngine:
    """A schedule the DeepSpeed engine steps with its optimizer: `step()` does nothing; the rest
    (`get_last_lr`, `state_dict`, ...) is the schedule's."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The engine stepped it."""

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def _has_fp32_master(tensor: torch.Tensor) -> bool:
    """Whether DeepSpeed's optimizer keeps an fp32 copy of `tensor` (a trained parameter)."""
    return getattr(tensor, "_z3_optimizer", None) is not None or hasattr(tensor, "_hp_mapping")


def _read_user_config(config: str | dict[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, DictConfig):  # written inline in YAML
        return OmegaConf.to_container(config, resolve=True)
    if not isinstance(config, str):
        return copy.deepcopy(dict(config))
    try:
        loaded = json.loads(Path(config).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"hardware.config={config!r}: not a readable DeepSpeed JSON file ({err}).") from err
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"hardware.config={config!r}: a DeepSpeed config is a JSON object, not {type(loaded).__name__}."
        )
    return loaded


def _loss_scaling(precision: MixedPrecision) -> dict[str, Any]:
    """DeepSpeed's dynamic loss scaling from the fp16 group's settings (it doubles and halves only)."""
    scaler = precision.scaler_kwargs if isinstance(precision, Float16MixedPrecision) else {}
    if scaler.get("growth_factor", 2.0) != 2.0 or scaler.get("backoff_factor", 0.5) != 0.5:
        raise ConfigError(
            "precision.growth_factor/backoff_factor with hardware=deepspeed: DeepSpeed's loss scale only "
            "doubles and halves. Leave them at 2.0 and 0.5."
        )
    return {
        "enabled": True,
        "loss_scale": 0,  # dynamic
        "initial_scale_power": int(math.log2(scaler.get("init_scale", 2.0**16))),
        "loss_scale_window": scaler.get("growth_interval", 2000),
        "hysteresis": 1,
    }


def _check_agreement(user: dict[str, Any], run: dict[str, Any], source: str, by: str) -> None:
    """Refuse a user's config value that contradicts the run's (None in `run`: the run does not care)."""
    for key, ours in run.items():
        theirs = user.get(key, "auto")
        if isinstance(ours, dict) and isinstance(theirs, dict):
            _check_agreement(theirs, ours, f"{source}.{key}", by)
        elif theirs != "auto" and ours is not None and theirs != ours:
            raise ConfigError(
                f'{source}.{key}={theirs!r} contradicts the run\'s value {ours!r} (from {by}). Set it to "auto" '
                "(or remove it) to take the run's value, or change the run's setting."
            )


def _fill(user: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """`user` with every "auto" or missing value taken from `run` (nested)."""
    for key, ours in run.items():
        if isinstance(ours, dict) and isinstance(user.get(key), dict):
            _fill(user[key], ours)
        elif user.get(key, "auto") == "auto":
            user[key] = ours
    return user


def _sharded_at(zero_stage: int) -> frozenset[str]:
    """The states ZeRO stage `zero_stage` partitions: the optimizer's, then the gradients, then the weights."""
    return frozenset(["optimizer", "gradients", "weights"][:zero_stage])


def fill_auto(config: dict[str, Any], values: dict[str, Any]) -> None:
    """Set each dotted key of `values` in the DeepSpeed `config` where the config says "auto" (Accelerate's
    rule: a key the config leaves out stays out, and DeepSpeed's default applies)."""
    for key, value in values.items():
        node, leaf = config_node(config, key)
        if node is not None and node.get(leaf) == "auto":
            node[leaf] = value


def config_node(config: dict[str, Any], key: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding dotted `key`'s last part (None where a block on the way is missing), and that part."""
    *path, leaf = key.split(".")
    node: Any = config
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf
