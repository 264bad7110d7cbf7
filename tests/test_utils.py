"""Accelerate's `accelerate.utils` and `accelerate.logging` names under `runner.utils` and
`runner.logging`: what a script imports on its first lines, with Accelerate's signatures and semantics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import rank_checks
import torch

from runner import Accelerator
from runner.errors import ConfigError
from runner.hardware import DDP, FSDP, SingleDevice
from runner.hardware.deepspeed import DeepSpeed
from runner.hardware.tensor_parallel import TensorParallel
from runner.utils import (
    DistributedType,
    PrecisionType,
    RNGType,
    concatenate,
    extract_model_from_parallel,
    find_batch_size,
    find_executable_batch_size,
    is_mlflow_available,
    is_torch_xla_available,
    patch_environment,
    recursively_apply,
    release_memory,
    send_to_device,
)


def test_find_executable_batch_size_takes_90_percent_after_each_out_of_memory_error():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int, lr: float) -> tuple[int, float]:
        tried.append(batch_size)
        if batch_size > 16:  # an injected out-of-memory error, as CUDA raises it
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size, lr

    assert train(lr=0.1) == (15, 0.1)
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19, 17, 15]

    halved = []

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: halved[-1] // 2)
    def with_own_step(batch_size: int) -> int:
        halved.append(batch_size)
        if batch_size > 16:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    assert with_own_step() == 16 and halved == [64, 32, 16]

    @find_executable_batch_size(starting_batch_size=4)
    def on_cpu(batch_size: int) -> None:  # the CPU allocator's error is a RuntimeError
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        on_cpu()

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size: int) -> None:
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError, match="not a memory problem"):  # not retried
        broken()

    @find_executable_batch_size
    def passed_twice(batch_size: int) -> int:
        return batch_size

    with pytest.raises(TypeError, match="Batch size was passed into `passed_twice`"):
        passed_twice(64)
    assert passed_twice() == 128


def test_release_memory_patch_environment_and_the_nested_tensor_helpers():
    a, b = torch.ones(3), [torch.ones(2)]
    a, b = release_memory(a, b)
    assert a is None and b is None

    os.environ.pop("RUNNER_TEST_VALUE", None)
    with patch_environment(runner_test_value=3):
        assert os.environ["RUNNER_TEST_VALUE"] == "3"
    assert "RUNNER_TEST_VALUE" not in os.environ

    batches = [
        {"x": torch.zeros(2, 3), "y": (torch.ones(2),)},
        {"x": torch.ones(1, 3), "y": (torch.zeros(1),)},
    ]
    joined = concatenate(batches)
    assert joined["x"].shape == (3, 3) and joined["y"][0].tolist() == [1, 1, 0]
    assert find_batch_size(batches[0]) == 2 and find_batch_size({"n": 1}) is None
    doubled = recursively_apply(lambda t, k: t * k, {"a": [torch.ones(2)], "b": "text"}, 2)
    assert doubled["a"][0].tolist() == [2, 2] and doubled["b"] == "text"
    with pytest.raises(TypeError):
        recursively_apply(lambda t: t, {"b": "text"}, error_on_other_type=True)
    moved = send_to_device({"a": torch.ones(1), "b": torch.ones(1)}, "meta", skip_keys="b")
    assert moved["a"].device.type == "meta" and moved["b"].device.type == "cpu"


def test_extract_model_from_parallel_unwraps_compile_and_the_autocast_forward():
    model = torch.nn.Linear(2, 2)
    accelerator = Accelerator(strategy=SingleDevice("cpu"), mixed_precision="bf16")
    prepared = accelerator.prepare(model)
    compiled = torch.compile(prepared)  # a wrapper; nothing is compiled until it is called
    assert extract_model_from_parallel(compiled) is compiled
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    assert "_original_forward" in model.__dict__
    extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "_original_forward" not in model.__dict__ and model.forward.__func__ is torch.nn.Linear.forward


def test_a_model_compiled_by_the_user_prepares_and_trains_like_the_eager_one():
    """`prepare(torch.compile(model), optimizer)`, as Accelerate's examples write it (the compiled wrapper
    has no truth value: preparing it raised a TypeError)."""
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        accelerator = Accelerator(strategy=SingleDevice("cpu"))
        wrapped = torch.compile(model, backend="eager") if compiled else model
        prepared, optimizer = accelerator.prepare(wrapped, optimizer)
        assert prepared is wrapped
        inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        losses[compiled] = []
        for _ in range(3):
            loss = prepared(inputs).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[compiled].append(loss.item())
    assert losses[True] == losses[False] and losses[True][0] > losses[True][-1]


def test_each_strategy_reports_its_distributed_type():
    assert Accelerator(strategy=SingleDevice("cpu")).distributed_type == DistributedType.NO == "NO"
    types = {
        DDP(device="cpu"): DistributedType.MULTI_CPU,
        FSDP(device="cpu"): DistributedType.FSDP,
        DeepSpeed(device="cpu"): DistributedType.DEEPSPEED,
        TensorParallel(device="cpu"): DistributedType.MEGATRON_LM,
    }
    for strategy, expected in types.items():
        assert strategy.distributed_type == expected, type(strategy).__name__
    bf16 = Accelerator(strategy=SingleDevice("cpu"), mixed_precision=PrecisionType.BF16)
    assert bf16.mixed_precision == PrecisionType.BF16 == "bf16"
    with pytest.raises(ConfigError, match="precision=fp8 needs an NVIDIA GPU"):  # Accelerate's "fp8" name
        Accelerator(strategy=SingleDevice("cpu"), mixed_precision="fp8")
    accelerator = Accelerator(strategy=SingleDevice("cpu"), rng_types=[RNGType.TORCH, "generator"])
    assert accelerator.rng_types == ["torch", "generator"]
    assert is_mlflow_available() and not is_torch_xla_available()


@pytest.mark.slow
def test_get_logger_logs_on_the_main_process_every_process_or_in_rank_order(tmp_path: Path):
    shared = tmp_path / "shared.log"
    rank_checks.run_ranks(rank_checks.multiprocess_logging, str(shared))
    lines = shared.read_text().splitlines()
    assert lines.count("main only 0") == 1 and "main only 1" not in lines
    assert sorted(line for line in lines if line.startswith("every")) == ["every 0", "every 1"]
    assert [line for line in lines if line.startswith("in order")] == ["in order 0", "in order 1"]
