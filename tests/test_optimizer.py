"""`optimizer.no_decay`: the parameters its patterns name train in a group without weight decay."""

from __future__ import annotations

import torch
from conftest import metrics_of

DECAYED = ("optimizer.weight_decay=0.5", "trainer.max_steps=20", "trainer.eval_every=0", "tracker=none",
           "trainer.plots=false", "trainer.checkpoint_every=20")  # fmt: skip


def test_no_decay_puts_the_named_parameters_in_a_group_without_weight_decay(run_cli, tmp_path):
    kept = run_cli(*DECAYED, "optimizer.no_decay=[*.bias]")
    assert kept.returncode == 0, kept.stderr
    (checkpoint,) = (kept.run_dir / "checkpoints").glob("checkpoint_*")
    groups = torch.load(checkpoint / "optimizer.bin", weights_only=False)["param_groups"]
    # the MLP's layers: a weight and a bias each
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0] and len(groups[0]["params"]) == len(groups[1]["params"])

    decayed = run_cli(*DECAYED, f"hydra.run.dir={tmp_path / 'all'}")
    assert decayed.returncode == 0, decayed.stderr
    assert metrics_of(kept)["train/loss"] != metrics_of(decayed)["train/loss"]


def test_a_no_decay_pattern_that_matches_nothing_is_refused_with_the_names(forked_cli):
    proc = forked_cli("optimizer.no_decay=[*.bias,*norm*]")
    assert proc.returncode == 2, proc.stderr
    assert "optimizer.no_decay: '*norm*' match(es) no parameter of MLP, whose parameters are: " in proc.stderr
    assert "net.0.bias" in proc.stderr and "starting" not in proc.stderr
