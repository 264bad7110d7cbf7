"""Accelerate's `accelerate.utils` names, for scripts that import them from here (`from runner.utils import
set_seed`): re-exported from the modules that hold them, and the few that only a script calls."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import operator
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version
from torch.nn.parallel import DistributedDataParallel

import runner.engine.collectives as collectives
from runner.accelerate.handlers import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    TorchDynamoPlugin,
)
from runner.accelerate.memory import find_executable_batch_size, release_memory
from runner.accelerate.parallelism_config import ParallelismConfig, TorchContextParallelConfig
from runner.accelerate.partial_state import PartialState, active_strategy
from runner.checkpoint.checkpointer import ProjectConfiguration
from runner.cluster import patch_environment
from runner.hardware.base import DummyOptim, DummyScheduler
from runner.hardware.big_modeling import (
    check_device_map,
    compute_module_sizes,
    get_balanced_memory,
    get_max_memory,
    infer_auto_device_map,
    load_checkpoint_in_model,
)
from runner.hardware.parallelize import DDPCommunicationHookType
from runner.ops import apply_to_tensors, concatenate, convert_to_fp32, find_batch_size, send_to_device
from runner.precision import PrecisionType
from runner.rng import RNGType, set_seed
from runner.state import DistributedType
from runner.torch_internals import compiled_module, compiled_wrapper
from runner.trackers import LoggerType

__all__ = [
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DummyOptim",
    "DummyScheduler",
    "DynamoBackend",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "ParallelismConfig",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "broadcast",
    "broadcast_object_list",
    "check_device_map",
    "compare_versions",
    "compute_module_sizes",
    "concatenate",
    "convert_to_fp32",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_accelerator_free_memory",
    "get_balanced_memory",
    "get_distributed_backend",
    "get_int_from_env",
    "get_max_memory",
    "get_torch_accelerator_backend",
    "infer_auto_device_map",
    "is_4bit_bnb_available",
    "is_8bit_bnb_available",
    "is_aim_available",
    "is_amdsmi_available",
    "is_bf16_available",
    "is_bitsandbytes_multi_backend_available",
    "is_bnb_available",
    "is_boto3_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_compiled_module",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp8_available",
    "is_fp16_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_import_timer_available",
    "is_lomo_available",
    "is_matplotlib_available",
    "is_megatron_lm_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_msamp_available",
    "is_musa_available",
    "is_namedtuple",
    "is_neuron_available",
    "is_npu_available",
    "is_pandas_available",
    "is_peft_available",
    "is_peft_model",
    "is_pippy_available",
    "is_port_in_use",
    "is_pynvml_available",
    "is_pytest_available",
    "is_rich_available",
    "is_rocm_available",
    "is_sagemaker_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_tensor",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_weights_only_available",
    "is_xccl_available",
    "is_xpu_available",
    "load_checkpoint_in_model",
    "normalize_device",
    "pad_across_processes",
    "parse_flag_from_env",
    "patch_environment",
    "recursively_apply",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "str_to_bool",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "wait_for_everyone",
    "write_basic_config",
]


# The names of the files in Accelerate's checkpoints, which runner's full checkpoints carry too (hard
# links) and its `load_state` reads.
MODEL_NAME = "pytorch_model"
SAFE_MODEL_NAME = "model"
WEIGHTS_NAME = f"{MODEL_NAME}.bin"
SAFE_WEIGHTS_NAME = f"{SAFE_MODEL_NAME}.safetensors"
WEIGHTS_INDEX_NAME = f"{WEIGHTS_NAME}.index.json"
SAFE_WEIGHTS_INDEX_NAME = f"{SAFE_WEIGHTS_NAME}.index.json"
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
RNG_STATE_NAME = "random_states"
SCALER_NAME = "scaler.pt"


def str_to_bool(value: str) -> int:
    """1 for a true word ("y", "yes", "t", "true", "on", "1"), 0 for a false one, else a ValueError."""
    if value.lower() in ("y", "yes", "t", "true", "on", "1"):
        return 1
    if value.lower() in ("n", "no", "f", "false", "off", "0"):
        return 0
    raise ValueError(f"invalid truth value {value!r}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The environment variable `key` read as a true or false word (`default` when unset)."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first of `env_keys` set to a non-negative integer, else `default`."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


# The collectives, as functions over the process's `PartialState` (the group an Accelerator set up, else
# one set up as `Accelerator()` would).
def gather(tensor: Any) -> Any:
    """Tensors (nested structures too) from all processes, concatenated along the first dimension."""
    return collectives.gather(active_strategy(), tensor)


def gather_object(object: Any) -> list[Any]:
    """Every process's picklable `object`, in process order (lists and tuples concatenated)."""
    return collectives.gather_object(active_strategy(), object)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Tensors (nested too) reduced across processes: "mean" (the default here, as in Accelerate),
    "sum", "max", "min", "none"; times `scale`."""
    return collectives.reduce(active_strategy(), tensor, reduction, scale)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Tensors (nested too) overwritten in place with process `from_process`'s."""
    return collectives.broadcast(active_strategy(), tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """The picklable objects of `object_list` replaced in place by process `from_process`'s."""
    return collectives.broadcast_object_list(active_strategy(), object_list, from_process)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Tensors (nested too) padded along `dim` to the largest size any process has."""
    return collectives.pad_across_processes(active_strategy(), tensor, dim, pad_index, pad_first)


def wait_for_everyone() -> None:
    """Block until every process reaches this line."""
    active_strategy().barrier()


def synchronize_rng_states(rng_types: list[str | RNGType], generator: torch.Generator | None = None) -> None:
    """Give every process process 0's state of the RNGs `rng_types` names ("torch", "cuda", and
    "generator": `generator`)."""
    state = PartialState()
    generators = collectives.rng_generators(rng_types, state.device, [generator] if generator else [])
    collectives.synchronize_rng_states(state.strategy, generators)


def synchronize_rng_state(
    rng_type: str | RNGType | None = None, generator: torch.Generator | None = None
) -> None:
    """`synchronize_rng_states` for one RNG type."""
    synchronize_rng_states([rng_type] if rng_type is not None else [], generator)


def write_basic_config(mixed_precision: str = "no", save_location: str | None = None) -> Path | bool:
    """Write Accelerate's minimal launch config (a `default_config.yaml` for `accelerate launch`) for this
    machine: one process per visible GPU, else one on the CPU. Returns False, writing nothing, when the
    file exists (as Accelerate does). Default place: `$HF_HOME/accelerate/default_config.yaml`."""
    precision = PrecisionType(mixed_precision)  # a ValueError for an unknown name
    path = Path(save_location) if save_location else _accelerate_config_home() / "default_config.yaml"
    if path.exists():
        return False
    gpus = torch.cuda.device_count()
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": DistributedType.MULTI_GPU.value if gpus > 1 else DistributedType.NO.value,
        "mixed_precision": precision.value,
        "num_machines": 1,
        "num_processes": max(gpus, 1),
        "use_cpu": gpus == 0,
        "debug": False,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML, which accelerate's loader reads
    return path


def _accelerate_config_home() -> Path:
    hf_home = (
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    )
    return Path(hf_home) / "accelerate"


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = lambda data: isinstance(data, torch.Tensor),
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Accelerate's signature over `runner.ops.apply_to_tensors`: `func(tensor, *args, **kwargs)` for every
    tensor in the nested `data`; TypeError for anything else with `error_on_other_type`. Only tensors are
    visited: another `test_type` is refused."""
    if test_type(torch.empty(0)) is not True or test_type(0) is not False:
        raise ValueError(
            "recursively_apply: runner applies functions to tensors only (test_type must pick tensors)."
        )
    return apply_to_tensors(lambda tensor: func(tensor, *args, **kwargs), data, strict=error_on_other_type)


