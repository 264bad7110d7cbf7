"""Accelerate's configuration objects and the rest of its API, in this process (one CPU process): each
setting changes what it is meant to change. Several processes: tests/test_accelerate_compat.py."""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from runner import Accelerator, PartialState
from runner.accelerate.handlers import apply_handlers
from runner.accelerate.launch import accelerate_launch_settings
from runner.config import CompileConfig, CompileScope
from runner.engine.collectives import split_between_processes
from runner.engine.data_loader import DataLoaderShard, shard_dataloader
from runner.errors import ConfigError
from runner.hardware import DDP, FSDP, DeepSpeed
from runner.precision import Precision
from runner.state import GradientState
from runner.trackers import GeneralTracker, LoggerType, MLflowTracker, TensorBoardTracker
from runner.utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DummyOptim,
    DummyScheduler,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ParallelismConfig,
    ProfileKwargs,
    TorchContextParallelConfig,
    TorchDynamoPlugin,
    gather,
    is_schedulefree_available,
    patch_environment,
    reduce,
    wait_for_everyone,
    write_basic_config,
)


@pytest.fixture
def accelerator_made():
    """Accelerators made in a test, ended after it (their process group, their trackers)."""
    made: list[Accelerator] = []

    def make(**kwargs) -> Accelerator:
        made.append(Accelerator(**kwargs))
        return made[-1]

    yield make
    for accelerator in made:
        accelerator.end_training()


def loader(samples: int = 12, batch_size: int = 2, shuffle: bool = False) -> DataLoader:
    data = TensorDataset(torch.arange(samples, dtype=torch.float32)[:, None])
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle)


# ------------------------------------------------------------------------------------- kwargs handlers
def test_grad_scaler_kwargs_set_the_fp16_loss_scale(accelerator_made):
    default = accelerator_made(cpu=True, mixed_precision="fp16")
    assert default.precision.scaler.get_scale() == 65536.0
    scaled = accelerator_made(
        cpu=True,
        mixed_precision="fp16",
        kwargs_handlers=[GradScalerKwargs(init_scale=1024.0, growth_interval=7)],
    )
    assert (
        scaled.precision.scaler.get_scale() == 1024.0 and scaled.precision.scaler.get_growth_interval() == 7
    )


