"""The DeepSpeed config a run builds from its own settings and a user's JSON, without starting ranks."""

from __future__ import annotations

import json

import pytest
import torch

from runner.errors import ConfigError
from runner.hardware.deepspeed import DeepSpeed, _fill, _loss_scaling
from runner.precision import Float16MixedPrecision, MixedPrecision, Precision

pytest.importorskip("deepspeed")


def built(
    precision: Precision | None = None, micro: int = 4, accumulation: int = 2, world: int = 2, **options
):
    strategy = DeepSpeed(device="cpu", **options)
    strategy.setup_precision(precision or Precision())
    return strategy.deepspeed_config(micro, accumulation, world)


def test_the_run_fills_auto_and_missing_values_and_keeps_the_users_own():
    user = {"gradient_accumulation_steps": "auto", "zero_optimization": {"reduce_bucket_size": 1000}}
    config = built(MixedPrecision("bfloat16"), zero_stage=1, config=user)
    assert config["train_micro_batch_size_per_gpu"] == 4  # the dataloader's per-rank batch
    assert config["gradient_accumulation_steps"] == 2  # "auto": the Accelerator's
    assert config["gradient_clipping"] == 0.0  # no clipping asked for: none (DeepSpeed's default is 1.0)
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert "train_batch_size" not in config  # DeepSpeed derives it
    assert user["gradient_accumulation_steps"] == "auto"  # the user's dict is not modified


def test_settings_from_yaml_reach_the_config():
    config = built(
        zero_stage=3, offload_optimizer=True, offload_params=True, gradient_clipping=0.5, micro_batch_size=3
    )
    assert config["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
    assert config["gradient_clipping"] == 0.5 and config["train_micro_batch_size_per_gpu"] == 3
    assert config["zero_force_ds_cpu_optimizer"] is False  # the user's optimizer is offloaded as it is


def test_a_users_json_file_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": 16}))
    config = built(config=str(path))  # 4 per rank x 2 steps x 2 ranks = 16: agrees
    assert config["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize(
    ("user", "options", "precision", "named"),
    [
        (
            {"gradient_accumulation_steps": 4},
            {},
            None,
            "hardware.config.gradient_accumulation_steps=4 contradicts the run's value 2",
        ),
        (
            {"train_batch_size": 100},
            {},
            None,
            "hardware.config.train_batch_size=100 contradicts the run's value 16",
        ),
        (
            {"gradient_clipping": 1.0},
            {},
            None,
            "hardware.config.gradient_clipping=1.0 contradicts the run's value 0.0",
        ),
        (
            {"zero_optimization": {"stage": 3}},
            {"zero_stage": 1},
            None,
            "hardware.config.zero_optimization.stage=3",
        ),
        ({"bf16": {"enabled": False}}, {}, MixedPrecision("bfloat16"), "hardware.config.bf16.enabled=False"),
        ({"optimizer": {"type": "Adam"}}, {}, None, "has a 'optimizer' block"),
    ],
)
def test_a_users_value_that_contradicts_the_run_is_refused(user, options, precision, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        built(precision, config=user, **options)


def test_fill_takes_auto_and_missing_values_at_every_depth():
    user = {"a": "auto", "b": {"c": "auto", "d": 1}}
    assert _fill(user, {"a": 1, "b": {"c": 2, "d": 5}, "e": 3}) == {"a": 1, "b": {"c": 2, "d": 1}, "e": 3}


def test_fp16_loss_scaling_follows_the_precision_group():
    scaling = _loss_scaling(Float16MixedPrecision(init_scale=2.0**10, growth_interval=100))
    assert scaling == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 10,
        "loss_scale_window": 100,
        "hysteresis": 1,
    }
    with pytest.raises(ConfigError, match="only doubles and halves"):
        _loss_scaling(Float16MixedPrecision(growth_factor=3.0))
    with pytest.raises(ConfigError, match="precision=fp16 with hardware=deepspeed on the CPU"):
        DeepSpeed(device="cpu").setup_precision(Float16MixedPrecision())


def test_a_declared_optimizer_and_schedule_take_their_auto_values_from_the_dummies():
    from runner.hardware.deepspeed import declared_optimizer
    from runner.utils import DummyOptim, DummyScheduler

    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
            },
        },
    }
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = DummyOptim(params, lr=3e-4, weight_decay=0.1)
    DummyScheduler(optimizer, total_num_steps=101, warmup_num_steps=0)
    kwargs = declared_optimizer(config, optimizer, world_size=2)
    assert config["optimizer"]["params"] == {
        "lr": 3e-4,
        "betas": [0.9, 0.95],
    }  # weight_decay: not "auto", left out
    assert config["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 1,  # DeepSpeed refuses 0, as Accelerate avoids
        "total_num_steps": 51,  # per process: ceil(101 / 2)
    }
    assert kwargs == {"model_parameters": [{"params": params}]}


@pytest.mark.parametrize(
    ("config", "scheduler", "refusal"),
    [
        ({}, False, "no optimizer block"),
        ({"optimizer": {"type": "SGD", "params": {}}}, True, "has none"),
        (
            {"optimizer": {"type": "SGD", "params": {}}, "scheduler": {"type": "WarmupLR"}},
            False,
            "DummyScheduler",
        ),
    ],
)
def test_a_declared_optimizer_or_schedule_that_the_config_lacks_is_refused(config, scheduler, refusal):
    from runner.hardware.deepspeed import declared_optimizer
    from runner.utils import DummyOptim, DummyScheduler

    optimizer = DummyOptim([torch.nn.Parameter(torch.zeros(2))])
    if scheduler:
        DummyScheduler(optimizer)
    with pytest.raises(ValueError, match=refusal):
        declared_optimizer(config, optimizer, world_size=1)


def test_dummies_are_refused_by_a_strategy_other_than_deepspeed():
    from runner.hardware import SingleDevice
    from runner.utils import DummyOptim, DummyScheduler

    optimizer = DummyOptim([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="runs SingleDevice"):
        SingleDevice(device="cpu").prepared_optimizer(optimizer)
    with pytest.raises(ValueError, match="runs SingleDevice"):
        SingleDevice(device="cpu").prepared_scheduler(DummyScheduler(optimizer))
