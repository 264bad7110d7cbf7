"""`runner estimate-memory model=gpt model.d_model=1024 ...`: what the configured model needs
per device, for inference and for training with each hardware group, in each dtype (as `accelerate
estimate-memory` does for Hub models). Counted on the meta device: nothing is allocated.

Training counts the weights, their gradients and the optimizer's states, all in the dtype (mixed
precision with fp32 master weights needs the float32 row's weights and optimizer on top); activations
depend on the batch and are not included.
"""

from __future__ import annotations

import argparse

from hydra import compose, initialize_config_module
from hydra.utils import get_class
from omegaconf import DictConfig

from runner.build import build_on_meta
from runner.config import CONF_PACKAGE
from runner.group_schemas import register_configs
from runner.hardware.big_modeling import compute_module_sizes
from runner.plan import MB, optimizer_states, state_memory

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Each hardware group as the overrides that select it.
GROUPS = {
    "DDP": ["hardware=ddp"],
    "FSDP": ["hardware=fsdp"],
    "ZeRO-1": ["hardware=deepspeed", "hardware.zero_stage=1"],
    "ZeRO-2": ["hardware=deepspeed", "hardware.zero_stage=2"],
    "ZeRO-3": ["hardware=deepspeed", "hardware.zero_stage=3"],
}


def estimate(overrides: list[str], num_processes: int) -> str:
    """The report for the config `overrides` compose, with `num_processes` devices."""
    register_configs()
    with initialize_config_module(CONF_PACKAGE, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        model = build_on_meta(cfg)
        hardware = {name: _hardware(overrides, extra, num_processes) for name, extra in GROUPS.items()}
        # Each strategy says what it shards, without being built (DeepSpeed need not be installed).
        sharded = {name: get_class(hw._target_).states_sharded_by(hw) for name, hw in hardware.items()}
    parameters = sum(p.numel() for p in model.parameters())
    sizes = compute_module_sizes(model)
    leaves = {
        name: size
        for name, size in sizes.items()
        if name and not any(k.startswith(name + ".") for k in sizes)
    }
    largest = max(leaves, key=leaves.__getitem__)
    states = optimizer_states(cfg.optimizer)
    lines = [
        f"{type(model).__name__} ({cfg.model._target_}): {parameters / 1e6:.2f}M parameters; largest layer "
        f"{largest} ({leaves[largest] / MB:.2f} MB in float32); optimizer {cfg.optimizer._target_} keeps "
        f"{states} value(s) per parameter; {num_processes} devices.",
        "",
        f"{'dtype':<9} {'hardware':<10} {'weights':>11} {'gradients':>11} {'optimizer':>11} {'per device':>11}",
    ]
    for dtype, width in DTYPES.items():
        inference = parameters * width
        lines.append(f"{dtype:<9} {'inference':<10} {_mb(inference)} {'-':>11} {'-':>11} {_mb(inference)}")
        for name in GROUPS:
            memory = state_memory(parameters, width, states, sharded[name], num_processes)
            cells = " ".join(_mb(v) for v in memory.values())
            lines.append(f"{dtype:<9} {name:<10} {cells} {_mb(sum(memory.values()))}")
    lines.append("")
    lines.append("Activations are not included: they grow with the batch size and sequence length.")
    return "\n".join(lines)


def _hardware(overrides: list[str], extra: list[str], num_processes: int) -> DictConfig:
    hardware = [o for o in overrides if not o.lstrip("+~").startswith("hardware")]
    cfg = compose("config", overrides=[*hardware, *extra, f"hardware.num_processes={num_processes}"])
    return cfg.hardware


def _mb(nbytes: float) -> str:
    return f"{nbytes / MB:>8.1f} MB"


def main(argv: list[str]) -> None:
    """Print the estimate for the overrides in `argv` (its errors are the command's: `runner.cli`)."""
    parser = argparse.ArgumentParser(
        prog="runner estimate-memory",
        description="Memory per device for the configured model: inference, and training with DDP, FSDP and "
        "ZeRO 1/2/3, in float32, bfloat16 and float16. Takes the same overrides as `python -m runner`.",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model=gpt model.d_model=1024")
    parser.add_argument("--num-processes", type=int, default=8, help="devices the training is spread over")
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error(f"--num-processes={args.num_processes}: must be >= 1")
    print(estimate(args.overrides, args.num_processes))