def test_autocast_kwargs_turn_autocast_off(accelerator_made):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    bf16 = accelerator_made(cpu=True, mixed_precision="bf16")
    with bf16.autocast():
        assert (a @ b).dtype == torch.bfloat16
    with bf16.autocast(AutocastKwargs(enabled=False)):  # a handler for one block
        assert (a @ b).dtype == torch.float32
    off = accelerator_made(cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    model = off.prepare(torch.nn.Linear(4, 4))
    seen = []
    model.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    model(a)
    assert seen == [torch.float32]  # the prepared model's autocast forward follows the handler


def test_ddp_and_process_group_kwargs_reach_ddp(accelerator_made):
    accelerator = accelerator_made(
        strategy=DDP(device="cpu", num_processes=1),
        kwargs_handlers=[
            DistributedDataParallelKwargs(
                find_unused_parameters=True, broadcast_buffers=False, bucket_cap_mb=1
            ),
            InitProcessGroupKwargs(timeout=timedelta(seconds=42)),
        ],
    )
    model = accelerator.prepare(torch.nn.Linear(3, 3))
    assert model.find_unused_parameters and not model.broadcast_buffers
    assert model.bucket_bytes_cap == 1024 * 1024
    assert accelerator.strategy.timeout == timedelta(seconds=42) and accelerator.strategy.backend == "gloo"


def test_the_ddp_settings_of_hardware_multi_gpu_reach_ddp(accelerator_made):
    """hardware=ddp's DDP settings (its YAML's names) on torch's DistributedDataParallel, each
    against torch's default (static_graph apart: with it, DDP finds unused parameters itself)."""
    cases = {
        (): (False, 25, False, False),
        (("find_unused_parameters", True), ("bucket_cap_mb", 2), ("gradient_as_bucket_view", True)): (
            True, 2, True, False,
        ),
        (("static_graph", True),): (False, 25, False, True),
    }  # fmt: skip
    for settings, expected in cases.items():
        strategy = DDP(device="cpu", num_processes=1, **dict(settings))
        model = accelerator_made(strategy=strategy).prepare(torch.nn.Linear(3, 3))
        seen = (model.find_unused_parameters, model.bucket_bytes_cap / 2**20, model.gradient_as_bucket_view)
        assert (*seen, model.static_graph) == expected


class Block(torch.nn.Module):
    """A unit that `hardware.shard_modules=[Block]` shards."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_reshard_after_forward_shards_each_unit_again_or_keeps_it_gathered_for_backward(accelerator_made):
    """hardware.reshard_after_forward (fsdp): after a unit's forward its parameters are its shards again
    (true, the default: memory freed, gathered again for backward) or stay whole until backward (false)."""
    for reshard, kind in ((True, "DTensor"), (False, "Parameter")):
        strategy = FSDP(device="cpu", num_processes=1, shard_modules=["Block"], reshard_after_forward=reshard)
        model = accelerator_made(strategy=strategy).prepare(torch.nn.Sequential(Block(), Block()))
        model(torch.ones(2, 4))
        assert [type(block.fc.weight).__name__ for block in model] == [kind, kind]


def test_handlers_are_refused_where_they_configure_nothing_or_twice(accelerator_made):
    with pytest.raises(ConfigError, match="DistributedDataParallelKwargs configures what FSDP"):
        apply_handlers([DistributedDataParallelKwargs()], FSDP(device="cpu", num_processes=1), Precision())
    with pytest.raises(ValueError, match="one GradScalerKwargs"):
        accelerator_made(cpu=True, kwargs_handlers=[GradScalerKwargs(), GradScalerKwargs()])
    with pytest.raises(ValueError, match="is not one of"):
        accelerator_made(cpu=True, kwargs_handlers=[{"find_unused_parameters": True}])
    # A one-process job has no process group and no DDP: Accelerate's scripts pass them anyway.
    accelerator_made(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(), InitProcessGroupKwargs()])


def test_profile_kwargs_of_the_accelerator_are_used_by_profile(accelerator_made, tmp_path):
    accelerator = accelerator_made(
        cpu=True, kwargs_handlers=[ProfileKwargs(record_shapes=True, output_trace_dir=str(tmp_path))]
    )
    with accelerator.profile() as profiler:
        torch.randn(8, 8) @ torch.randn(8, 8)
    assert any(event.input_shapes for event in profiler.key_averages(group_by_input_shape=True))
    assert json.loads((tmp_path / "profile_0.json").read_text())["traceEvents"]


# -------------------------------------------------------------------------- dataloaders and accumulation
def test_dataloader_configuration_data_seed_decides_the_shuffle(accelerator_made):
    def order(seed: int) -> list[float]:
        accelerator = accelerator_made(cpu=True, dataloader_config=DataLoaderConfiguration(data_seed=seed))
        return [batch[0].flatten().tolist() for batch in accelerator.prepare(loader(shuffle=True))]

    assert order(3) == order(3) != order(4)


@pytest.mark.parametrize("stateful", [False, True])
def test_a_stateful_loader_resumes_its_pass_by_itself_after_load_state(accelerator_made, tmp_path, stateful):
    """As torchdata's StatefulDataLoader under Accelerate: with `use_stateful_dataloader=True` the loaded
    loader continues after the batches it had handed out; without, it starts over (the script skips)."""
    config = DataLoaderConfiguration(use_stateful_dataloader=stateful)

    def prepared() -> tuple[Accelerator, DataLoaderShard]:
        torch.manual_seed(0)
        accelerator = accelerator_made(cpu=True, dataloader_config=config)
        return accelerator, accelerator.prepare(
            DataLoader(TensorDataset(torch.arange(12.0)), batch_size=2, shuffle=True)
        )

    accelerator, loader = prepared()
    order = []
    for batch in loader:
        order.append(batch[0].tolist())
        if len(order) == 3:
            accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator, loader = prepared()
    accelerator.load_state(str(tmp_path / "ckpt"))
    resumed = [batch[0].tolist() for batch in loader]
    assert resumed == order[3:] if stateful else len(resumed) == 6


def test_dataloader_configuration_is_what_the_accelerator_uses(accelerator_made):
    accelerator = accelerator_made(
        cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True)
    )
    assert accelerator.split_batches and accelerator.non_blocking and accelerator.even_batches
    assert (
        not accelerator.dispatch_batches and not accelerator.use_stateful_dataloader
    )  # Accelerate's default
    assert accelerator.data_parallel_rank == 0 and accelerator.should_save_model and not accelerator.is_fsdp2
    with pytest.raises(ValueError, match=r"dispatch_batches=True\) is not supported"):
        DataLoaderConfiguration(dispatch_batches=True)


def accumulation_run(accelerator: Accelerator, batches: int = 5) -> tuple[list[bool], int]:
    """The `sync_gradients` of each batch of one pass, and the scheduler's step count after it."""
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, scheduler, data = accelerator.prepare(model, optimizer, scheduler, loader(batches, 1))
    syncs = []
    for (x,) in data:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            syncs.append(accelerator.sync_gradients)
    return syncs, scheduler.scheduler._step_count


def test_gradient_accumulation_plugin(accelerator_made):
    plugin = accelerator_made(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert plugin.gradient_accumulation_steps == 2
    # the last batch completes a step; micro-steps are counted on the scheduler (adjust_scheduler)
    assert accumulation_run(plugin) == ([False, True, False, True, True], 1 + 5)
    unadjusted = GradientAccumulationPlugin(num_steps=2, adjust_scheduler=False, sync_with_dataloader=False)
    accelerator = accelerator_made(cpu=True, gradient_accumulation_plugin=unadjusted)
    assert accumulation_run(accelerator) == ([False, True, False, True, False], 1 + 2)
    with pytest.raises(ValueError, match="not both"):
        accelerator_made(cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin=plugin_of(2))


def plugin_of(steps: int) -> GradientAccumulationPlugin:
    return GradientAccumulationPlugin(num_steps=steps)


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_sync_each_batch_keeps_gradient_sync_on_every_micro_batch(accelerator_made, sync_each_batch):
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    accelerator = accelerator_made(
        strategy=DDP(device="cpu", num_processes=1), gradient_accumulation_plugin=plugin
    )
    model = accelerator.prepare(torch.nn.Linear(1, 1))
    syncing = []
    for _ in range(2):
        with accelerator.accumulate(model):
            syncing.append(model.require_backward_grad_sync)  # False inside DDP's no_sync
    assert syncing == [sync_each_batch, True]


def test_dynamo_backend_and_plugin_compile_the_prepared_model(accelerator_made):
    """Accelerate's `dynamo_backend` and `TorchDynamoPlugin` ask for runner's `compile`: the prepared model
    runs compiled (here with the eager backend, which needs no C++ compiler) and computes what it did."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    inputs = torch.randn(5, 3)
    expected = model(inputs)
    accelerator = accelerator_made(cpu=True, dynamo_backend=DynamoBackend.EAGER)
    assert accelerator.strategy.compile_config == CompileConfig(scope=CompileScope.model, backend="eager")
    prepared = accelerator.prepare(model)
    assert prepared._compiled_call_impl is not None
    torch.testing.assert_close(prepared(inputs), expected, rtol=0, atol=0)
    plugin = TorchDynamoPlugin(
        backend="inductor",
        mode="max-autotune-no-cudagraphs",
        fullgraph=True,
        dynamic=False,
        use_regional_compilation=True,
    )
    assert accelerator_made(cpu=True, dynamo_plugin=plugin).strategy.compile_config == CompileConfig(
        scope=CompileScope.regional,
        backend="inductor",
        mode="max-autotune-no-cudagraphs",
        fullgraph=True,
        dynamic=False,
    )
    options = TorchDynamoPlugin(backend="inductor", options={"max_autotune": True})
    assert accelerator_made(cpu=True, dynamo_plugin=options).strategy.compile_config.options == {
        "max_autotune": True
    }
    for off in (TorchDynamoPlugin(backend="no"), TorchDynamoPlugin(backend="inductor", disable=True)):
        assert (
            accelerator_made(cpu=True, dynamo_plugin=off).strategy.compile_config.scope == CompileScope.none
        )
    with pytest.raises(ValueError, match="dynamo_backend or dynamo_plugin, not both"):
        Accelerator(cpu=True, dynamo_backend="eager", dynamo_plugin=plugin)
    with pytest.raises(ValueError, match="compile or dynamo_backend"):
        Accelerator(cpu=True, dynamo_backend="eager", compile=CompileConfig(scope=CompileScope.model))
    with pytest.raises(ValueError, match=r"TorchDynamoPlugin\(backend='turbo'\): expected one of no, eager"):
        TorchDynamoPlugin(backend="turbo")


def test_megatron_lm_plugin_is_refused_with_runners_equivalent():
    with pytest.raises(ValueError, match=r"megatron_lm_plugin is not supported.*TensorParallel\(tp_size="):
        Accelerator(cpu=True, megatron_lm_plugin=object())


def test_join_uneven_inputs_switches_even_batches_inside():
    shard = DataLoaderShard(shard_dataloader(loader(10, 2), 2, 1), GradientState())  # 5 batches, rank 1
    assert shard.even_batches and len(shard) == 3  # its third batch is padding
    with shard.even_batches_set_to(False):
        assert not shard.even_batches and len(shard) == 2
    assert len(shard) == 3


# ------------------------------------------------------------------------------------ launch variables
def test_accelerate_launch_variables_are_applied_or_refused(accelerator_made):
    with patch_environment(accelerate_gradient_accumulation_steps="4", accelerate_mixed_precision="bf16"):
        accelerator = accelerator_made(cpu=True)
    assert accelerator.gradient_accumulation_steps == 4 and accelerator.mixed_precision == "bf16"
    with patch_environment(accelerate_dynamo_backend="EAGER", accelerate_dynamo_use_fullgraph="true"):
        compiled = accelerator_made(cpu=True)
    assert compiled.strategy.compile_config.scope.value == "model"
    assert compiled.strategy.compile_config.backend == "eager" and compiled.strategy.compile_config.fullgraph
    with (
        patch_environment(accelerate_use_megatron_lm="true"),
        pytest.raises(ValueError, match="ACCELERATE_USE_MEGATRON_LM=true"),
    ):
        accelerator_made(cpu=True)
    fsdp_launch = {  # what `accelerate launch --use_fsdp --fsdp_version 2 ...` sets
        "accelerate_use_fsdp": "true",
        "fsdp_version": "2",
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_reshard_after_forward": "false",
        "fsdp_offload_params": "false",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_cls_to_wrap": "Block",
        "fsdp_cpu_ram_efficient_loading": "true",
        "fsdp_activation_checkpointing": "true",
    }
    with patch_environment(**fsdp_launch):
        sharded = accelerator_made(cpu=True)
    assert isinstance(sharded.strategy, FSDP) and sharded.strategy.shard_modules == ["Block"]
    assert not sharded.strategy.reshard_after_forward
    assert sharded.strategy.activation_checkpointing.mode.value == "full"


# ---------------------------------------------------------------------------------------------- trackers
def test_tensorboard_tracker_writes_what_is_logged(accelerator_made, tmp_path):
    accelerator = accelerator_made(cpu=True, log_with=LoggerType.TENSORBOARD, project_dir=str(tmp_path))
    accelerator.init_trackers("project", config={"lr": 0.1, "model": {"layers": 2}})
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1), "phase": "train"}, step=step)
    accelerator.end_training()
    events = EventAccumulator(str(tmp_path / "project"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2]
    assert "phase/text_summary" in events.Tags()["tensors"]


def test_log_with_all_and_unknown_names(accelerator_made, tmp_path):
    everything = accelerator_made(cpu=True, log_with="all", project_dir=str(tmp_path))
    assert sorted(type(t).__name__ for t in everything.log_with) == ["MLflowTracker", "TensorBoardTracker"]
    with pytest.raises(ValueError, match="GeneralTracker subclass"):
        accelerator_made(cpu=True, log_with="comet_ml")
    with pytest.raises(ValueError, match="needs a directory"):
        accelerator_made(cpu=True, log_with="tensorboard").init_trackers("p")
    assert isinstance(MLflowTracker(), MLflowTracker) and TensorBoardTracker.name == "tensorboard"


class ListTracker(GeneralTracker):
    """A user's own tracker, written against Accelerate's GeneralTracker contract."""

    name = "list"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    @property
    def tracker(self):
        return self.calls

    def start(self) -> None:
        self.calls.append(("start",))

    def store_init_configuration(self, values: dict) -> None:
        self.calls.append(("config", values))

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.calls.append(("log", values, step))

    def finish(self) -> None:
        self.calls.append(("finish",))


def test_a_general_tracker_of_ones_own_plugs_in(accelerator_made):
    mine = ListTracker()
    accelerator = accelerator_made(cpu=True, log_with=[mine])
    accelerator.init_trackers("p", config={"a": 1})
    accelerator.log({"x": 2.0}, step=5)
    assert accelerator.get_tracker("list", unwrap=True) is mine.calls
    accelerator.end_training()
    assert mine.calls == [("start",), ("config", {"a": 1}), ("log", {"x": 2.0}, 5), ("finish",)]

    class Nameless(GeneralTracker):
        requires_logging_directory = False

    with pytest.raises(NotImplementedError, match="must define `name`"):
        Nameless()


# ---------------------------------------------------------------------------------- the rest of the API
def test_split_between_processes_shares_lists_tensors_and_dicts():
    def shares(inputs, padding=False):
        out = []
        for rank in range(3):
            with split_between_processes(inputs, 3, rank, apply_padding=padding) as part:
                out.append(part)
        return out

    assert shares(list(range(7))) == [[0, 1, 2], [3, 4], [5, 6]]
    assert shares(list(range(7)), padding=True) == [[0, 1, 2], [3, 4, 4], [5, 6, 6]]
    assert [t.tolist() for t in shares(torch.arange(4), padding=True)] == [[0, 1], [2, 2], [3, 3]]
    assert shares({"a": [1, 2, 3], "b": "xyz"}) == [
        {"a": [1], "b": "x"},
        {"a": [2], "b": "y"},
        {"a": [3], "b": "z"},
    ]
    with pytest.raises(ValueError, match="one length"):
        shares({"a": [1, 2], "b": [1]})


def test_partial_state_and_the_function_forms_use_the_accelerators_process_group(accelerator_made):
    accelerator = accelerator_made(cpu=True)
    state = PartialState()
    assert state.strategy is accelerator.strategy and state.is_last_process and not state.multi_device
    with state.split_between_processes(["a", "b"]) as mine:
        assert mine == ["a", "b"]
    assert gather(torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0]
    assert reduce(torch.tensor(3.0), "max").item() == 3.0
    wait_for_everyone()
    ran = []
    accelerator.on_local_process(local_process_idx=0)(lambda: ran.append("idx"))()
    accelerator.on_local_process(local_process_index=0)(lambda: ran.append("index"))()
    accelerator.on_local_process(local_process_index=1)(lambda: ran.append("not here"))()
    accelerator.on_last_process(lambda: ran.append("last"))()
    assert ran == ["idx", "index", "last"]


def test_save_writes_once_atomically(accelerator_made, tmp_path):
    accelerator = accelerator_made(cpu=True)
    accelerator.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    accelerator.save({"w": torch.ones(2)}, tmp_path / "safe.safetensors", safe_serialization=True)
    assert torch.load(tmp_path / "plain.pt")["w"].tolist() == [1.0, 1.0]
    assert load_file(tmp_path / "safe.safetensors")["w"].tolist() == [1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.pt", "safe.safetensors"]


def test_state_pre_hooks_save_and_load_models_their_own_way(accelerator_made, tmp_path):
    accelerator = accelerator_made(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))

    def save_pretrained(models, weights, output_dir):
        torch.save(models[0].state_dict(), Path(output_dir) / "pretrained.pt")
        weights.pop()

    def from_pretrained(models, input_dir):
        models.pop().load_state_dict(torch.load(Path(input_dir) / "pretrained.pt"))

    accelerator.register_save_state_pre_hook(save_pretrained)
    load_handle = accelerator.register_load_state_pre_hook(from_pretrained)
    checkpoint = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    assert (checkpoint / "pretrained.pt").is_file() and not (checkpoint / "model_0.safetensors").exists()
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(str(checkpoint))
    assert torch.equal(model.weight, saved)  # the load hook restored it
    load_handle.remove()
    with pytest.raises(ConfigError, match="prepare and register the same objects"):
        accelerator.load_state(str(checkpoint))  # without its hook the checkpoint lacks the model


def test_write_basic_config_writes_what_accelerate_reads(tmp_path):
    path = tmp_path / "default_config.yaml"
    assert write_basic_config("bf16", save_location=str(path)) == path
    config = load_config_from_file(str(path))
    assert config.mixed_precision == "bf16" and config.num_processes == 1 and config.use_cpu
    assert write_basic_config(save_location=str(path)) is False  # an existing file is kept
    with pytest.raises(ValueError):
        write_basic_config("fp12", save_location=str(tmp_path / "other.yaml"))


# -------------------------------------------------------------------- names a ported script sets or calls
def test_gradient_accumulation_steps_can_be_set_after_construction(accelerator_made):
    """Scripts pick the accumulation from the batch size they found and set it (Accelerate's setter)."""
    accelerator = accelerator_made(cpu=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(samples=16, batch_size=2))
    accelerator.gradient_accumulation_steps = 4
    synced = []
    for (batch,) in data:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).sum())
            optimizer.step()
            optimizer.zero_grad()
            synced.append(accelerator.sync_gradients)
    assert accelerator.gradient_accumulation_steps == 4
    assert synced == [False, False, False, True] * 2  # 8 micro-batches, an optimizer step every 4th
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="an integer >= 1"):
            accelerator.gradient_accumulation_steps = bad


