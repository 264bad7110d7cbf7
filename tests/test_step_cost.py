"""What the training loop does per step beyond a plain loop, counted (deterministic, unlike a time): the
Python calls of `python -m runner`'s loop over a round of steps against the same training written plainly.
A setting read from a DictConfig at every step (~80 calls each), a generator-based context per
micro-batch or a walk over every batch shows here as a count over the budget (benchmarks/step_overhead.py
measures the time)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.utils.data import DataLoader

from runner.callbacks import Callback, Run
from runner.config import CONF_DIR
from runner.models import MLP
from runner.schemas import register_configs
from runner.train import Trainer

STEPS = 10  # a round: one logging step among them (trainer.log_every=10)
# Calls per optimizer step beyond the plain loop's: 109 (fp32) and 193 (4 micro-batches) when written, with
# torch 2.13; `trainer.*` read from the DictConfig at every step made fp32's 567.
BUDGET = {"fp32": 130, "accum4": 230}


class Counting(Callback):
    """Counts the calls of the Trainer's steps 21-30 (from the end of step 20 to the end of step 30), then
    of 10 steps of the plain loop, which reads the loss and writes a line every 10 steps as the run logs."""

    def __init__(self, accumulation: int, log: str) -> None:
        self.accumulation, self.log = accumulation, Path(log)
        self.calls: dict[str, int] = {}
        self.count = 0

    def _hook(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self.count += 1

    def on_step_end(self, run: Run) -> None:
        if run.step == 2 * STEPS:
            self.plain = plain_training(run, self.accumulation, self.log)
            self.plain(STEPS)  # warm-up
            self.count = 0
            sys.setprofile(self._hook)
        elif run.step == 3 * STEPS:
            sys.setprofile(None)
            self.calls["runner"] = self.count
            self.count = 0
            sys.setprofile(self._hook)
            self.plain(STEPS)
            sys.setprofile(None)
            self.calls["plain"] = self.count
            run.stop("counted")


def plain_training(run: Run, accumulation: int, log: Path):
    """The default experiment's training written plainly, on the run's data: `train(n)` runs n steps."""
    model = MLP(in_features=16, out_features=1, hidden_size=256, num_layers=4)
    loader = DataLoader(run.train_loader.base_dataloader.dataset, batch_size=64, shuffle=True)  # type: ignore[attr-defined]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    out = log.open("a")

    def batches():
        while True:
            yield from loader

    stream, window, done = batches(), torch.zeros(()), 0

    def train(steps: int) -> None:
        nonlocal window, done
        for _ in range(steps):
            for _ in range(accumulation):
                batch = next(stream)
                loss = F.mse_loss(model(batch["inputs"]), batch["targets"])
                (loss / accumulation if accumulation > 1 else loss).backward()
                window += loss.detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            done += 1
            if done % STEPS == 0:
                out.write(f"step {done}: loss {window.item() / (STEPS * accumulation):.4f}\n")
                out.flush()
                window.zero_()

    return train


@pytest.mark.parametrize("mode", list(BUDGET))
def test_the_loop_makes_few_calls_per_step_beyond_a_plain_loops(tmp_path, mode):
    accumulation = 4 if mode == "accum4" else 1
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "tracker=none",
                "trainer.plots=false",
                "trainer.progress_bar=false",
                "trainer.save_model=false",
                "trainer.eval_every=0",
                f"trainer.max_steps={10 * STEPS}",
                f"trainer.gradient_accumulation_steps={accumulation}",
                "+callbacks.counting._target_=test_step_cost.Counting",
                f"+callbacks.counting.accumulation={accumulation}",
                f"+callbacks.counting.log={tmp_path / 'plain.log'}",
            ],
        )
    (tmp_path / "run").mkdir()
    trainer = Trainer(cfg, tmp_path / "run")
    counting = trainer.callbacks.named["counting"]
    trainer.fit()
    assert trainer.step == 3 * STEPS  # the callback stopped the run once it had counted
    extra = (counting.calls["runner"] - counting.calls["plain"]) / STEPS
    assert extra <= BUDGET[mode], (
        f"{mode}: the loop makes {extra:g} calls per step beyond a plain loop's ({counting.calls['plain'] / STEPS:g}); "
        f"the budget is {BUDGET[mode]}. benchmarks/step_overhead.py lists them."
    )