def extract_model_from_parallel(
    model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
) -> torch.nn.Module:
    """The user's model inside DDP, a DeepSpeed engine or `torch.compile`'s wrapper (kept with
    `keep_torch_compile`); `keep_fp32_wrapper=False` also removes a mixed-precision autocast forward."""
    compiled = compiled_module(model)
    inner = model if compiled is None else compiled
    while isinstance(inner, DistributedDataParallel) or type(inner).__name__ == "DeepSpeedEngine":
        inner = inner.module
    if not keep_fp32_wrapper and "_original_forward" in inner.__dict__:
        inner.forward = inner.__dict__.pop("_original_forward")
    if compiled is not None and keep_torch_compile:
        return compiled_wrapper(model, inner)
    return inner


# Accelerate's availability checks (`accelerate.utils.is_*_available`), answered for this process.


def _installed(module: str, minimum: str | None = None) -> Callable[..., bool]:
    def available(*_: Any, **__: Any) -> bool:
        if importlib.util.find_spec(module) is None:
            return False
        return minimum is None or compare_versions(module, ">=", minimum)

    available.__doc__ = f"Whether `{module}`{f' {minimum} or newer' if minimum else ''} can be imported here."
    return available


is_aim_available = _installed("aim")
is_amdsmi_available = _installed("amdsmi")
is_boto3_available = _installed("boto3")
is_clearml_available = _installed("clearml")
is_comet_ml_available = _installed("comet_ml")
is_datasets_available = _installed("datasets")
is_deepspeed_available = _installed("deepspeed")
is_dvclive_available = _installed("dvclive")
is_import_timer_available = _installed("import_timer")
is_lomo_available = _installed("lomo_optim")
is_matplotlib_available = _installed("matplotlib")
is_mlflow_available = _installed("mlflow")
is_msamp_available = _installed("msamp")
is_pandas_available = _installed("pandas")
is_peft_available = _installed("peft")
is_pynvml_available = _installed("pynvml")
is_pytest_available = _installed("pytest")
is_sagemaker_available = _installed("sagemaker")
is_schedulefree_available = _installed("schedulefree")
is_swanlab_available = _installed("swanlab")
is_tensorboard_available = _installed("tensorboard")
is_timm_available = _installed("timm")
is_torchao_available = _installed("torchao")
is_torchdata_available = _installed("torchdata")
is_torchdata_stateful_dataloader_available = _installed("torchdata", "0.8.0")
is_torchvision_available = _installed("torchvision")
is_trackio_available = _installed("trackio")
is_transformer_engine_available = _installed("transformer_engine")
is_transformers_available = _installed("transformers")
is_triton_available = _installed("triton")
is_wandb_available = _installed("wandb")
is_4bit_bnb_available = _installed("bitsandbytes", "0.39.0")
is_8bit_bnb_available = _installed("bitsandbytes", "0.37.2")