def test_a_schedule_free_optimizer_switches_modes_through_the_prepared_one(accelerator_made):
    """`optimizer.train()` / `.eval()` reach a schedule-free optimizer (its eval weights differ from the
    training ones); the prepared run matches the plain one bitwise."""
    import schedulefree  # the test extra installs it: its absence is a failure, not a skip

    assert is_schedulefree_available()

    def trained(prepare: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.1, warmup_steps=2)
        if prepare:
            model, optimizer = accelerator_made(cpu=True).prepare(model, optimizer)
        optimizer.train()
        for step in range(5):
            loss = (model(torch.full((4, 3), float(step))) - 1).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        training = model.weight.detach().clone()
        optimizer.eval()
        return training, model.weight.detach().clone()

    plain, prepared = trained(prepare=False), trained(prepare=True)
    assert not torch.equal(plain[0], plain[1])  # eval() moved the weights to their averaged sequence
    assert torch.equal(prepared[0], plain[0]) and torch.equal(prepared[1], plain[1])


# ---------------------------------------------------------------------- FSDP plugin, ParallelismConfig
@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        ({}, ([], True, "shard", False)),  # Accelerate's defaults: FSDP1 FULL_SHARD, no_wrap (the root)
        ({"sharding_strategy": "SHARD_GRAD_OP"}, ([], False, "shard", False)),
        ({"sharding_strategy": 3}, ([], True, "replicate", False)),  # NO_SHARD, by number
        ({"reshard_after_forward": "HYBRID_SHARD"}, ([], True, "hybrid", False)),  # FSDP1 names there too
        ({"sharding_strategy": "_HYBRID_SHARD_ZERO2"}, ([], False, "hybrid", False)),
        ({"fsdp_version": 2, "reshard_after_forward": False}, ([], False, "shard", False)),
        ({"auto_wrap_policy": "transformer_based_wrap"}, (None, True, "shard", False)),  # _no_split_modules
        (
            {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_cls_names_to_wrap": "Block, Mlp"},
            (["Block", "Mlp"], True, "shard", False),
        ),
        ({"cpu_offload": True}, ([], True, "shard", True)),
    ],
)
def test_fsdp_plugin_settings_map_as_accelerate_reads_them(plugin, expected):
    settings = FullyShardedDataParallelPlugin(**plugin).settings()
    assert (
        settings.shard_modules,
        settings.reshard_after_forward,
        settings.layout,
        settings.cpu_offload,
    ) == expected


