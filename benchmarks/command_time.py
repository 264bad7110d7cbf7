"""The whole command against a plain PyTorch script doing the same training, all measured in this run:

    python benchmarks/command_time.py [--rounds 5] [--sweep-rounds 2]

1. Each command in a fresh process, in interleaved rounds: the time to its first optimizer step (the
   optimizer stamps it) and to its exit. The plain script trains the default experiment as `python -m
   runner` does (the synthetic regression, the 4 x 256 MLP, AdamW with warm-up and cosine decay, 200 steps,
   evaluation at steps 100 and 200, the weights and metrics saved); it runs twice per round, the second
   time as an A/A control. Output goes to files, but for the two `piped` rows, whose output is read from a
   pipe to its end (as `| tee` or a CI log reads it); after each runner command the bench waits for its
   MLflow sender to finish, so no command runs next to an earlier one's sender.
2. A 10-job local sweep (`python -m runner -m trainer.seed=range(10)`, default tracker) against ten
   plain scripts run one after another.
3. The answers that start nothing: `python -m runner.env` and `python -m runner plan=true` against
   `python -c "import torch"`.

Ratios are of medians against the plain reference of the same run. Nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAMP_ENV = "COMMAND_TIME_STAMP"
SENDER = "runner.trackers.upload --serve"


def stamp_first_step(optimizer_class: type) -> type:
    """`optimizer_class`, writing the time its first step returned to $COMMAND_TIME_STAMP (rank 0 only)."""

    class Stamped(optimizer_class):  # type: ignore[misc, valid-type]
        stamped = False

        def step(self, *args, **kwargs):
            result = super().step(*args, **kwargs)
            if not self.stamped and os.environ.get("RANK", "0") == "0" and STAMP_ENV in os.environ:
                Path(os.environ[STAMP_ENV]).write_text(repr(time.time()))
                self.stamped = True
            return result

    return Stamped


def __getattr__(name: str) -> type:  # `optimizer._target_=command_time.StampedAdamW`, torch imported lazily
    if name == "StampedAdamW":
        import torch

        return stamp_first_step(torch.optim.AdamW)
    raise AttributeError(name)


def plain_training(ddp: bool, out: Path) -> None:
    """The plain PyTorch script: the default experiment's training, written out by hand."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset, random_split

    if ddp:
        torch.distributed.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, 16, generator=g)
    w1, w2 = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 1, generator=g) / 32**0.5
    targets = torch.sin(inputs @ w1) @ w2 + 0.05 * torch.randn(4096, 1, generator=g)
    train, held_out = random_split(TensorDataset(inputs, targets), [0.9, 0.1], generator=g)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width in (16, 256, 256, 256):
        layers += [nn.Linear(width, 256), nn.GELU()]
    model: nn.Module = nn.Sequential(*layers, nn.Linear(256, 1))
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = stamp_first_step(torch.optim.AdamW)(model.parameters(), lr=1e-3, weight_decay=0.01)
    steps, warmup = 200, 10
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            (s + 1) / (warmup + 1)
            if s < warmup
            else 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / (steps - warmup))))
        ),
    )
    sampler = torch.utils.data.DistributedSampler(train) if ddp else None
    loader = DataLoader(train, batch_size=64, shuffle=sampler is None, sampler=sampler, drop_last=True)
    metrics: dict[str, float] = {}
    step = 0
    while step < steps:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                with torch.no_grad():
                    errors = torch.cat([model(x) - y for x, y in DataLoader(held_out, batch_size=64)])
                metrics = {"train/loss": loss.item(), "eval/loss": errors.pow(2).mean().item()}
                print(f"step {step}: {metrics}")
            if step == steps:
                break
    if not ddp or torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        state = (model.module if ddp else model).state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
        (out / "metrics.json").write_text(json.dumps(metrics))
    if ddp:
        torch.distributed.destroy_process_group()


