"""Command to first completed optimizer step: `python -m runner` with 1 and 2 processes against a plain
single-process PyTorch script training the same model, all measured in this run, interleaved.

    python benchmarks/launch_time.py [--rounds 5]

Every command trains the default experiment's MLP (16 -> 4 x 256 -> 1, AdamW, batch 64). The optimizer
below writes the wall-clock time when its first step returns; the time to first step is that stamp minus
the moment the command was started. A `torchrun` DDP script is measured as a second reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAMP_ENV = "LAUNCH_TIME_STAMP"


def stamp_first_step(optimizer_class: type) -> type:
    """`optimizer_class`, writing the time its first step returned to $LAUNCH_TIME_STAMP (main rank only)."""

    class Stamped(optimizer_class):  # type: ignore[misc, valid-type]
        stamped = False

        def step(self, *args, **kwargs):
            result = super().step(*args, **kwargs)
            if not self.stamped and os.environ.get("RANK", "0") == "0":
                Path(os.environ[STAMP_ENV]).write_text(repr(time.time()))
                self.stamped = True
            return result

    return Stamped


def __getattr__(name: str) -> type:  # `optimizer._target_=launch_time.StampedAdamW`, torch imported lazily
    if name == "StampedAdamW":
        import torch

        return stamp_first_step(torch.optim.AdamW)
    raise AttributeError(name)


def plain_first_step(ddp: bool) -> None:
    """The plain PyTorch script: same model, data and optimizer, one step (optionally DDP under torchrun)."""
    import torch
    from torch import nn

    if ddp:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    inputs, targets = torch.randn(4096, 16), torch.randn(4096, 1)
    layers: list[nn.Module] = []
    for width in (16, 256, 256, 256):
        layers += [nn.Linear(width, 256), nn.GELU()]
    model: nn.Module = nn.Sequential(*layers, nn.Linear(256, 1))
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = stamp_first_step(torch.optim.AdamW)(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets), batch_size=64, shuffle=True
    )
    x, y = next(iter(loader))
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    if ddp:
        torch.distributed.destroy_process_group()


def time_to_first_step(command: list[str], workdir: Path) -> float:
    stamp = workdir / "stamp"
    stamp.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env |= {STAMP_ENV: str(stamp), "PYTHONPATH": str(HERE)}
    start = time.time()
    subprocess.run(command, env=env, cwd=workdir, check=True, capture_output=True)
    return float(stamp.read_text()) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plain", choices=["single", "ddp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:
        plain_first_step(ddp=args.plain == "ddp")
        return

    runner = [sys.executable, "-m", "runner", "trainer.max_steps=1", "trainer.eval_every=0"]
    runner += ["trainer.progress_bar=false", "optimizer._target_=launch_time.StampedAdamW"]
    commands = {
        "plain PyTorch, 1 process": [sys.executable, __file__, "--plain", "single"],
        "python -m runner, 1 process": runner,
        "python -m runner, 2 processes": [*runner, "hardware=multi_gpu", "hardware.num_processes=2"],
        "plain torchrun DDP, 2 processes": [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *(__file__, "--plain", "ddp"),
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name, command in commands.items():  # warm the file cache once
            time_to_first_step(
                command + ([f"hydra.run.dir={workdir}/warm"] if "runner" in name else []), workdir
            )
        for round_ in range(args.rounds):
            for name, command in commands.items():
                extra = [f"hydra.run.dir={workdir}/{round_}"] if "-m runner" in name else []
                times[name].append(time_to_first_step(command + extra, workdir))

    plain = times["plain PyTorch, 1 process"]
    print(f"command to first optimizer step over {args.rounds} interleaved rounds, {os.cpu_count()} cores")
    print(
        f"{'command':<34} {'median s':>8} {'min s':>6} {'max s':>6} {'ratio (median)':>15} {'ratio (min)':>12}"
    )
    for name, values in times.items():
        median, best = statistics.median(values), min(values)
        ratios = f"{median / statistics.median(plain):14.2f}x {best / min(plain):11.2f}x"
        print(f"{name:<34} {median:8.2f} {best:6.2f} {max(values):6.2f} {ratios}")


if __name__ == "__main__":
    main()