def test_fsdp_plugin_takes_torchs_enums_and_offload_objects():
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy, ShardingStrategy

    assert (
        FullyShardedDataParallelPlugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).settings().layout
        == "shard"
    )
    assert (
        not FullyShardedDataParallelPlugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
        .settings()
        .reshard_after_forward
    )
    assert FullyShardedDataParallelPlugin(cpu_offload=CPUOffload(offload_params=True)).settings().cpu_offload
    assert FullyShardedDataParallelPlugin(cpu_offload=CPUOffloadPolicy()).settings().cpu_offload
    assert not FullyShardedDataParallelPlugin(cpu_offload=OffloadPolicy()).settings().cpu_offload


@pytest.mark.parametrize(
    ("plugin", "refusal"),
    [
        ({"auto_wrap_policy": "size_based_wrap"}, "runner's FSDP units are module classes"),
        ({"auto_wrap_policy": lambda *a: True}, "runner's FSDP units are module classes"),
        ({"mixed_precision_policy": {"param_dtype": torch.bfloat16}}, "mixed_precision='bf16'"),
        ({"ignored_modules": [torch.nn.Linear(1, 1)]}, "shards every parameter"),
        ({"param_init_fn": lambda module: None}, "already materialised"),
        ({"activation_checkpointing_offload": True}, "not offloaded"),
        ({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": True}, "not both"),
        ({"sharding_strategy": "HALF_SHARD"}, "is not one of FULL_SHARD"),
        ({"fsdp_version": 3}, "expected 1 or 2"),
    ],
)
def test_fsdp_plugin_settings_without_meaning_here_are_refused_saying_why(plugin, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        FullyShardedDataParallelPlugin(**plugin)


def test_an_fsdp_plugin_makes_the_fsdp_strategy_in_one_process(accelerator_made):
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=False, auto_wrap_policy="no_wrap", cpu_offload=True
    )
    accelerator = accelerator_made(cpu=True, fsdp_plugin=plugin)
    assert isinstance(accelerator.strategy, FSDP) and accelerator.is_fsdp2
    assert not accelerator.strategy.reshard_after_forward and accelerator.strategy.shard_modules == []
    assert type(accelerator.strategy.offload_policy).__name__ == "CPUOffloadPolicy"
    assert accelerator.torch_device_mesh.mesh_dim_names == ("dp_shard",)  # built at init, as Accelerate's
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    assert type(model.weight).__name__ == "DTensor"
    assert accelerator.torch_device_mesh.mesh_dim_names == ("dp_shard",)
    assert accelerator.parallelism_config == ParallelismConfig(
        dp_replicate_size=1, dp_shard_size=1, tp_size=1
    )
    with pytest.raises(ValueError, match="Give the backend once"):
        Accelerator(strategy=DDP(device="cpu", num_processes=1), fsdp_plugin=plugin)


def test_a_parallelism_config_must_lay_out_the_world_and_refuses_what_has_no_meaning_here():
    with pytest.raises(ValueError, match=re.escape("lays out 2 process(es), but this job has 1")):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(dp_shard_size=2))
    with pytest.raises(ValueError, match="runner has no sequence parallel"):
        ParallelismConfig(sp_size=2)
    with pytest.raises(ValueError, match="expected an integer >= 1"):
        ParallelismConfig(tp_size=0)
    with pytest.raises(ValueError, match="expected 'torch'"):
        ParallelismConfig(cp_size=2, cp_backend="deepspeed")
    with pytest.raises(ValueError, match="over pure replicas is not a layout"):
        ParallelismConfig(dp_replicate_size=2, cp_size=2)
    with pytest.raises(ValueError, match="all-gathers each layer's keys and values"):
        TorchContextParallelConfig(cp_comm_strategy="alltoall")
    with pytest.raises(ValueError, match="expected a TorchContextParallelConfig"):
        ParallelismConfig(cp_size=2, cp_handler=object())
    layout = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2)
    assert (layout.total_size, layout.data_parallel_size, layout.non_data_parallel_size) == (16, 4, 4)
    assert layout.dp_cp_dim_names == ["dp_replicate", "dp_shard", "cp"]
    assert layout.dp_shard_cp_dim_names == ["dp_shard", "cp"] and layout.non_dp_dim_names == ["tp", "cp"]
    assert layout.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert layout.cp_handler == TorchContextParallelConfig(cp_comm_strategy="allgather")
    # Sizes left unset are `accelerate launch --parallelism_config_*`'s, as under Accelerate.
    with patch_environment(
        ACCELERATE_USE_PARALLELISM_CONFIG="true",
        PARALLELISM_CONFIG_CP_SIZE="2",
        PARALLELISM_CONFIG_DP_SHARD_SIZE="2",
    ):
        assert accelerate_launch_settings().parallelism_config
        assert (
            ParallelismConfig().cp_size,
            ParallelismConfig().dp_shard_size,
            ParallelismConfig().tp_size,
        ) == (2, 2, 1)
        with pytest.raises(ValueError, match=re.escape("lays out 4 process(es), but this job has 1")):
            Accelerator(cpu=True)  # the launch's layout is read


