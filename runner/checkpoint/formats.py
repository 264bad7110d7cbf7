"""How a checkpoint stores models and optimizers, by `Strategy.checkpoint_format`:

- "full": every process holds the whole model, so the main process writes `model_<i>.safetensors` and
  `optimizer_<i>.pt`;
- "sharded": every rank writes its own shards with torch.distributed.checkpoint (DCP), `model_<i>/` and
  `optimizer_<i>/`, keyed by parameter name, so that they load onto any layout of the same model;
- "deepspeed": DeepSpeed's engine writes its own partitions (in its strategy's hook).

A "full" checkpoint also has Accelerate's names for its files (`runner.checkpoint.accelerate_layout`).

`trained_only` (runner's loop; Accelerate's `save_state` writes whole models): a checkpoint leaves out
the frozen parameters (a PEFT model's base), which the run builds again from its config, and a load
keeps the values they were built with.

A strategy names its format (`Strategy.checkpoint_format`) and hands over what only it knows (the full
weights of a model, the module inside its wrapper); `format_of` gives the Checkpointer the object that
writes and reads that format (`CheckpointFormat`): every format's writing is here, DeepSpeed's engine
excepted, which writes its own partitions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from runner.checkpoint.files import load_torch, save_torch
from runner.checkpoint.weights import (
    checkpoint_tensors,
    distinct_tensors,
    load_weights,
    read_weights,
    without_frozen,
)
from runner.hardware import Strategy
from runner.hardware.deepspeed import DeepSpeed
from runner.ops import host_copy, send_to_device


class CheckpointFormat(Protocol):
    """How the models' and optimizers' states of a checkpoint are written and read: `save` writes them
    now; `stage` copies them into host memory now and returns what writes the copy (in a background
    thread, its collectives over `group`); `load` reads them into the prepared models and optimizers.
    `accelerate_readable`: whole models in one process's files, which Accelerate's `load_state` reads
    (`runner.checkpoint.accelerate_layout` adds its names) and runner's loads from Accelerate's."""

    accelerate_readable: bool

    def save(
        self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], main: bool
    ) -> None: ...

    def stage(
        self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], main: bool, group: Any
    ) -> Callable[[], None]: ...

    def load(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any]) -> None: ...


class Full:
    """The "full" format: every process holds the whole model, so the main process writes the weights
    (`strategy.full_state_dict`, distinct tensors) and the optimizers' states (off the device: loading
    moves them back to the parameters')."""

    accelerate_readable = True

    def __init__(self, strategy: Strategy, trained_only: bool = False) -> None:
        self.strategy = strategy
        self.trained_only = trained_only

    def weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of `model`'s weights (on the main process)."""
        weights = distinct_tensors(self.strategy.full_state_dict(model))
        return without_frozen(self.strategy.unwrap_module(model), weights) if self.trained_only else weights

    def save(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], main: bool) -> None:
        if main:
            weights = [self.weights(model) for model in models]
            states = [send_to_device(optimizer.state_dict(), torch.device("cpu")) for optimizer in optimizers]
            write_full(directory, weights, states)

    def stage(
        self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], main: bool, group: Any
    ) -> Callable[[], None]:
        if not main:
            return _nothing
        weights = [host_copy(self.weights(model)) for model in models]
        states = [host_copy(optimizer.state_dict()) for optimizer in optimizers]
        return functools.partial(write_full, directory, weights, states)

    def load(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any]) -> None:
        modules = [self.strategy.unwrap_module(model) for model in models]
        load_full(directory, modules, optimizers, frozen_optional=self.trained_only)


