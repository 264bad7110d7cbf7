"""Pipeline schedules on CPU ranks: GPipe vs 1F1B vs interleaved 1F1B under runner, against the same 1F1B
run by plain `torch.distributed.pipelining` (the same stages, built by hand) in the same run.

A GPT of `--blocks` blocks (d_model 128, sequence 64, vocabulary 65), batch `--batch` split into
`--microbatches`, AdamW; `--ranks` pipeline ranks (pp = ranks; interleaved: 2 stages per rank, so the
blocks must be at least 2 x ranks). Each mode runs in fresh ranks (gloo, one compute thread each): 2 warm-up
steps, then `--steps` timed ones. Plain 1F1B runs first and last (A/A: the drift between the two is what
the method cannot resolve). Reported per mode, from the slowest rank: steps/s and its ratio to plain 1F1B;
the peak of activation bytes a rank keeps for backward (saved tensors alive at once, largest over ranks);
and the idle fraction of a rank's step (1 - its compute thread's CPU time / wall time, mean over ranks)
next to the bubble each schedule has in theory: (p - 1) / (m + p - 1), and (p - 1) / (v m + p - 1)
interleaved over v stages per rank. The idle fraction also holds communication and Python, and means
little when the ranks outnumber the cores (the script says so): run `--ranks` at most the core count.

Not a test: nothing here gates CI.

    python benchmarks/pipeline.py [--ranks 4] [--blocks 8] [--microbatches 8] [--batch 32] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

VOCAB, SEQ, WIDTH = 65, 64, 128
MODES = ["plain 1f1b", "gpipe", "1f1b", "interleaved_1f1b", "plain 1f1b (A/A)"]


def make_model(blocks: int) -> torch.nn.Module:
    from runner.models import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, max_seq_len=SEQ, d_model=WIDTH, n_layers=blocks, n_heads=4)


def next_token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))


class SavedBytes:
    """The bytes of tensors autograd keeps for backward, alive at once, and their peak."""

    def __init__(self) -> None:
        self.alive = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        size = tensor.numel() * tensor.element_size()
        self.alive += size
        self.peak = max(self.peak, self.alive)
        return _Kept(tensor, size, self)

    @staticmethod
    def unpack(kept: Any) -> torch.Tensor:
        return kept.tensor


class _Kept:
    def __init__(self, tensor: torch.Tensor, size: int, counter: SavedBytes) -> None:
        self.tensor, self.size, self.counter = tensor, size, counter

    def __del__(self) -> None:
        self.counter.alive -= self.size


def plain_step_fn(blocks: int, microbatches: int):
    """One optimizer step of plain torch pipelining: the model's stages by hand, Schedule1F1B, AdamW."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from runner.hardware.pipeline import stage_blocks

    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    model = make_model(blocks)
    ranges = stage_blocks(blocks, pp)
    module = model.pipeline_stage(ranges[rank], first=rank == 0, last=rank == pp - 1)
    stage = PipelineStage(module, rank, pp, torch.device("cpu"))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return next_token_loss(logits, {"targets": target}) / microbatches

    schedule = Schedule1F1B(stage, microbatches, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step(batch: dict[str, torch.Tensor]) -> None:
        if rank == 0:
            schedule.step(batch["inputs"], target=batch["targets"])
        else:
            schedule.step(target=batch["targets"])
        optimizer.step()
        optimizer.zero_grad()

    return step, dist.destroy_process_group


def runner_step_fn(schedule: str, blocks: int, microbatches: int):
    """One optimizer step under runner: `hardware=tensor_parallel` pure pipeline with `schedule`."""
    from runner import Accelerator
    from runner.hardware.tensor_parallel import TensorParallel

    interleaved = schedule == "interleaved_1f1b"
    strategy = TensorParallel(
        device="cpu",
        num_threads=1,
        tp_size=1,
        pp_size=int(os.environ["WORLD_SIZE"]),
        pp_schedule=schedule,
        microbatches=microbatches,
        virtual_stages=2 if interleaved else 1,
    )
    accelerator = Accelerator(strategy=strategy)
    model = make_model(blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(batch: dict[str, torch.Tensor]) -> None:
        loss = accelerator.training_loss(model, batch, next_token_loss)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def end() -> None:
        accelerator.free_memory()
        accelerator.end_training()

    return step, end


def measure(mode: str, blocks: int, microbatches: int, batch_size: int, steps: int) -> dict[str, float]:
    """In a rank: warm up, then time `steps` steps of `mode`."""
    torch.set_num_threads(1)
    if mode.startswith("plain"):
        step, end = plain_step_fn(blocks, microbatches)
    else:
        step, end = runner_step_fn(mode, blocks, microbatches)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    for _ in range(2):
        step(batch)
    saved = SavedBytes()
    walls, busy = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.thread_time()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            step(batch)
        busy.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
    end()
    return {"wall": statistics.median(walls), "idle": 1 - sum(busy) / sum(walls), "peak": saved.peak}


def launch(mode: str, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.ranks,
        run_id="pipeline-benchmark",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp()),
    )
    os.environ["OMP_NUM_THREADS"] = "1"
    return elastic_launch(config, measure)(mode, args.blocks, args.microbatches, args.batch, args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    p, m = args.ranks, args.microbatches
    if args.blocks < 2 * p:
        parser.error(
            f"--blocks {args.blocks}: interleaved 1F1B over {p} ranks needs at least {2 * p} blocks."
        )
    cores = len(os.sched_getaffinity(0))
    if p > cores:
        print(f"note: {p} ranks on {cores} cores: the ranks share cores, so idle fractions mean little here.")
    theory = {
        "gpipe": (p - 1) / (m + p - 1),
        "1f1b": (p - 1) / (m + p - 1),
        "interleaved_1f1b": (p - 1) / (2 * m + p - 1),
    }
    results = {mode: launch(mode, args) for mode in MODES}
    plain = max(r["wall"] for r in results["plain 1f1b"].values())
    print(
        f"\npp {p}, {args.blocks} blocks, {m} microbatches of {args.batch // m} rows, {args.steps} timed steps"
    )
    print(
        f"{'mode':<18} {'steps/s':>8} {'vs plain':>9} {'peak saved MB/rank':>19} {'idle':>6} {'bubble (theory)':>16}"
    )
    for mode, ranks in results.items():
        wall = max(r["wall"] for r in ranks.values())
        peak = max(r["peak"] for r in ranks.values()) / 2**20
        idle = statistics.mean(r["idle"] for r in ranks.values())
        expected = theory.get(mode.split(" (")[0].replace("plain ", ""), float("nan"))
        print(
            f"{mode:<18} {1 / wall:>8.2f} {plain / wall:>9.3f} {peak:>19.1f} {idle:>6.2f} {expected:>16.2f}"
        )


if __name__ == "__main__":
    main()
