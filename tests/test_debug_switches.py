"""The debug switches (Lightning's): `trainer.limit_train_batches` and `limit_eval_batches` end each epoch
and each evaluation there, `overfit_batches` trains and evaluates on the first batches only, and
`fast_dev_run` runs a few steps of everything and keeps nothing. Each one changes what the run does."""

from __future__ import annotations

import pytest
import rank_checks
import torch
from conftest import cli_env, run_to_end, runner_command
from hydra import compose, initialize_config_dir

from runner.build import fast_dev_run
from runner.config import CONF_DIR
from runner.errors import ConfigError
from runner.group_schemas import register_configs
from runner.train import Trainer
from runner.validate import check_job

# the default experiment's data: 4096 samples, a tenth held out, batches of 64: 58 train and 7 eval batches
TRAIN_BATCHES, EVAL_BATCHES = 58, 7


def _config(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["tracker=none", "trainer.plots=false", *overrides])


def _trainer(run_dir, *overrides: str) -> Trainer:
    run_dir.mkdir()
    return Trainer(_config(*overrides), run_dir)


def _batches(loader) -> list:
    return [batch["inputs"] for batch in loader]


def test_limits_end_each_epoch_and_each_evaluation_there(tmp_path):
    """3 batches an epoch with 2 accumulated: 2 optimizer steps an epoch (the epoch's last batch syncs), so
    2 epochs are 4 steps; an evaluation reads 2 batches."""
    whole = _trainer(tmp_path / "whole", "trainer.max_steps=null", "trainer.max_epochs=2")
    assert (len(whole.train_loader), len(whole.eval_loader)) == (TRAIN_BATCHES, EVAL_BATCHES)
    limited = _trainer(
        tmp_path / "limited",
        "trainer.max_steps=null",
        "trainer.max_epochs=2",
        "trainer.gradient_accumulation_steps=2",
        "trainer.limit_train_batches=3",
        "trainer.limit_eval_batches=2",
        "trainer.eval_every=1",
    )
    assert (len(limited.train_loader), len(limited.eval_loader)) == (3, 2)
    assert limited.total_steps == 4
    # its last batch is the pass's last, whole: not cut to the real samples of the set's last batch
    evaluated = [limited.engine.gather_for_metrics(batch["inputs"]) for batch in limited.eval_loader]
    assert [len(batch) for batch in evaluated] == [64, 64] and limited.eval_loader.end_of_dataloader
    assert all(torch.equal(a, b) for a, b in zip(evaluated, _batches(whole.eval_loader), strict=False))
    limited.fit()
    assert (limited.done.step, limited.done.epoch) == (4, 1)
    history = (tmp_path / "limited" / "history.jsonl").read_text().splitlines()
    assert sum('"eval/loss"' in line for line in history) == 4  # an evaluation at every step
    # a resumed epoch's skipped batches count: 3 in all
    skipping = limited.engine.skip_first_batches(limited.train_loader, 2)
    assert len(skipping) == len(_batches(skipping)) == 1


def test_overfit_batches_trains_and_evaluates_on_the_first_batches_only(tmp_path):
    plain = _trainer(tmp_path / "plain")
    first = torch.cat([plain.train_loader.dataset[i]["inputs"][None] for i in range(2 * 64)])
    built = _trainer(
        tmp_path / "overfit", "trainer.overfit_batches=2", "trainer.max_steps=150", "optimizer.lr=0.01"
    )
    assert len(built.train_loader) == len(built.eval_loader) == 2
    for loader in (built.train_loader, built.eval_loader):  # the same samples, shuffled or not
        seen = torch.cat(_batches(loader))
        assert torch.equal(seen[seen[:, 0].argsort()], first[first[:, 0].argsort()])
    metrics = built.fit()
    assert built.done.epoch == 74  # 2 batches an epoch
    assert metrics["eval/loss"] < 0.01  # memorised: evaluated on what it trained on


def test_overfit_batches_beyond_the_training_set_is_refused_before_launch():
    with pytest.raises(
        ConfigError, match=r"trainer.overfit_batches=100: the training set has 3686 sample\(s\)"
    ):
        check_job(_config("trainer.overfit_batches=100"))


def test_fast_dev_run_sets_a_short_run_that_keeps_nothing():
    cfg = _config("tracker=mlflow", "callbacks=[best_checkpoints]", "trainer.checkpoint_every=5")
    fast_dev_run(cfg)
    assert cfg.trainer.max_steps == 200 and cfg.tracker._target_  # off: unchanged
    cfg.trainer.fast_dev_run = 3
    fast_dev_run(cfg)
    trainer = cfg.trainer
    assert (trainer.max_steps, trainer.max_epochs, trainer.log_every, trainer.eval_every) == (3, None, 1, 0)
    assert (trainer.limit_eval_batches, trainer.checkpoint_every, trainer.resume) == (3, 0, None)
    assert not (trainer.save_model or trainer.plots or cfg.tracker._target_ or cfg.callbacks)


@pytest.mark.parametrize("resume", ["last", "outputs/runs/x/checkpoints/checkpoint_3"])
def test_fast_dev_run_with_a_resume_given_is_refused_not_dropped(resume):
    """A check run starts fresh: a checkpoint named to resume from would be dropped without a word."""
    cfg = _config("trainer.fast_dev_run=2", f"trainer.resume={resume}")
    with pytest.raises(ConfigError) as refused:
        fast_dev_run(cfg)
    assert str(refused.value).startswith(
        f"trainer.fast_dev_run=2 with trainer.resume={resume}: a check run starts fresh and keeps nothing, "
        "so it would resume nothing."
    )
    default = _config("trainer.fast_dev_run=2")  # resume=auto, the default: set aside quietly
    fast_dev_run(default)
    assert default.trainer.resume is None


@pytest.mark.slow
def test_fast_dev_run_runs_every_part_once_and_leaves_no_results(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["trainer.fast_dev_run=2", "callbacks=[best_checkpoints]", "trainer.checkpoint_every=1"]
    done = run_to_end(run_dir, *overrides, "tracker=mlflow", "trainer.plots=true")
    assert "step 1/2: train/loss=" in done.stderr and "step 2/2: eval/loss=" in done.stderr
    assert "trainer.fast_dev_run: everything ran; no results recorded" in done.stderr
    left = {path.name for path in run_dir.iterdir()}
    assert not left & {"checkpoints", "model", "best", "plots", "tracking", "finished.json", "metrics.json"}
    # its dir is not a place for another check run: refused before launch
    again = rank_checks.command(runner_command(run_dir, *overrides), tmp_path, env=cli_env())
    assert again.returncode == 2
    assert f"trainer.fast_dev_run=2 in {run_dir}, the dir of a run" in again.stderr