class Sharded:
    """The "sharded" format: every rank writes its own shards of the DTensor states with DCP, which loads
    them onto any layout of the same model."""

    accelerate_readable = False

    def __init__(self, strategy: Strategy, trained_only: bool = False) -> None:
        self.strategy = strategy
        self.trained_only = trained_only

    def save(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], main: bool) -> None:
        write_sharded(sharded_state_dicts(directory, models, optimizers, self.trained_only))

    def stage(
        self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], main: bool, group: Any
    ) -> Callable[[], None]:
        """Each rank's shards copied to host memory now, written with DCP over `group` later. (Not DCP's
        `async_save`: two of them, model and optimizer, run their collectives at once in two threads, in
        an order that can differ between ranks.)"""
        written = sharded_state_dicts(directory, models, optimizers, self.trained_only)
        states = [(host_copy(state), path) for state, path in written]
        return functools.partial(write_sharded, states, group)

    def load(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any]) -> None:
        load_sharded(directory, models, optimizers, self.trained_only)


class EngineOwned:
    """A format the strategy's engine writes and reads itself (DeepSpeed's partitions, every rank its
    own): the strategy's `save_checkpoint(directory)` and `load_checkpoint(directory)`; not staged."""

    accelerate_readable = False

    def __init__(self, strategy: Any, trained_only: bool = False) -> None:
        self.strategy = strategy
        self.trained_only = trained_only

    def save(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], main: bool) -> None:
        self.strategy.save_checkpoint(directory, self.trained_only)

    def stage(
        self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any], main: bool, group: Any
    ) -> Callable[[], None]:
        raise NotImplementedError(
            f"{type(self.strategy).__name__} writes its checkpoints itself, synchronously"
        )

    def load(self, directory: Path, models: list[torch.nn.Module], optimizers: list[Any]) -> None:
        self.strategy.load_checkpoint(directory, self.trained_only)


# `Strategy.checkpoint_format` -> what writes and reads it
FORMATS: dict[str, type[Full] | type[Sharded] | type[EngineOwned]] = {
    "full": Full,
    "sharded": Sharded,
    "deepspeed": EngineOwned,
}


def format_of(strategy: Strategy, trained_only: bool = False) -> CheckpointFormat:
    """The format `strategy`'s checkpoints are written in (`Strategy.checkpoint_format`); `trained_only`:
    without the models' frozen parameters."""
    return FORMATS[strategy.checkpoint_format](strategy, trained_only)


def _nothing() -> None:
    pass


def write_full(
    directory: Path, weights: list[dict[str, torch.Tensor]], optimizer_states: list[dict[str, Any]]
) -> None:
    """The "full" format: each model's weights (distinct tensors) and each optimizer's state."""
    for i, model_weights in enumerate(weights):
        save_file(model_weights, directory / runner_file("model", i))
    for i, state in enumerate(optimizer_states):
        save_torch(state, directory / runner_file("optimizer", i))


def load_full(
    directory: Path,
    modules: list[torch.nn.Module],
    optimizers: list[Any],
    path: Callable[[str, int], Path] | None = None,
    frozen_optional: bool = False,
) -> None:
    """Load what `write_full` wrote into the (unwrapped) models and the optimizers; `path(kind, i)`: the
    file of the `i`-th "model" or "optimizer" where another layout wrote them (Accelerate's);
    `frozen_optional`: frozen parameters may be left out (they keep their values)."""
    path = path or (lambda kind, i: directory / runner_file(kind, i))
    for i, module in enumerate(modules):
        load_weights(module, path("model", i), frozen_optional=frozen_optional)
    for i, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(load_torch(path("optimizer", i)))


def runner_file(kind: str, i: int) -> str:
    """runner's file of the `i`-th object of `kind` ("model", "optimizer", or a `Checkpointer` part)."""
    return f"model_{i}.safetensors" if kind == "model" else f"{kind}_{i}.pt"


