"""How long the training loop is blocked per checkpoint: `save_state()` against `save_state(blocking=False)`
(`trainer.async_checkpoint=true`), measured in the same run, with an A/A control (a second blocking save).

An MLP of 64M parameters (245 MB of fp32 weights; with AdamW's two states a checkpoint of ~735 MB) on one
process, checkpoints to a temporary dir (`--dir`: elsewhere, e.g. the disk a run would use). Each round
saves once per mode, the modes in turn; before each save any background write is finished, so the time a
call takes is what it blocks. Reported per mode: the median time the call blocked, its ratio to the blocking
save, and for background saves the time the write then took (the loop ran training steps meanwhile: their
count is reported too).

Not a test: nothing here gates CI.

    python benchmarks/checkpoint_blocking.py [--rounds 5] [--width 3584] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from runner import Accelerator
from runner.checkpoint.checkpointer import ProjectConfiguration
from runner.models import MLP

MODES = ["blocking", "background", "blocking (A/A)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    project = tempfile.mkdtemp(dir=args.dir)
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=project, automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    torch.manual_seed(0)
    width = args.width
    model = MLP(in_features=width, out_features=width, hidden_size=width, num_layers=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = torch.randn(8, width)

    def step() -> None:
        accelerator.backward(model(batch).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer's states exist
    parameters = sum(p.numel() for p in model.parameters())
    blocked: dict[str, list[float]] = {mode: [] for mode in MODES}
    written, steps_meanwhile = [], []
    for _ in range(args.rounds):
        for mode in MODES:
            accelerator.wait_for_checkpoint()
            start = time.perf_counter()
            accelerator.save_state(blocking=mode != "background")
            blocked[mode].append(time.perf_counter() - start)
            if mode == "background":
                steps = 0
                while accelerator.checkpoint_in_progress:
                    step()
                    steps += 1
                accelerator.wait_for_checkpoint()
                written.append(time.perf_counter() - start)
                steps_meanwhile.append(steps)
    accelerator.end_training()
    reference = statistics.median(blocked["blocking"])
    print(
        f"{parameters / 1e6:.1f}M parameters ({parameters * 4 / 2**20:.0f} MB of weights), {args.rounds} rounds"
    )
    print(f"{'mode':<16} {'blocked s':>10} {'vs blocking':>12}")
    for mode, times in blocked.items():
        print(f"{mode:<16} {statistics.median(times):>10.3f} {statistics.median(times) / reference:>12.3f}")
    print(
        f"background writes took {statistics.median(written):.3f} s (median), while the loop ran "
        f"{statistics.median(steps_meanwhile):.0f} training steps"
    )


if __name__ == "__main__":
    main()
