"""Random number generators: seeding every one of them, and their states (saved with each checkpoint)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

import numpy as np
import torch

from runner.cluster import launched_environment


class RNGType(str, Enum):
    """The RNGs `Accelerator(rng_types=...)` synchronises across processes (Accelerate's names; those of
    devices runner does not drive are not here)."""

    TORCH = "torch"
    CUDA = "cuda"
    GENERATOR = "generator"


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all devices), as Accelerate's `set_seed`: `device_specific` adds this
    process's rank to the seed (each rank draws differently); `deterministic` also asks torch for
    deterministic kernels."""
    if device_specific:
        env = launched_environment()
        seed += env.rank if env is not None else 0
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def rng_state(devices: bool = True) -> dict[str, Any]:
    """This process's python, numpy, torch (and, with `devices`, CUDA's) RNG states, as types
    `torch.load(weights_only=True)` reads back."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached": cached,
        },
        "torch": torch.get_rng_state(),
    }
    if devices and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@contextmanager
def rng_kept() -> Iterator[None]:
    """Inside: draw from every RNG (python, numpy, torch, CUDA) freely; after: each as it was before."""
    before = rng_state()
    try:
        yield
    finally:
        set_rng_state(before)


@contextmanager
def seeded(seed: int) -> Iterator[dict[str, Any]]:
    """Inside: every RNG seeded with `seed` (`set_seed`), as a rank seeds them before it reads its data;
    after: python's, numpy's and torch's as they were, and the yielded dict holding their states as the
    block left them (`set_rng_state` goes on from there). No device's state is read (`rng_kept` does):
    before launch, CUDA stays uninitialised for the ranks forked from this process."""
    before, left = rng_state(devices=False), {}
    set_seed(seed)
    try:
        yield left
    finally:
        left.update(rng_state(devices=False))
        set_rng_state(before)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    """`random.setstate` wants tuples where a round trip may give lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