def sharded_state_dicts(
    directory: Path, models: list[torch.nn.Module], optimizers: list[Any], trained_only: bool = False
) -> list[tuple[dict[str, Any], Path]]:
    """What the "sharded" format writes: each model's and optimizer's state dict (this rank's shards) and
    its DCP directory. Each optimizer belongs to the model of its index (the last model for any beyond)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _model_options(trained_only)
    states = [
        ({"model": get_model_state_dict(model, options=options)}, directory / f"model_{i}")
        for i, model in enumerate(models)
    ]
    for i, optimizer in enumerate(optimizers):
        model = models[min(i, len(models) - 1)]
        state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=_by_parameter_name())}
        states.append((state, directory / f"optimizer_{i}"))
    return states


def write_sharded(states: list[tuple[dict[str, Any], Path]], group: Any = None) -> None:
    """DCP-save each state into its directory, one after the other (each save's collectives in order),
    over `group` (None: the default group)."""
    import torch.distributed.checkpoint as dcp

    for state, path in states:
        dcp.save(state, checkpoint_id=path, process_group=group)


def load_sharded(
    directory: Path, models: list[torch.nn.Module], optimizers: list[Any], trained_only: bool = False
) -> None:
    """Load what `write_sharded` wrote into the (sharded) models and optimizers: DCP reshards it onto
    this run's layout; `trained_only`: the models' frozen parameters are not read (they keep their values)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = _model_options(trained_only)
    for i, model in enumerate(models):
        state = {"model": get_model_state_dict(model, options=options)}
        dcp.load(state, checkpoint_id=directory / f"model_{i}")
        set_model_state_dict(model, state["model"], options=options)
    for i, optimizer in enumerate(optimizers):
        model = models[min(i, len(models) - 1)]
        path = directory / f"optimizer_{i}"
        written = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        # Sharded checkpoints written before the state was keyed by parameter name: param groups by index.
        options = None if "optimizer.param_groups.0.params" in written else _by_parameter_name()
        state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def model_shapes(
    directory: Path, checkpoint_format: str, index: int = 0
) -> dict[str, tuple[int, ...]] | None:
    """The shape of each tensor of the `index`-th model in a checkpoint, from its headers (nothing loaded);
    None where there is no such file to read (an Accelerate-written checkpoint, DeepSpeed's partitions)."""
    if checkpoint_format == "full" and (directory / runner_file("model", index)).is_file():
        return {
            name: tuple(t.shape)
            for name, t in checkpoint_tensors(directory / runner_file("model", index)).items()
        }
    if checkpoint_format == "sharded" and (directory / f"model_{index}").is_dir():
        import torch.distributed.checkpoint as dcp

        written = dcp.FileSystemReader(directory / f"model_{index}").read_metadata().state_dict_metadata
        return {
            name.removeprefix("model."): tuple(entry.size)
            for name, entry in written.items()
            if hasattr(entry, "size")  # tensors, not the bytes of other objects
        }
    return None


def model_weights(directory: Path, checkpoint_format: str, index: int = 0) -> dict[str, torch.Tensor]:
    """The whole weights of the `index`-th model of a checkpoint in `checkpoint_format`, read in this
    process without a process group (to export or inspect it): a "full" checkpoint's file, DCP's shards
    assembled, DeepSpeed's partitions assembled (its fp32 master weights; its engine holds one model)."""
    return WEIGHT_READERS[checkpoint_format](directory, index)


def _full_weights(directory: Path, index: int) -> dict[str, torch.Tensor]:
    return read_weights(directory / runner_file("model", index))


def _sharded_weights(directory: Path, index: int) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    path = directory / f"model_{index}"
    written = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {
        name: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for name, entry in written.items()
        if hasattr(entry, "size")  # tensors, not the bytes of other objects
    }
    dcp.load(state, checkpoint_id=path)  # no process group: this process reads every shard
    return {name.removeprefix("model."): tensor for name, tensor in state.items()}


WEIGHT_READERS: dict[str, Callable[[Path, int], dict[str, torch.Tensor]]] = {
    "full": _full_weights,
    "sharded": _sharded_weights,
    "deepspeed": lambda directory, index: DeepSpeed.checkpoint_weights(directory),
}


def _model_options(trained_only: bool) -> Any:
    """DCP's options for a model's state: without its frozen parameters where `trained_only` (and then
    loaded without them: `strict` would ask for every key)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trained_only, strict=not trained_only)


def _by_parameter_name() -> Any:
    """Optimizer state and param groups keyed by parameter name (torchtitan's choice): ranks that hold
    different parameters (pipeline stages) write distinct keys, which any layout reads back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
