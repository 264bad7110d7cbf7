"""Accelerate's layout of a checkpoint, both ways: a "full" checkpoint (every process holds the whole
model) also carries Accelerate's names for its files and Accelerate's RNG and dataloader files, so that
Accelerate's `load_state` reads what `python -m runner` and `Accelerator.save_state` wrote; and a
directory Accelerate's `save_state` wrote loads into runner's registry.

Accelerate's names are a property of the files on disk, not of the API that asked for the save: they are
written whoever saves (the Trainer too), so they live here beside the formats, not in `runner.accelerate`.

Accelerate's files: `model.safetensors` (or `pytorch_model.bin`), `optimizer.bin`, `scheduler.bin` (then
`model_1.safetensors`, `optimizer_1.bin`, ...), `custom_checkpoint_<i>.pkl`, `random_states_<rank>.pkl`,
`scaler.pt`, and torchdata's StatefulDataLoader state of each stateful loader, `dl_state_dict.bin`.
"""

from __future__ import annotations

import codecs
import itertools
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.checkpoint.files import META, load_torch
from runner.checkpoint.formats import load_full, runner_file
from runner.errors import ConfigError

# The kinds of state a checkpoint holds one file of per object, by Accelerate's file prefix.
ACCELERATE_KINDS = ("model", "optimizer", "scheduler", "custom_checkpoint")


def accelerate_file(kind: str, i: int) -> str:
    """Accelerate's file of the `i`-th object of `kind` (`ACCELERATE_KINDS`)."""
    if kind == "custom_checkpoint":
        return f"custom_checkpoint_{i}.pkl"
    suffix = ".safetensors" if kind == "model" else ".bin"
    return f"{kind}{suffix}" if i == 0 else f"{kind}_{i}{suffix}"


def accelerate_path(directory: Path, kind: str, i: int) -> Path:
    """The file of the `i`-th object of `kind` in a directory Accelerate's `save_state` wrote (a model's:
    safetensors, else the torch file it writes with `safe_serialization=False`)."""
    path = directory / accelerate_file(kind, i)
    if kind == "model" and not path.is_file():
        return directory / ("pytorch_model.bin" if i == 0 else f"pytorch_model_{i}.bin")
    return path


def accelerate_dataloader_file(i: int) -> str:
    """Accelerate's file of the `i`-th prepared dataloader's position (its stateful loaders only)."""
    return "dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"


def torchdata_position(batches: int, finished: bool = False) -> dict[str, Any]:
    """The state of torchdata's StatefulDataLoader (one process, no workers, a sampler without state of
    its own) that has handed out `batches` batches of its pass (`finished`: the last one too, as Accelerate
    tags it): what Accelerate's `load_state` resumes."""
    return {
        "_index_sampler_state": None,
        "_sampler_iter_state": None,
        "_sampler_iter_yielded": batches,
        "_num_yielded": batches,
        "_IterableDataset_len_called": None,
        "_shared_seed": None,
        "fetcher_state": None,
        "dataset_state": None,
        "_iterator_finished": finished,
    }


def batches_handed_out(state: dict[str, Any]) -> int:
    """How many batches of its current pass a StatefulDataLoader whose `state_dict()` is `state` had handed
    out (0 once the pass finished: the next starts afresh), without workers or with them; ValueError for
    another format."""
    if state.get("_iterator_finished"):
        return 0
    if "_num_yielded" in state:
        return int(state["_num_yielded"])
    if "_snapshot" in state:
        return int(state["_snapshot"]["_snapshot_step"]) + int(state.get("_steps_since_snapshot", 0))
    raise ValueError(f"not a torchdata StatefulDataLoader state (keys {sorted(state)})")