def is_rich_available() -> bool:
    """Whether rich is installed and asked for ($ACCELERATE_ENABLE_RICH, as under Accelerate)."""
    return _installed("rich")() and os.environ.get("ACCELERATE_ENABLE_RICH", "").lower() in (
        "1",
        "true",
        "yes",
    )


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether bitsandbytes (`min_version` or newer) can be imported here."""
    return _installed("bitsandbytes", min_version)()


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether the installed bitsandbytes has its multi-backend feature."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is installed and this GPU runs its MXFP8."""
    if not is_transformer_engine_available():
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_fp8_available() -> bool:
    """Whether runner's fp8 (`precision=fp8`: torchao's float8 training) can be installed here: torchao is."""
    return is_torchao_available()


def is_megatron_lm_available() -> bool:
    """Whether Accelerate's Megatron-LM plugin could run: never here (runner's `hardware=tensor_parallel` is its own
    tensor and pipeline parallel over torch, and needs no Megatron-LM)."""
    return False


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether torch_xla can be imported (and, when asked, whether its device is a TPU or a GPU)."""
    if importlib.util.find_spec("torch_xla") is None:
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime as xr

    return xr.device_type() in (("TPU",) if check_is_tpu else ("GPU", "CUDA"))


def _device_backend(package: str | None, attribute: str) -> Callable[..., bool]:
    """Whether the accelerator `torch.<attribute>` (brought by `package`, if any) is here."""

    def available(check_device: bool = False, **_: Any) -> bool:
        if package is not None:
            if importlib.util.find_spec(package.split(".")[0]) is None:
                return False
            try:
                importlib.import_module(package)
            except Exception:  # installed but broken (a CPU-only container): not available
                return False
        backend = getattr(torch, attribute, None)
        try:
            return backend is not None and bool(backend.is_available())
        except RuntimeError:
            return False

    available.__doc__ = f"Whether `torch.{attribute}` devices are available here."
    return available


is_npu_available = _device_backend("torch_npu", "npu")
is_mlu_available = _device_backend("torch_mlu", "mlu")
is_musa_available = _device_backend("torch_musa", "musa")
is_sdaa_available = _device_backend("torch_sdaa", "sdaa")
is_neuron_available = _device_backend("torch_neuronx", "neuron")
is_hpu_available = _device_backend("habana_frameworks.torch", "hpu")
is_xpu_available = _device_backend(None, "xpu")


def is_cuda_available() -> bool:
    """Whether CUDA devices are here, asked through NVML so that CUDA stays uninitialised (forked ranks
    can still use it)."""
    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return torch.cuda.is_available()


def is_rocm_available() -> bool:
    """Whether this is a ROCm build of torch with AMD GPUs here."""
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS device is here."""
    return torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_habana_gaudi1() -> bool:
    """Whether the HPU here is a first-generation Gaudi (which has no fp16)."""
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp

    return htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether this process's accelerator computes in bf16 (a CPU does)."""
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    return True


