"""Big model inference, with Accelerate's names and semantics: build a model without allocating its weights,
place its modules on devices with a device map (GPUs, CPU, disk), load a checkpoint straight into place,
and run it with hooks that bring offloaded weights to the execution device just in time.

A device map maps module (or tensor) names to a device: a GPU index or `"cuda:N"`, `"cpu"`, or `"disk"`.
Modules on a GPU run there; on a machine with a GPU, modules on `"cpu"` keep their weights in CPU memory
and run on the first GPU; modules on `"disk"` keep nothing in memory and read their weights from the
checkpoint's safetensors files (or `offload_folder`) each time they run.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode

from runner.checkpoint.weights import (
    StoredTensor,
    check_against_model,
    checkpoint_tensors,
    get_module_tensor,
    is_parameter,
    named_tensors,
    parse_size,
    place_tensor,
    read_tensor,
    set_module_tensor,
    stored_tensors,
    tensor_aliases,
    tensor_owner,
)
from runner.ops import send_to_device

Device = int | str
AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
OFFLOAD_INDEX = "index.json"


@contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Modules built inside get their parameters (and buffers, with `include_buffers`) on the meta
    device: shapes and dtypes without memory, to be filled by `load_checkpoint_and_dispatch`."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Modules built inside get their parameters (and buffers, with `include_buffers`) on `device`.
    Parameters assigned again (tied weights) stay the same object."""
    device = torch.device(device)
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def parameter_on_device(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device != device:
            kwargs = {**param.__dict__, "requires_grad": param.requires_grad}
            param = type(param)(param.to(device), **kwargs)
        register_parameter(module, name, param)

    def buffer_on_device(
        module: nn.Module, name: str, buffer: torch.Tensor | None, persistent: bool = True
    ) -> None:
        register_buffer(module, name, None if buffer is None else buffer.to(device), persistent=persistent)

    nn.Module.register_parameter = parameter_on_device  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = buffer_on_device  # type: ignore[method-assign]
    try:
        with _MetaValuesSkipped() if device.type == "meta" else nullcontext():
            yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]


class _MetaValuesSkipped(TorchFunctionMode):
    """Inside, what a module's initialisation writes values with (`torch.nn.init`'s functions, and the
    tensors' own in-place fills and arithmetic) returns a meta tensor as it is: it has no values to write.
    Run, the Python meta kernels of some (`normal_`, `clamp_`, `erfinv_` ...) import `torch._dynamo`:
    about 75 MB of memory and a second, paid by every model built empty (most of what loading a 1 GB
    checkpoint held above its size)."""

    VALUE_OPS = frozenset(
        getattr(torch.Tensor, name)
        for name in (
            "normal_", "uniform_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_",
            "bernoulli_", "fill_", "zero_", "erfinv_", "clamp_", "mul_", "add_", "div_", "sub_", "copy_",
        )
    )  # fmt: skip

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
        value_op = func in self.VALUE_OPS or getattr(func, "__module__", None) == "torch.nn.init"
        if value_op and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- device maps


def compute_module_sizes(model: nn.Module, dtype: torch.dtype | str | None = None) -> dict[str, int]:
    """Bytes of every module and tensor of `model` by name ("" is the whole model); floating point tensors
    counted at `dtype` when given. A tied tensor counts once, with the first module that holds it."""
    dtype = _dtype(dtype)
    sizes: dict[str, int] = {}
    for name, tensor in named_tensors(model):
        itemsize = (
            dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
        )
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            sizes[prefix] = sizes.get(prefix, 0) + tensor.numel() * itemsize
    return sizes


def get_max_memory(max_memory: Mapping[Device, int | str | None] | None = None) -> dict[Device, int]:
    """Bytes each device may hold, in placement order (GPUs, then "cpu", then "disk"); None (or a None
    value for a device): what is free on every GPU and the CPU memory available now."""
    free: dict[Device, int] = {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}
    free["cpu"] = available_cpu_memory()
    if max_memory is None:
        return free
    memory = {}
    for device, size in max_memory.items():
        key = _device_key(device)
        if size is None:
            memory[key] = free.get(key, 0)
            continue
        try:
            memory[key] = parse_size(size)
        except ValueError:
            raise ValueError(
                f"max_memory[{device!r}]={size!r}: expected bytes as an int or a string like '200MB' or '2GiB'."
            ) from None
    order = {"mps": 1, "cpu": 2, "disk": 3}
    return dict(sorted(memory.items(), key=lambda item: (order.get(item[0], 0), str(item[0]))))  # type: ignore[arg-type]