def test_a_parallelism_config_picks_the_strategy_of_its_layout():
    """On 4 ranks (as torchrun would say): replicas only DDP, shards FSDP/HSDP, tp_size tensor parallel with
    FSDP over the rest; an FSDP plugin's HYBRID_SHARD replicates across nodes and shards within one."""
    from runner.accelerate.accelerator import _plugin_strategy
    from runner.hardware import TensorParallel

    world = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
    }
    with patch_environment(**world):
        assert type(_plugin_strategy(None, ParallelismConfig(dp_replicate_size=4), cpu=True)) is DDP
        hsdp = _plugin_strategy(None, ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), cpu=True)
        assert isinstance(hsdp, FSDP) and (hsdp.dims.dp_replicate, hsdp.dims.dp_shard) == (2, 2)
        tp = _plugin_strategy(
            FullyShardedDataParallelPlugin(reshard_after_forward="SHARD_GRAD_OP"),
            ParallelismConfig(dp_shard_size=2, tp_size=2),
            cpu=True,
        )
        assert isinstance(tp, TensorParallel) and (tp.dims.dp_shard, tp.dims.tp) == (2, 2)
        assert not tp.reshard_after_forward and tp.num_processes == 2
        hybrid = _plugin_strategy(
            FullyShardedDataParallelPlugin(sharding_strategy="HYBRID_SHARD"), None, cpu=True
        )
        assert isinstance(hybrid, FSDP) and (hybrid.dims.dp_replicate, hybrid.dims.dp_shard) == (2, 2)
        no_shard = _plugin_strategy(
            FullyShardedDataParallelPlugin(sharding_strategy="NO_SHARD"), None, cpu=True
        )
        assert (no_shard.dims.dp_replicate, no_shard.dims.dp_shard) == (4, 1)
        assert type(_plugin_strategy(None, ParallelismConfig(), cpu=True)) is DDP  # all 1: replicas
        fsdp2 = FullyShardedDataParallelPlugin(fsdp_version=2)
        cp = _plugin_strategy(fsdp2, ParallelismConfig(dp_shard_size=2, cp_size=2), cpu=True)
        assert isinstance(cp, FSDP) and (cp.dims.dp_shard, cp.dims.cp) == (2, 2)
        tp_cp = _plugin_strategy(fsdp2, ParallelismConfig(cp_size=2, tp_size=2), cpu=True)
        assert isinstance(tp_cp, TensorParallel) and (tp_cp.dims.dp_shard, tp_cp.dims.cp, tp_cp.dims.tp) == (
            1,
            2,
            2,
        )
        for plugin in (None, FullyShardedDataParallelPlugin()):  # Accelerate's default plugin is FSDP1
            with pytest.raises(ValueError, match=r"cp_size=4\) needs an FSDP2 plugin"):
                _plugin_strategy(plugin, ParallelismConfig(cp_size=4), cpu=True)


