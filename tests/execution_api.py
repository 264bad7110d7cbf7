"""Every documented spelling of the Accelerator's execution API, called by 2 ranks under torchrun:
`torchrun --standalone --nproc-per-node 2 tests/execution_api.py <workdir>`. Each call records what it ran,
on which rank and when, in <workdir>/events; tests/test_execution_api.py reads them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from runner import Accelerator

WORKDIR = Path(sys.argv[1])
RANK = int(os.environ["RANK"])


def record(event: str) -> None:
    with open(WORKDIR / "events", "a") as f:
        f.write(f"{time.time():.6f} {RANK} {event}\n")


accelerator = Accelerator()
record(f"world {accelerator.num_processes}")

# Ordering: the main process (of all, of each machine) runs the body first, the others after it.
with accelerator.main_process_first():
    record("main_process_first")
    time.sleep(0.2)
with accelerator.local_main_process_first():
    record("local_main_process_first")
    time.sleep(0.2)
accelerator.wait_for_everyone()

# Save on the main process, everyone loads once it is written.
model = torch.nn.Linear(4, 2)
if accelerator.is_main_process:
    torch.save(accelerator.unwrap_model(model).state_dict(), WORKDIR / "weights.pth")
accelerator.wait_for_everyone()
model.load_state_dict(torch.load(WORKDIR / "weights.pth"))
record("loaded")

# A trigger set by one rank stops every rank at the same step.
for step in range(1, 10):
    if RANK == 1 and step == 4:
        accelerator.set_trigger()
    if accelerator.check_trigger():
        break
record(f"stopped at {step}")


# Decorators, with and without arguments, in each spelling.
@accelerator.on_main_process
def on_main() -> None:
    record("on_main_process")


@accelerator.on_local_main_process
def on_local_main() -> None:
    record("on_local_main_process")


@accelerator.on_process(process_index=1)
def on_rank_one() -> None:
    record("on_process(process_index=1)")


@accelerator.on_local_process(local_process_idx=1)
def on_local_rank_one() -> None:
    record("on_local_process(local_process_idx=1)")


def on_rank_zero() -> None:
    record("on_process(function, process_index=0)")


for function in (
    on_main,
    on_local_main,
    on_rank_one,
    on_local_rank_one,
    accelerator.on_process(on_rank_zero),
):
    function()

accelerator.print(f"printed by rank {RANK}")
accelerator.end_training()