def available_cpu_memory() -> int:
    """Bytes of memory the system can still give (MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    low_zero: bool = False,
) -> dict[Device, int]:
    """`max_memory` lowered so that the model spreads evenly over the GPUs (GPU 0 kept nearly free with
    `low_zero`) instead of filling the first ones; unchanged with fewer than two GPUs."""
    memory = get_max_memory(max_memory)
    gpus = [d for d in memory if isinstance(d, int)]
    if len(gpus) < 2:
        return memory
    sizes = compute_module_sizes(model, dtype)
    largest = _largest_unsplittable(model, sizes, set(no_split_module_classes or []))[1]
    share = sizes[""] // (len(gpus) - int(low_zero)) + largest
    for gpu in gpus:
        memory[gpu] = min(memory[gpu], largest if low_zero and gpu == gpus[0] else share)
    return memory


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> dict[str, Device]:
    """Fill the devices in order (GPUs, CPU, then disk) with the model's modules in definition order,
    splitting a module that does not fit into its children unless its class is in
    `no_split_module_classes`. When not everything fits on the first device, room for the largest
    unsplittable module stays free there: offloaded modules are brought there to run."""
    memory = get_max_memory(max_memory)
    devices: list[Device] = [*memory, *(["disk"] if "disk" not in memory else [])]
    no_split = set(no_split_module_classes or [])
    sizes = compute_module_sizes(model, dtype)
    if sizes[""] <= memory.get(devices[0], 0):
        return {"": devices[0]}
    largest_name, largest = _largest_unsplittable(model, sizes, no_split)
    main = devices[0]
    if main != "disk" and largest > memory[main]:
        raise ValueError(
            f"max_memory: {_device_name(main)} may hold {_size(memory[main])}, less than the largest module that "
            f"cannot be split, {largest_name!r} ({_size(largest)}), which has to fit there to run. Raise "
            f"max_memory[{main!r}] to at least {_size(largest)}, or let that module be split (remove its class "
            "from no_split_module_classes)."
        )
    device_map: dict[str, Device] = {}
    queue = _pieces(model, "")
    index, used = 0, 0
    while queue:
        name, module = queue.pop(0)
        device = devices[index]
        budget = memory.get(device, float("inf")) - (largest if index == 0 else 0)
        if used + sizes.get(name, 0) <= budget:
            device_map[name] = device
            used += sizes.get(name, 0)
        elif module is not None and type(module).__name__ not in no_split and _pieces(module, name):
            queue[:0] = _pieces(module, name)
        else:
            index, used = index + 1, 0
            queue.insert(0, (name, module))
    return _compact(model, device_map)


def check_device_map(model: nn.Module, device_map: Mapping[str, Device]) -> None:
    """ValueError for a name that is not in the model, a device that does not exist here, or tensors the
    map does not place."""
    names = {name for name, _ in model.named_modules()} | {name for name, _ in named_tensors(model, True)}
    for key, device in device_map.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"device_map names {key!r}, which is not a module or tensor of the model.{hint}")
        _device_key(device, where=f"device_map[{key!r}]")
    unplaced = [name for name, _ in named_tensors(model, True) if _placement(device_map, name) is None]
    if unplaced:
        raise ValueError(
            f"device_map does not place {', '.join(unplaced[:5])}{' ...' if len(unplaced) > 5 else ''}. Add their "
            "modules (or '' for everything not named) to it."
        )


# ------------------------------------------------------------------------------------------------ loading


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: Mapping[str, Device] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: list[str] | None = None,
    strict: bool = False,
) -> None:
    """Load a checkpoint (a safetensors or torch file, or a directory with one or with shards and an
    index) into `model`, tensor by tensor, each straight onto its device in `device_map` (else where the
    model's tensor is; the CPU for meta tensors). Tensors mapped to "disk" stay on the meta device and
    are listed in `offload_folder` (safetensors checkpoints are pointed to, not copied); so are the
    buffers of modules on "disk" with `offload_buffers`, which are otherwise loaded on the CPU.

    `dtype` converts floating-point tensors, except those of modules whose name contains one of
    `keep_in_fp32_modules` (kept in float32). Every name and shape is checked before anything is loaded:
    a tensor with another shape than the model's raises ValueError naming it, and the model is left as it
    was; a tensor the model lacks, or one the checkpoint lacks, is logged as a warning and skipped
    (Accelerate's default), or refused the same way with `strict`. `offload_state_dict` is Accelerate's
    way not to hold the whole state dict in memory: loading here is always tensor by tensor.
    """
    dtype = _dtype(dtype)
    sources = checkpoint_tensors(checkpoint)
    for name in check_against_model(model, checkpoint, sources, strict):
        del sources[name]
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    if device_map is not None:
        check_device_map(model, device_map)
    aliases = tensor_aliases(model)
    offloaded: dict[str, str] = {}  # every name of an offloaded tensor -> its name in the checkpoint
    pending: dict[str, torch.Tensor] = {}  # offloaded tensors that need writing to offload_folder
    current = dict(named_tensors(model, True))
    for name, source in sources.items():
        placement = _placement(device_map, name) if device_map is not None else None
        if placement == "disk" and name in buffers and not offload_buffers:
            placement = "cpu"
        tensor_dtype = torch.float32 if _kept_in_fp32(name, keep_in_fp32_modules) else dtype
        if placement == "disk":
            _leave_on_meta(
                model, name, source, tensor_dtype, current[name], aliases.get(name, [name]), pending
            )
            offloaded.update(dict.fromkeys(aliases.get(name, [name]), name))
            continue
        target = None if placement is None else torch.device(_device_name(placement))
        place_tensor(model, name, read_tensor(source, tensor_dtype), target, current, aliases)
    if offloaded or pending:
        if offload_folder is None:
            raise ValueError(
                "device_map puts some modules on 'disk': pass an offload_folder where their weights are listed."
            )
        write_offload_index(Path(offload_folder), offloaded, sources, pending)


def _leave_on_meta(
    model: nn.Module,
    name: str,
    source: Any,
    dtype: torch.dtype | None,
    current: torch.Tensor,
    aliases: list[str],
    pending: dict[str, torch.Tensor],
) -> None:
    """Put a meta placeholder for offloaded tensor `name` (under each of its `aliases`) in `model`, in the
    dtype it is stored in; a tensor that needs writing to the offload folder (not a stored safetensors
    one, or converted to `dtype`) goes to `pending`."""
    converts = dtype is not None and source.dtype.is_floating_point and source.dtype != dtype
    if not isinstance(source, StoredTensor) or converts:
        pending[name] = read_tensor(source, dtype)
    stored_dtype = pending[name].dtype if name in pending else source.dtype
    placeholder = torch.empty(source.shape, dtype=stored_dtype, device="meta")  # loaded in this dtype
    if isinstance(current, nn.Parameter):
        placeholder = nn.Parameter(placeholder, requires_grad=current.requires_grad)
    for alias in aliases:
        set_module_tensor(model, alias, placeholder)


def _kept_in_fp32(name: str, modules: list[str] | None) -> bool:
    """Whether tensor `name` belongs to a module that `keep_in_fp32_modules` names (one part of its
    dotted path, as in Accelerate)."""
    parts = name.split(".")
    return any(module in parts for module in modules or [])


def write_offload_index(
    folder: Path,
    names: Mapping[str, str],
    sources: Mapping[str, StoredTensor | torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    """List in `folder` where each offloaded tensor (`names`: each name -> its checkpoint name) lies: in
    the checkpoint's safetensors files, or for `tensors` (converted, or from torch files) in a file
    written to `folder` first."""
    folder.mkdir(parents=True, exist_ok=True)
    located = {k: v for k, v in sources.items() if isinstance(v, StoredTensor)}
    if tensors:
        path = folder / "offloaded.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        located.update(stored_tensors(path))
    entries = {}
    for name, source in names.items():
        t = located[source]
        entries[name] = {"file": str(t.file.resolve()), "offset": t.offset, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}  # fmt: skip
    (folder / OFFLOAD_INDEX).write_text(json.dumps(entries))


def read_offload_index(folder: str | os.PathLike) -> dict[str, StoredTensor]:
    entries = json.loads((Path(folder) / OFFLOAD_INDEX).read_text())
    return {
        name: StoredTensor(Path(e["file"]), e["offset"], getattr(torch, e["dtype"]), tuple(e["shape"]))
        for name, e in entries.items()
    }


# ------------------------------------------------------------------------------------------------ dispatch


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, Device],
    main_device: Device | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Attach the hooks that run `model` as `device_map` places it: each module's inputs go to its
    execution device (but keyword arguments named in `skip_keys`); modules on "cpu" (when a GPU runs them)
    or "disk" get their weights there just before they run and drop them after. A module whose class is
    in `preload_module_classes` loads the weights of all its submodules before it runs (for modules that
    use a child's weights without calling it). The model's tensors must already be where the map says
    (as `load_checkpoint_in_model` leaves them). Hooks are attached even for a map of one device, as
    `force_hooks=True` asks in Accelerate."""
    check_device_map(model, device_map)
    devices = list(dict.fromkeys(device_map.values()))
    if main_device is None:
        compute = [d for d in devices if d not in ("cpu", "disk")]
        main_device = compute[0] if compute else "cpu"
    execution = torch.device(_device_name(main_device))
    stored = read_offload_index(offload_dir) if offload_dir is not None and "disk" in devices else {}
    preloading = _preloading_modules(model, set(preload_module_classes or []))
    for entry, device in device_map.items():
        offloaded = device == "disk" or (device == "cpu" and execution.type != "cpu")
        run_on = execution if offloaded else torch.device(_device_name(device))
        # Hooks go on the modules that hold the tensors (a container such as ModuleList never runs).
        owners: dict[str, list[str]] = {}
        for name, _ in named_tensors(model, True):
            if _placement_key(device_map, name) == entry:
                owners.setdefault(_owner(name, preloading), []).append(name)
        for owner, names in owners.items():
            loaders = _loaders(model, names, device, stored, offload_buffers) if offloaded else {}
            _attach(model, model.get_submodule(owner), run_on, loaders, skip_keys)
        module, attribute = tensor_owner(model, entry)
        if not attribute and entry not in owners:  # its inputs too, for what it computes itself
            _attach(model, module, run_on, {}, skip_keys)
    model.hf_device_map = dict(device_map)  # type: ignore[assignment]  # Accelerate's attribute
    return model


def cpu_offload(
    model: nn.Module,
    execution_device: Device | torch.device | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep `model`'s weights in CPU memory and bring each module's to `execution_device` (default: the
    first GPU, else the CPU) only while it runs; `state_dict` (on the CPU) replaces the model's weights
    first."""
    if state_dict is not None:
        for name, tensor in state_dict.items():
            set_module_tensor(model, name, tensor.to("cpu"))
    model.to("cpu")
    return dispatch_model(
        model,
        {"": "cpu"},
        main_device=_execution_device(execution_device),
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
    )


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: Device | torch.device | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Write `model`'s weights (and buffers, with `offload_buffers`) to `offload_dir` unless it already
    holds an offload index, leave none in memory, and read each module's from there while it runs on
    `execution_device` (default: the first GPU, else the CPU)."""
    folder = Path(offload_dir)
    if not (folder / OFFLOAD_INDEX).exists():
        offloaded = {
            name: tensor.detach().to("cpu")
            for name, tensor in named_tensors(model)
            if offload_buffers or is_parameter(model, name)
        }
        aliases = tensor_aliases(model)
        names = {alias: name for name in offloaded for alias in aliases.get(name, [name])}
        write_offload_index(folder, names, {}, offloaded)
    for name, stored in read_offload_index(folder).items():
        current = get_module_tensor(model, name)
        placeholder = torch.empty(stored.shape, dtype=stored.dtype, device="meta")
        if isinstance(current, nn.Parameter):
            placeholder = nn.Parameter(placeholder, requires_grad=current.requires_grad)
        set_module_tensor(model, name, placeholder)
    return dispatch_model(
        model,
        {"": "disk"},
        main_device=_execution_device(execution_device),
        offload_dir=folder,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
    )


class UserCpuOffloadHook:
    """What `cpu_offload_with_hook` returns: `offload()` sends the model back to the CPU, `remove()`
    detaches the hook."""

    def __init__(self, model: nn.Module, handle: Any) -> None:
        self.model = model
        self.handle = handle

    def offload(self) -> None:
        self.model.to("cpu")

    def remove(self) -> None:
        self.handle.remove()


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: Device | torch.device | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep `model` on the CPU until it is called: then it moves whole to `execution_device` (default: the
    first GPU, else the CPU), after offloading the model of `prev_module_hook`, and stays there until its
    hook's `offload()`. For pipelines of models run one after another (a text encoder, then a UNet, ...)."""
    device = torch.device(_device_name(_execution_device(execution_device)))
    model.to("cpu")

    def to_device(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if prev_module_hook is not None:
            prev_module_hook.offload()
        module.to(device)
        return send_to_device(args, device), send_to_device(kwargs, device)

    handle = model.register_forward_pre_hook(to_device, with_kwargs=True)
    return model, UserCpuOffloadHook(model, handle)


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | Mapping[str, Device] | None = None,
    max_memory: Mapping[Device, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
) -> nn.Module:
    """Load `checkpoint` into `model` (built under `init_empty_weights`) and dispatch it. `device_map`:
    "auto" or "balanced" (spread evenly over the GPUs, then CPU, then disk), "balanced_low_0", "sequential"
    (fill each device in turn), a dict, or None (load in place, no hooks). The other arguments are
    `load_checkpoint_in_model`'s and `dispatch_model`'s."""
    if isinstance(device_map, str):
        if device_map not in AUTO_MAPS:
            raise ValueError(f"device_map={device_map!r}: expected one of {AUTO_MAPS}, a dict, or None.")
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model, max_memory, no_split_module_classes, dtype, low_zero=device_map == "balanced_low_0"
            )
        device_map = infer_auto_device_map(model, max_memory, no_split_module_classes, dtype)
    load_checkpoint_in_model(
        model,
        checkpoint,
        device_map,
        offload_folder,
        dtype,
        offload_state_dict=bool(offload_state_dict),
        offload_buffers=offload_buffers,
        strict=strict,
    )
    if device_map is None:
        return model
    return dispatch_model(
        model,
        device_map,
        offload_dir=offload_folder,
        offload_buffers=offload_buffers,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        force_hooks=force_hooks,
    )


# --------------------------------------------------------------------------------------------- internals


def _loaders(
    model: nn.Module,
    names: list[str],
    device: Device,
    stored: Mapping[str, StoredTensor],
    offload_buffers: bool,
) -> dict[str, Callable[[], torch.Tensor]]:
    """How to get each offloaded tensor of `names`: from the offload index (tensors left on meta), or its CPU
    copy (modules on "cpu" run by a GPU; buffers only with `offload_buffers`). Tied tensors that are
    resident elsewhere need nothing."""
    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    for name in names:
        tensor = get_module_tensor(model, name)
        if tensor.device.type == "meta":
            if name not in stored:
                raise ValueError(
                    f"{name} is on 'disk' but not in the offload index: load the checkpoint with the same device_map "
                    "and offload_folder (load_checkpoint_in_model) before dispatching."
                )
            loaders[name] = stored[name].read
        elif device == "disk" or (device == "cpu" and (offload_buffers or is_parameter(model, name))):
            loaders[name] = lambda tensor=tensor: tensor  # a resident buffer of a module on "disk" too
    return loaders


def _execution_device(device: Device | torch.device | None) -> Device:
    """Where offloaded modules compute: `device`, else the first GPU, else the CPU."""
    if device is not None:
        return str(device) if isinstance(device, torch.device) else device
    return 0 if torch.cuda.is_available() else "cpu"


def _preloading_modules(model: nn.Module, classes: set[str]) -> list[str]:
    """The names of the modules whose class is one of `classes`, outermost first."""
    return [name for name, module in model.named_modules() if type(module).__name__ in classes]


def _owner(name: str, preloading: list[str]) -> str:
    """The module that loads tensor `name`: the outermost preloading module above it, else its own."""
    for module in preloading:
        if _under(name, module):
            return module
    return name.rpartition(".")[0]


def _attach(
    model: nn.Module,
    module: nn.Module,
    device: torch.device,
    loaders: dict[str, Callable[[], torch.Tensor]],
    skip_keys: str | list[str] | None = None,
) -> None:
    """Before `module` runs: its inputs to `device`, and each tensor in `loaders` loaded there (replacing
    the meta or CPU tensor); after it ran: the replaced tensors back."""
    kept: dict[str, torch.Tensor] = {}

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for name, load in loaders.items():
            kept[name] = get_module_tensor(model, name)
            set_module_tensor(model, name, load().to(device))
        return send_to_device(args, device), send_to_device(kwargs, device, skip_keys=skip_keys)

    def after(mod: nn.Module, args: tuple, output: Any) -> None:
        for name, tensor in kept.items():
            set_module_tensor(model, name, tensor)
        kept.clear()

    module.register_forward_pre_hook(before, with_kwargs=True)
    if loaders:
        module.register_forward_hook(after)


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _placement_key(device_map: Mapping[str, Device], name: str) -> str | None:
    """The longest entry of `device_map` that `name` is under."""
    matches = [key for key in device_map if _under(name, key)]
    return max(matches, key=len) if matches else None


def _placement(device_map: Mapping[str, Device], name: str) -> Device | None:
    key = _placement_key(device_map, name)
    return None if key is None else device_map[key]


def _pieces(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module | None]]:
    """What a module splits into: its own tensors (module None), then its children, in order."""
    join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
    own = [
        (join(n), None)
        for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
    ]
    return [*own, *((join(n), child) for n, child in module.named_children())]


def _largest_unsplittable(model: nn.Module, sizes: Mapping[str, int], no_split: set[str]) -> tuple[str, int]:
    """The biggest piece placement may have to move whole: a leaf module, or one whose class is in
    `no_split`."""
    best = ("", 0)
    queue = _pieces(model, "")
    while queue:
        name, module = queue.pop()
        if module is not None and type(module).__name__ not in no_split and _pieces(module, name):
            queue += _pieces(module, name)
        elif sizes.get(name, 0) > best[1]:
            best = (name, sizes[name])
    return best


def _compact(model: nn.Module, device_map: dict[str, Device]) -> dict[str, Device]:
    """Merge the entries of a module whose pieces all went to the same device into one entry."""

    def visit(name: str, module: nn.Module) -> dict[str, Device]:
        if name in device_map:
            return {name: device_map[name]}
        merged: dict[str, Device] = {}
        for piece, child in _pieces(module, name):
            merged.update(visit(piece, child) if child is not None else {piece: device_map[piece]})
        devices = set(merged.values())
        return {name: devices.pop()} if len(devices) == 1 else merged

    return visit("", model)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(
            f"dtype={dtype!r}: expected a torch dtype name such as 'float32', 'bfloat16', 'float16'."
        )
    return resolved


def _device_key(device: Device, where: str = "max_memory") -> Device:
    """A device as maps name it (GPU index, "cpu", "mps", "disk"), checked to exist here."""
    key: Device = int(device) if isinstance(device, str) and device.isdigit() else device
    if isinstance(device, str) and device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        key = int(index) if index.isdigit() else device
    gpus = torch.cuda.device_count()
    valid = isinstance(key, int) and 0 <= key < gpus
    valid = valid or key in ("cpu", "disk") or (key == "mps" and torch.backends.mps.is_available())
    if not valid:
        here = [*(f"cuda:{i}" for i in range(gpus)), "cpu", "disk"]
        raise ValueError(
            f"{where} names device {device!r}, which this machine does not have. Devices here: {', '.join(here)}."
        )
    return key


def _size(nbytes: int) -> str:
    """Bytes for people, rounded up: `0.3 MiB`, `12.1 GiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{math.ceil(nbytes / scale * 10) / 10:.1f} {unit}"
    return f"{nbytes} B"


def _device_name(device: Device) -> str:
    return f"cuda:{device}" if isinstance(device, int) else device