def test_an_fsdp1_launch_config_reads_as_accelerate_reads_it():
    version_1 = FullyShardedDataParallelPlugin.from_launch(
        {"sharding_strategy": "SHARD_GRAD_OP", "offload_params": "true", "auto_wrap_policy": "NO_WRAP"}
    ).settings()
    assert (version_1.reshard_after_forward, version_1.layout, version_1.cpu_offload) == (
        False,
        "shard",
        True,
    )
    hybrid = FullyShardedDataParallelPlugin.from_launch(
        {"version": "1", "reshard_after_forward": "HYBRID_SHARD"}
    )
    assert hybrid.settings().layout == "hybrid"
    with pytest.raises(ValueError, match="runner's FSDP units are module classes"):
        FullyShardedDataParallelPlugin.from_launch(
            {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": "100"}
        )


# ------------------------------------------------------------------------------------------- DeepSpeed
DEEPSPEED_PLUGINS = [
    {},
    {
        "zero_stage": 3,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "cpu",
        "zero3_save_16bit_model": True,
    },
    {  # a config with "auto" values, filled from the fields; the fields read back from it
        "hf_ds_config": {
            "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}},
            "gradient_clipping": "auto",
            "bf16": {"enabled": True},
        },
        "zero_stage": 1,
        "gradient_clipping": 0.3,
    },
]


@pytest.mark.parametrize("plugin", DEEPSPEED_PLUGINS)
def test_deepspeed_plugin_builds_accelerates_config(plugin):
    from accelerate.utils import DeepSpeedPlugin as AcceleratesPlugin

    ours, theirs = DeepSpeedPlugin(**plugin), AcceleratesPlugin(**plugin)
    assert ours.deepspeed_config == theirs.deepspeed_config
    for name in ("zero_stage", "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_deepspeed_plugin_reads_accelerates_launch_variables(tmp_path):
    launch = {  # what `accelerate launch --use_deepspeed --zero_stage 3 ...` sets
        "accelerate_deepspeed_zero_stage": "3",
        "accelerate_gradient_accumulation_steps": "4",
        "accelerate_gradient_clipping": "0.7",
        "accelerate_deepspeed_offload_optimizer_device": "cpu",
    }
    with patch_environment(**launch):
        plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 4
    assert plugin.deepspeed_config["gradient_clipping"] == 0.7 and plugin.zero3_init_flag
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 0.2}))
    with patch_environment(accelerate_deepspeed_config_file=str(path)):
        from_file = DeepSpeedPlugin()
    assert from_file.zero_stage == 1 and from_file.gradient_clipping == 0.2
    assert from_file.deepspeed_config["gradient_accumulation_steps"] == 1  # Accelerate's default in a file


