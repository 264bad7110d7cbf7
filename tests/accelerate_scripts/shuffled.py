"""A training script written for Hugging Face Accelerate, as most are: a shuffling DataLoader with no
generator of its own, dropout, gradient accumulation, an evaluation pass after each epoch, and a
checkpoint in the middle of an epoch. Every random draw (the shuffle's seed, the loader's base seed,
the dropout masks) comes from torch's global RNG, seeded once by `set_seed`.

`tests/test_accelerate_compat.py` runs it as written (with `accelerate`) and ported (the module name
replaced on its import lines), alone and under torchrun, and compares what each rank writes bitwise;
with `resume`, it loads the mid-epoch checkpoint of an earlier run and trains the rest. With `stateful`
its loaders are stateful (`use_stateful_dataloader=True`: torchdata's StatefulDataLoader under
Accelerate): the checkpoint records the train loader's position, and a resumed run does not skip the
consumed batches itself.

Usage: python shuffled.py <out dir> [resume] [stateful]
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

EPOCHS, SAVE_AT = 3, (1, 6)  # the checkpoint: after the 6th batch (an optimizer step) of the second epoch


def main(out: Path, resume: bool, stateful: bool) -> None:
    accelerator = Accelerator(
        gradient_accumulation_steps=2,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful),
    )
    set_seed(0)
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(96, 8, generator=data)
    targets = inputs.sum(dim=1, keepdim=True) + 0.1 * torch.randn(96, 1, generator=data)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_loader = DataLoader(TensorDataset(inputs[:80], targets[:80]), batch_size=4, shuffle=True)
    eval_loader = DataLoader(TensorDataset(inputs[80:], targets[80:]), batch_size=8)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    checkpoint = out / "checkpoint"
    start_epoch, skip = 0, 0
    if resume:
        accelerator.load_state(str(checkpoint))
        start_epoch, skip = SAVE_AT
    losses, evals = [], []
    for epoch in range(start_epoch, EPOCHS):
        model.train()
        skipped = epoch == start_epoch and not stateful  # a stateful loader resumes where it was
        batches = accelerator.skip_first_batches(train_loader, skip) if skipped else train_loader
        for step, (x, y) in enumerate(batches, start=skip if epoch == start_epoch else 0):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if not resume and (epoch, step + 1) == SAVE_AT:
                accelerator.save_state(str(checkpoint))
        model.eval()
        with torch.no_grad():
            evals.append(sum(torch.nn.functional.mse_loss(model(x), y).item() for x, y in eval_loader))
    weights = accelerator.unwrap_model(model).state_dict()
    digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in weights.values())).hexdigest()
    name = "resumed" if resume else "results"
    (out / f"{name}_{accelerator.process_index}.json").write_text(
        json.dumps({"losses": losses, "evals": evals, "weights": digest})
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), "resume" in sys.argv[2:], "stateful" in sys.argv[2:])