def wait_for_senders(timeout_s: float = 120) -> None:
    """Until no MLflow sender started by a runner command is left."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["pgrep", "-f", SENDER], capture_output=True).returncode == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("an MLflow sender is still running after 2 minutes")
        time.sleep(0.05)


def timed(command: list[str], workdir: Path, stamp: bool = True, piped: bool = False) -> tuple[float, float]:
    """(seconds to the first optimizer step, seconds to exit) of `command` started in `workdir`; `piped`:
    its output goes to a pipe, read to its end (as `| tee` or a CI log does: exit is then the end of the
    output, which waits for every process that holds the pipe)."""
    stamp_file = workdir / "stamp"
    stamp_file.unlink(missing_ok=True)
    # As a user's shell runs it: bytecode cached (a sandbox's PYTHONDONTWRITEBYTECODE makes every start
    # compile runner's modules again, about 0.15 s), no thread limit, no tracking URI.
    dropped = ("OMP_NUM_THREADS", "MLFLOW_TRACKING_URI", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env |= {STAMP_ENV: str(stamp_file), "PYTHONPATH": str(HERE)}
    with open(workdir / "output.txt", "w") as output:
        start = time.time()
        if piped:
            proc = subprocess.run(
                command, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            output.write(proc.stdout.decode(errors="replace"))
        else:
            proc = subprocess.run(command, env=env, cwd=workdir, stdout=output, stderr=output)
        end = time.time()
        code = proc.returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(workdir / 'output.txt').read_text()[-3000:]}")
    wait_for_senders()
    first = float(stamp_file.read_text()) - start if stamp and stamp_file.exists() else math.nan
    return first, end - start


def table(
    title: str, times: dict[str, list[tuple[float, float]]], reference: str, columns: list[str]
) -> None:
    print(f"\n{title}")
    print(f"{'command':<40}" + "".join(f" {c + ' s':>12} {'ratio':>6}" for c in columns) + f" {'spread':>7}")
    for name, values in times.items():
        row = f"{name:<40}"
        for index in range(len(columns)):
            median = statistics.median(v[index] for v in values)
            ref = statistics.median(v[index] for v in times[reference])
            row += f" {median:12.2f} {median / ref:5.2f}x"
        exits = [v[-1] for v in values]
        row += f" {(max(exits) - min(exits)) / statistics.median(exits):6.0%}"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sweep-rounds", type=int, default=2)
    parser.add_argument("--plain", choices=["single", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("plain"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:
        plain_training(ddp=args.plain == "ddp", out=args.out)
        return

    plain = [sys.executable, __file__, "--plain", "single"]
    runner = [sys.executable, "-m", "runner", "trainer.progress_bar=false"]
    runner += ["optimizer._target_=command_time.StampedAdamW"]
    commands = {
        "plain PyTorch script": plain,
        "plain PyTorch script again (A/A)": plain,
        "python -m runner tracker=none": [*runner, "tracker=none"],
        "python -m runner (MLflow, local store)": runner,
        "python -m runner tracker=none, piped": [*runner, "tracker=none"],
        "python -m runner (MLflow), piped": runner,
        "python -m runner, 2 processes": [*runner, "hardware=ddp", "hardware.num_processes=2"],
        "plain torchrun DDP, 2 processes": [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
            *(__file__, "--plain", "ddp"),
        ],
    }
    answers = {
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "python -m runner.env": [sys.executable, "-m", "runner.env"],
        "python -m runner plan=true": [sys.executable, "-m", "runner", "plan=true"],
    }
    sweep = [sys.executable, "-m", "runner", "-m", "trainer.seed=range(10)", "trainer.progress_bar=false"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        runs = 0

        def run_dir() -> list[str]:
            nonlocal runs
            runs += 1
            return [f"hydra.run.dir={workdir}/runs/{runs}", f"hydra.sweep.dir={workdir}/sweeps/{runs}"]

        def extra(name: str) -> list[str]:
            return run_dir() if "-m runner" in name else ["--out", str(workdir / "plain")]

        for name, command in commands.items():  # warm the file cache and create the MLflow store
            timed(command + extra(name), workdir)
        commanded: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        answered: dict[str, list[tuple[float, float]]] = {name: [] for name in answers}
        for _ in range(args.rounds):
            for name, command in commands.items():
                commanded[name].append(timed(command + extra(name), workdir, piped=name.endswith("piped")))
            for name, command in answers.items():
                answered[name].append(timed(command, workdir, stamp=False)[1:])
        swept: dict[str, list[tuple[float]]] = {
            "ten plain scripts, one after another": [],
            "a 10-job sweep": [],
        }
        for _ in range(args.sweep_rounds):
            total = sum(timed(plain + extra("plain"), workdir)[1] for _ in range(10))
            swept["ten plain scripts, one after another"].append((total,))
            swept["a 10-job sweep"].append(timed(sweep + run_dir(), workdir, stamp=False)[1:])

    print(f"{os.cpu_count()} cores; rounds: {args.rounds} (commands, answers), {args.sweep_rounds} (sweep)")
    table("1. Whole command", commanded, "plain PyTorch script", ["first step", "exit"])
    if args.sweep_rounds:
        table("2. Sweep", swept, "ten plain scripts, one after another", ["exit"])
    table("3. Answers", answered, 'python -c "import torch"', ["exit"])


if __name__ == "__main__":
    main()