@pytest.mark.parametrize(
    ("plugin", "refusal"),
    [
        ({"transformer_moe_cls_names": "MixtralSparseMoeBlock"}, "mixture-of-experts"),
        ({"enable_msamp": True}, "MS-AMP"),
        ({"hf_ds_config": {"bf16": {"enabled": True}}}, "no zero_optimization block"),
        ({"hf_ds_config": "/nonexistent/ds.json"}, "not a readable JSON file"),
    ],
)
def test_deepspeed_plugin_settings_without_meaning_here_are_refused(plugin, refusal):
    with pytest.raises(ValueError, match=refusal):
        DeepSpeedPlugin(**plugin)


@pytest.fixture
def environment_restored():
    """This process's environment as it was, after the test (DeepSpeed's engine exports LOCAL_RANK, which
    would make a later test's child process look launched)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_a_deepspeed_plugin_makes_the_deepspeed_strategy(environment_restored, accelerator_made):
    plugin = DeepSpeedPlugin(
        hf_ds_config={
            "zero_optimization": {"stage": 3},
            "gradient_accumulation_steps": 3,
            "fp16": {"enabled": "auto"},
            "bf16": {"enabled": True},
        },
        offload_param_device="cpu",
    )
    accelerator = accelerator_made(cpu=True, deepspeed_plugin=plugin)
    strategy = accelerator.strategy
    assert isinstance(strategy, DeepSpeed) and strategy.zero_stage == 3
    assert strategy.gradient_clipping == 1.0  # unset: DeepSpeed's default, as under Accelerate
    assert accelerator.gradient_accumulation_steps == 3  # the config fixes it
    assert accelerator.mixed_precision == "bf16"  # the config's bf16 block, no mixed_precision given
    assert accelerator.deepspeed_plugin is plugin and accelerator.state.deepspeed_plugin is plugin
    with pytest.raises(ValueError, match="Give the backend once"):
        Accelerator(cpu=True, deepspeed_plugin=plugin, fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(ValueError, match="2 plugins"):
        Accelerator(cpu=True, deepspeed_plugin={"a": plugin, "b": plugin})
    with patch_environment(accelerate_use_deepspeed="true", accelerate_deepspeed_zero_stage="1"):
        launched = accelerator_made(cpu=True)  # `accelerate launch --use_deepspeed --zero_stage 1`
    assert isinstance(launched.strategy, DeepSpeed) and launched.strategy.zero_stage == 1


def test_dummy_optim_and_scheduler_are_refused_without_deepspeed(accelerator_made):
    accelerator = accelerator_made(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = DummyOptim(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="DummyOptim stands for the optimizer a DeepSpeed config declares"):
        accelerator.prepare(optimizer)
    with pytest.raises(ValueError, match="DummyOptim stands for the optimizer a DeepSpeed config declares"):
        accelerator.prepare(model, optimizer)
    with pytest.raises(ValueError, match="DummyScheduler stands for the schedule"):
        accelerator.prepare(DummyScheduler(optimizer))


def test_a_deepspeed_plugins_parameter_offload_below_stage_3_is_left_to_deepspeed():
    """Accelerate passes `offload_param_device="cpu"` at stage 2 on to DeepSpeed, which ignores it there."""
    settings = DeepSpeedPlugin(zero_stage=2, offload_param_device="cpu").settings()
    assert settings.zero_stage == 2 and not settings.offload_params
    assert settings.config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert DeepSpeedPlugin(zero_stage=3, offload_param_device="cpu").settings().offload_params


def test_every_accelerate_utils_name_imports_from_runner_utils_or_is_named_in_the_docs():
    """The installed Accelerate's public `accelerate.utils` names: each is in `runner.utils`, or the docs
    name it with the reason it is left out (and nothing they name is in fact there)."""
    import accelerate.utils

    import runner.utils

    page = (Path(__file__).resolve().parents[1] / "docs" / "accelerate.md").read_text()
    section = page.split("## `accelerate.utils` names that runner leaves out", 1)[1]
    left_out = set(re.findall(r"`(\w+)`", "\n".join(line.split(" | ")[0] for line in section.splitlines())))
    public = {name for name in dir(accelerate.utils) if not name.startswith("_")}
    missing = sorted(name for name in public - left_out if not hasattr(runner.utils, name))
    assert not missing, f"ported scripts cannot import these from runner.utils: {missing}"
    assert not sorted(name for name in left_out & public if hasattr(runner.utils, name))
    assert len(public - left_out) >= 120


def test_the_device_helpers_answer_as_accelerates_here():
    import accelerate.utils

    import runner.utils

    assert runner.utils.get_torch_accelerator_backend() == accelerate.utils.get_torch_accelerator_backend()
    for device_type in ("cpu", "cuda", "xpu", None):
        assert runner.utils.get_distributed_backend(device_type) == accelerate.utils.get_distributed_backend(
            device_type
        ), device_type
    for device in (0, 3, "npu", "cpu", "cuda:1"):
        assert runner.utils.normalize_device(device) == accelerate.utils.normalize_device(device), device


def test_the_availability_checks_answer_as_accelerates_here():
    import accelerate.utils

    import runner.utils

    checks = sorted(
        name for name in dir(accelerate.utils) if name.startswith("is_") and name.endswith("_available")
    )
    assert len(checks) > 50
    theirs = {name: bool(getattr(accelerate.utils, name)()) for name in checks}
    ours = {name: getattr(runner.utils, name)() for name in checks}
    assert ours == theirs and all(isinstance(value, bool) for value in ours.values())
    assert runner.utils.is_torch_version(">=", "2.4") and not runner.utils.is_torch_version("<", "2.0")
    assert runner.utils.compare_versions("torch", ">=", "2.4")
