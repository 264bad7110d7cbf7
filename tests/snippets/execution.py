"""The code snippets of Accelerate's "Executing and deferring jobs" and "Execution process" pages, unchanged
but for the import, with small stand-ins for what they call (datasets, a hub repo). Run under torchrun:
`torchrun --standalone --nproc-per-node 2 execution.py <workdir>`; each stand-in records what it did in
<workdir>/events, which tests/test_snippets.py reads."""

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from runner import Accelerator

WORKDIR = Path(sys.argv[1])
os.chdir(WORKDIR)
RANK = int(os.environ["RANK"])


def record(event: str) -> None:
    with open(WORKDIR / "events", "a") as f:
        f.write(f"{time.time():.6f} {RANK} {event}\n")


class FakeDataset(list):
    def map(self, function, batched=False, remove_columns=()):
        record("map")
        return FakeDataset(function(self))


def load_dataset(*names):
    cache = WORKDIR / ("cache-" + "-".join(names))
    if not cache.exists():
        record("download")
        time.sleep(0.3)
        cache.write_text("sentence1,sentence2\n")
    record("load")
    return FakeDataset(["a b", "c d"])


def tokenize_function(rows):
    return [row.split() for row in rows]


def do_thing_once_per_server():
    record("once_per_server")


def do_thing_once():
    record("once")


def do_thing_on_index_zero():
    record("index_zero")


def do_thing_on_index_zero_on_each_server():
    record("local_index_zero")


repo = SimpleNamespace(push_to_hub=lambda: record("push_to_hub"))
args = SimpleNamespace(max_train_steps=3)
model = torch.nn.Linear(4, 2)
loss_func = torch.nn.functional.cross_entropy
data_loader = [(torch.randn(3, 4), torch.tensor([0, 1, 0])) for _ in range(10)]
steps = 0


def should_do_early_stopping(loss):
    global steps
    steps += 1
    return RANK == 1 and steps == 4  # only one rank decides


accelerator = Accelerator()
record(f"world {accelerator.num_processes}")

# --- 000: Executing and deferring jobs ---------------------------------------------------------------
accelerator.wait_for_everyone()

with accelerator.main_process_first():
    datasets = load_dataset("glue", "mrpc")

# First do something on the main process
if accelerator.is_main_process:
    datasets = load_dataset("glue", "mrpc")
else:
    accelerator.wait_for_everyone()

# And then send it to the rest of them
if not accelerator.is_main_process:
    datasets = load_dataset("glue", "mrpc")
else:
    accelerator.wait_for_everyone()

if accelerator.is_main_process:
    model = accelerator.unwrap_model(model)
    torch.save(model.state_dict(), "weights.pth")

accelerator.wait_for_everyone()
with accelerator.main_process_first():
    state = torch.load("weights.pth")
    model.load_state_dict(state)

datasets = load_dataset("glue", "mrpc")

with accelerator.main_process_first():
    tokenized_datasets = datasets.map(
        tokenize_function,
        batched=True,
        remove_columns=["idx", "sentence1", "sentence2"],
    )

for (x,y) in data_loader:
    logits = model(x)
    loss = loss_func(logits, y)
    # Assume `should_do_early_stopping` is a custom defined function that returns a conditional
    if should_do_early_stopping(loss):
        accelerator.set_trigger()

    # Later in the training script when we need to check for the breakpoint
    if accelerator.check_trigger():
        break
record(f"stopped after {steps}")

# --- 003: Execution process -------------------------------------------------------------------------
progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
record(f"progress_bar disabled={progress_bar.disable}")
progress_bar.close()

if accelerator.is_local_main_process:
    print("Accelerate is the best")

@accelerator.on_local_main_process
def do_my_thing():
    "Something done once per server"
    do_thing_once_per_server()
do_my_thing()

if accelerator.is_main_process:
    repo.push_to_hub()

@accelerator.on_main_process
def do_my_thing():
    "Something done once per server"
    do_thing_once()
do_my_thing()

@accelerator.on_process(process_index=0)
def do_my_thing():
    "Something done on process index 0"
    do_thing_on_index_zero()
do_my_thing()

@accelerator.on_local_process(local_process_idx=0)
def do_my_thing():
    "Something done on process index 0 on each server"
    do_thing_on_index_zero_on_each_server()
do_my_thing()

accelerator.wait_for_everyone()
accelerator.print("done")