def accelerate_rng_state(step: int) -> dict[str, Any]:
    """This process's RNG states as Accelerate's `save_state` writes them (`random_states_<i>.pkl`)."""
    states = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def set_accelerate_rng_state(states: dict[str, Any]) -> None:
    """Restore what `accelerate_rng_state` (or Accelerate's `save_state`) saved."""
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def load_accelerate_rng_state(path: Path) -> dict[str, Any]:
    """Read an Accelerate `random_states_<i>.pkl` without unpickling code: torch's weights-only reader,
    also allowing the numpy types that numpy's RNG state is made of (as Accelerate's own reader does)."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)), codecs.encode]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def accelerate_files(
    rank: int, step: int, main: bool, precision_state: dict[str, Any], dataloaders: list[Any]
) -> dict[str, Any]:
    """The files of Accelerate's own a "full" checkpoint adds, by name: this process's RNG states, and on
    the main process the loss scaler and the positions of its stateful loaders (one process's, without
    workers: the state Accelerate's stateful loaders resume from)."""
    files: dict[str, Any] = {f"random_states_{rank}.pkl": accelerate_rng_state(step)}
    if main:
        if "scaler" in precision_state:
            files["scaler.pt"] = precision_state["scaler"]
        files |= {
            accelerate_dataloader_file(i): torchdata_position(loader.batches_yielded, loader.pass_finished)
            for i, loader in enumerate(dataloaders)
            if loader.stateful and not loader.num_workers
        }
    return files


def link_accelerate_names(directory: Path, counts: dict[str, int]) -> dict[str, str]:
    """Give a "full" checkpoint's files Accelerate's names too (`counts`: its `meta.json`'s, the objects of
    each kind), as hard links (a copy where the file system has none); the names given, each to the file
    it names."""
    aliases = {}
    for kind in ACCELERATE_KINDS:
        for i in range(counts[{"model": "models", "optimizer": "optimizers"}.get(kind, kind)]):
            source, alias = directory / runner_file(kind, i), directory / accelerate_file(kind, i)
            if alias != source and source.is_file():
                try:
                    alias.hardlink_to(source)
                except OSError:
                    shutil.copyfile(source, alias)
                aliases[alias.name] = source.name
    return aliases


def is_accelerate_checkpoint(directory: Path) -> bool:
    """Whether `directory` was written by Accelerate's `save_state` (runner's checkpoints have `meta.json`)."""
    return not (directory / META).exists() and any(
        (directory / name).is_file() for name in ("model.safetensors", "pytorch_model.bin", "optimizer.bin")
    )


def accelerate_counts(directory: Path) -> dict[str, int]:
    """How many objects of each kind Accelerate's `save_state` wrote into `directory`."""
    return {
        kind: next(i for i in itertools.count() if not accelerate_path(directory, kind, i).is_file())
        for kind in ACCELERATE_KINDS
    }


def load_accelerate_checkpoint(
    directory: Path,
    modules: list[torch.nn.Module],
    of_kind: Callable[[str], list[Any]],
    precision: Any,
    rank: int,
    num_processes: int,
) -> int:
    """Restore what Accelerate's `save_state` wrote into `directory` (the models, unwrapped, into
    `modules`; the other objects of the registry by kind, `of_kind`; the loss scale; this process's RNG
    states; the positions of its stateful loaders, which runner's stateful loaders resume, their order drawn
    afresh as Accelerate's is); the step it recorded."""
    optimizers = [opt.optimizer for opt in of_kind("optimizer")]
    counts = {"model": len(modules), "optimizer": len(optimizers)}
    counts |= {kind: len(of_kind(kind)) for kind in ACCELERATE_KINDS[2:]}
    if (found := accelerate_counts(directory)) != counts:
        raise ConfigError(
            f"{directory} (written by Accelerate) holds {found}, but this Accelerator has {counts} prepared/"
            "registered: prepare and register the same objects, in the same order, as the run that saved it."
        )
    rng_file = directory / f"random_states_{rank}.pkl"
    if not rng_file.is_file():
        raise ConfigError(
            f"{directory} (written by Accelerate) has no {rng_file.name}: fewer processes than this run's "
            f"{num_processes} saved it. Load it with as many processes as saved it."
        )
    rng_states = load_accelerate_rng_state(rng_file)
    load_full(directory, modules, optimizers, path=lambda kind, i: accelerate_path(directory, kind, i))
    for kind in ("scheduler", "custom_checkpoint"):
        for i, obj in enumerate(of_kind(kind)):
            obj.load_state_dict(load_torch(directory / accelerate_file(kind, i)))
    if (scaler := directory / "scaler.pt").is_file() and "scaler" in precision.state_dict():
        precision.load_state_dict({"scaler": load_torch(scaler)})
    set_accelerate_rng_state(rng_states)
    for i, loader in enumerate(of_kind("dataloader")):  # as Accelerate: its stateful loaders only
        position = directory / accelerate_dataloader_file(i)
        if loader.stateful and position.is_file():
            try:
                saved = load_torch(position)
                loader.resume_at(batches_handed_out(saved), finished=bool(saved.get("_iterator_finished")))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ConfigError(f"{position} (written by Accelerate): {err}.") from None
    return int(rng_states.get("step", 0))