def is_fp16_available() -> bool:
    """Whether fp16 runs here (everywhere but a first-generation Gaudi)."""
    return not is_habana_gaudi1()


def is_xccl_available() -> bool:
    """Whether torch.distributed has its XCCL backend (Intel GPUs)."""
    return bool(getattr(torch.distributed.distributed_c10d, "is_xccl_available", lambda: False)())


def is_pippy_available() -> bool:
    """Whether torch's pipelining (torch.distributed.pipelining, torch 2.4+) is here."""
    return is_torch_version(">=", "2.4.0")


def is_weights_only_available() -> bool:
    """Whether `torch.load(weights_only=True)` takes an allowlist (torch 2.4+)."""
    return is_torch_version(">=", "2.4.0")


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """`library_or_version` (an installed distribution's name, or a version) `operation` (">=", "<", ...)
    `requirement_version`."""
    if operation not in _OPERATIONS:
        raise ValueError(f"operation={operation!r}: expected one of {', '.join(_OPERATIONS)}.")
    if isinstance(library_or_version, str):
        library_or_version = Version(importlib.metadata.version(library_or_version))
    return _OPERATIONS[operation](library_or_version, Version(requirement_version))


_OPERATIONS = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def is_torch_version(operation: str, version: str) -> bool:
    """This process's torch `operation` `version` (its base version: 2.13.0+cpu is 2.13.0)."""
    return compare_versions(Version(Version(torch.__version__).base_version), operation, version)


def get_torch_accelerator_backend(check_available: bool = True) -> tuple[str | None, Any]:
    """The accelerator torch finds here and its device module (`torch.cuda`, `torch.xpu`, ...), or (None,
    None); `check_available=False` names it without probing a device (before a fork)."""
    device = torch.accelerator.current_accelerator(check_available=check_available)
    if device is None:
        return None, None
    return device.type, torch.get_device_module(device.type)


def get_accelerator_free_memory(device_module: Any, device_index: int) -> int:
    """Free memory in bytes of device `device_index` of `device_module` (`get_torch_accelerator_backend`)."""
    if device_module is torch.accelerator:
        return torch.accelerator.get_memory_info(device_index)[0]
    return device_module.mem_get_info(device_index)[0]


# An accelerator's process-group backend (its vendor's plugin registers those torch does not ship).
ACCELERATOR_BACKENDS = {
    **{"cuda": "nccl", "xpu": "xccl", "npu": "hccl", "hpu": "hccl", "mlu": "cncl", "musa": "mccl"},
    **{"sdaa": "tccl", "neuron": "neuron"},
}


def get_distributed_backend(device_type: str | None) -> str | None:
    """The process-group backend of accelerator `device_type` (nccl for cuda), None for a CPU or a device
    without one (xpu without xccl)."""
    if device_type == "xpu" and not is_xccl_available():
        return None
    return ACCELERATOR_BACKENDS.get(device_type) if device_type else None


def normalize_device(device: Any) -> Any:
    """A device index as the accelerator's device name ("xpu:0"; a CUDA index stays an int), "npu" as
    "npu:0"; anything else as it is."""
    if device == "npu":
        return "npu:0"
    if isinstance(device, int):
        device_type, _ = get_torch_accelerator_backend(check_available=False)
        if device_type == "hpu":
            return "hpu"
        if device_type not in (None, "cuda"):
            return f"{device_type}:{device}"
    return device


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on `port` (29500, torch's default rendezvous port) of localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(("localhost", port or 29500)) == 0


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether `module` is `torch.compile`'s wrapper of a model."""
    return compiled_module(module) is not None


def is_namedtuple(data: Any) -> bool:
    """Whether `data` is a namedtuple."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether `model` (inside DDP, DeepSpeed or `torch.compile` too) is a PEFT model."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)
