"""Callbacks in the loop (`callbacks=[...]`, `runner.callbacks`): each built-in changes what a run does or
leaves (early stopping stops at the evaluation its metric says, the best checkpoints are exactly the best,
the learning rates are logged, the curves are drawn from the run's history), a user's callback is called at
every named point, and every callback's state resumes with the run. Bad settings are refused before
launch."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import probes
import pytest
from conftest import cli_env, run_to_end, runner_command
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from PIL import Image

from runner.callbacks import (
    EarlyStopping,
    GoodputLedger,
    HangWatchdog,
    MixtureShares,
    PlotCurves,
    ProfileSteps,
    ProgressBar,
    RankMetrics,
    RecordHistory,
    built_callbacks,
)
from runner.callbacks.ranks import stragglers
from runner.config import CONF_DIR, ProfileConfig, TrainerConfig
from runner.errors import ConfigError
from runner.group_schemas import register_configs
from runner.telemetry.goodput import Ledger, read_ledger
from runner.telemetry.history import History, read_history
from runner.telemetry.plots import curve, draw_run, marks, run_figures, sweep_figures
from runner.validate import check_job

TESTS = Path(__file__).parent
# Evaluations every 5 steps. Early stopping in mode max on eval/loss (which falls): the first evaluation is
# the best, and with patience 4 the run stops at the fifth, step 25 of 30. The best 2 by eval/loss (min).
RUN = [
    "callbacks=[early_stopping,best_checkpoints,lr_monitor]",
    "callbacks.early_stopping.mode=max",
    "callbacks.early_stopping.patience=4",
    "callbacks.best_checkpoints.keep=2",
    "+callbacks.probe._target_=probes.RecordingCallback",
    "trainer.eval_every=5",
    "trainer.log_every=5",
    "trainer.checkpoint_every=10",
    "trainer.keep_checkpoints=null",
    "scheduler=constant",  # the same learning rates whatever max_steps
    "trainer.plots=true",
]


def _evaluations(run_dir: Path) -> dict[int, float]:
    """Step -> eval/loss, from the run's log."""
    found = re.findall(r"step (\d+)/\d+: eval/loss=([\d.e-]+)", (run_dir / "runner.log").read_text())
    return {int(step): float(value) for step, value in found}


def _best(run_dir: Path) -> list[tuple[int, float]]:
    record = json.loads((run_dir / "best" / "best.json").read_text())
    assert record["monitor"] == "eval/loss" and record["mode"] == "min"
    assert all(Path(e["path"]) == run_dir / "best" / f"step_{e['step']}" for e in record["best"])
    return [(e["step"], e["value"]) for e in record["best"]]


@pytest.mark.slow
def test_callbacks_stop_keep_the_best_log_and_resume_their_state(tmp_path):
    whole = tmp_path / "whole"
    done = run_to_end(
        whole, *RUN, f"+callbacks.probe.record={whole / 'probe'}", "trainer.max_steps=30", pythonpath=TESTS
    )
    evaluations = _evaluations(whole)
    assert sorted(evaluations) == [5, 10, 15, 20, 25]  # stopped at the fifth evaluation
    assert "stopped at step 25/30: early stopping: eval/loss=" in done.stderr
    assert json.loads((whole / "finished.json").read_text())["step"] == 25
    # the best 2 by eval/loss, exactly, and nothing else in best/
    ranked = sorted(evaluations.items(), key=lambda e: e[1])[:2]
    assert [step for step, _ in _best(whole)] == [step for step, _ in ranked]
    assert sorted(p.name for p in (whole / "best").iterdir()) == sorted(
        ["best.json", *(f"step_{step}" for step, _ in ranked)]
    )
    assert (whole / "best" / f"step_{ranked[0][0]}" / "meta.json").is_file()  # a whole checkpoint
    metrics = json.loads((whole / "metrics.json").read_text())
    assert metrics["lr/0_group0"] == metrics["train/lr"]
    # the curves: drawn at the end (named on the console), from the history of every logged step
    pictures = sorted((whole / "plots").glob("*.png"))
    assert [p.stem for p in pictures] == ["eval", "loss", "lr", "throughput"]
    assert all(Image.open(p).format == "PNG" for p in pictures)
    assert "plots: whole/plots/{eval,loss,lr,throughput}.png\n" in done.stderr  # relative to the working dir
    assert [row["step"] for row in read_history(whole) if "eval/loss" in row] == [5, 10, 15, 20, 25]
    points = [line.split("|")[0] for line in probes.read(whole / "probe", "callback")]
    assert points[0] == "fit_start" and points[-1] == "fit_end"
    assert probes.read(whole / "probe", "gc") == ["collecting"]  # paused for the command's imports only
    assert points.count("step_end") == 25 and points.count("eval_end:eval/loss,eval/mae") == 5
    logged = [point for point in points if point.startswith("log:")]
    assert sum("train/loss" in point for point in logged) == 5 and "log:eval/loss,eval/mae" in logged
    assert sum(point.startswith("log:lr/") for point in logged) == 5  # lr_monitor's, at each logging step
    assert [p for p in points if p.startswith("checkpoint")] == [
        "checkpoint:checkpoint_0",
        "checkpoint:checkpoint_1",
    ]

    # Stopped at step 20 (early stopping 3 evaluations into its patience, the best 2 so far kept) and run
    # on: it stops at 25 too, with the same best checkpoints and the same weights.
    parts = tmp_path / "parts"
    probe = [f"+callbacks.probe.record={parts / 'probe'}"]
    run_to_end(parts, *RUN, *probe, "trainer.max_steps=20", pythonpath=TESTS)
    resumed = run_to_end(parts, *RUN, *probe, "trainer.max_steps=30", pythonpath=TESTS)
    assert "stopped at step 25/30" in resumed.stderr
    assert _best(parts) == _best(whole)
    assert (parts / "model" / "model.safetensors").read_bytes() == (
        whole / "model" / "model.safetensors"
    ).read_bytes()
    # the resumed run's history holds each step once (the steps past the checkpoint logged again)
    assert [row["step"] for row in read_history(parts) if "train/loss" in row] == [5, 10, 15, 20, 25]
    # the callback's state is the one saved at step 20: its calls counted on from there
    lines = [line.split("|") for line in probes.read(parts / "probe", "callback")]
    saved = next(int(n) for point, step, n in lines if point.startswith("eval_end") and step == "20")
    assert [line for line in lines if line[0] == "fit_start"][1] == ["fit_start", "20", str(saved + 1)]


@pytest.mark.slow
def test_a_best_checkpoint_is_deleted_only_once_a_checkpoint_records_its_successor(tmp_path):
    """keep=1: step_30 is the best when checkpoint_0 (step 40) records the list; step_60 beats it; the run
    is killed at step 65, before checkpoint_1. Its resume from checkpoint_0 still has step_30 (which that
    state lists) and ends with the best/ of an uninterrupted run."""
    gate = tmp_path / "gate"
    best = ["callbacks=[best_checkpoints]", "trainer.eval_every=30", "trainer.checkpoint_every=40",
            "trainer.max_steps=90", "trainer.keep_checkpoints=null", "scheduler=constant"]  # fmt: skip
    whole = tmp_path / "whole"
    run_to_end(whole, *best)
    held = ["task._target_=faulty_tasks.WaitAtStep", f"+task.gate={gate}", "+task.step=65"]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        runner_command(run_dir, *best, *held), env=cli_env(TESTS), stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while not (run_dir / "best" / "step_60" / "meta.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "step_60 was never kept"
        time.sleep(0.05)
    time.sleep(0.5)  # the run waits at step 65 for the gate: the tidy after step_60's save is done
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = sorted(p.name for p in (run_dir / "best").iterdir())
    assert kept == ["best.json", "step_30", "step_60"], kept  # step_30: checkpoint_0 still lists it
    gate.touch()
    resumed = run_to_end(run_dir, *best, *held, pythonpath=TESTS)
    assert "resumed from" in (run_dir / "runner.log").read_text(), resumed.stderr
    assert _best(run_dir) == _best(whole)
    assert sorted(p.name for p in (run_dir / "best").iterdir()) == sorted(p.name for p in (whole / "best").iterdir())


@pytest.mark.slow
def test_a_run_a_callback_stops_before_its_first_evaluation_evaluates_and_exits_0(tmp_path):
    """A callback's stop at step 20 of 200 (the first evaluation due at 100): the run evaluates there, as at
    its end, so its objective (eval/loss) is among the final metrics and it exits 0."""
    run_dir = tmp_path / "run"
    done = run_to_end(
        run_dir, "+callbacks.stop._target_=probes.StopAtStep", "+callbacks.stop.at=20", pythonpath=TESTS
    )
    assert "stopped at step 20/200: step 20 reached" in done.stderr
    assert sorted(_evaluations(run_dir)) == [20]
    final = json.loads((run_dir / "metrics.json").read_text())
    assert final["eval/loss"] == pytest.approx(_evaluations(run_dir)[20], rel=1e-3)
    assert json.loads((run_dir / "finished.json").read_text())["step"] == 20


@pytest.mark.parametrize(("min_delta", "stops_at"), [(0.0, None), (0.1, 3)])
def test_early_stopping_counts_only_improvements_by_more_than_min_delta(min_delta, stops_at):
    """eval/loss falls by 0.05 per evaluation: every fall is an improvement with min_delta 0; with 0.1
    none is, and patience 2 stops the run at the third evaluation."""
    register_configs()
    overrides = ["callbacks=[early_stopping]", "callbacks.early_stopping.patience=2"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"callbacks.early_stopping.min_delta={min_delta}"])
    stopping = instantiate(cfg.callbacks.early_stopping)
    stopped: list[int] = []
    for evaluation, loss in enumerate([1.0, 0.95, 0.9, 0.85], start=1):
        run = SimpleNamespace(stop=lambda reason, at=evaluation: stopped.append(at))
        stopping.on_eval_end(run, {"eval/loss": loss})
    assert stopped[:1] == ([stops_at] if stops_at else [])


def test_early_stopping_warns_where_the_run_has_too_few_evaluations_left_to_stop(caplog):
    """3 evaluations before step 200 (every 50) and patience 3: 4 are needed. Not refused: a run continued
    longer may have them."""
    run = SimpleNamespace(settings=SimpleNamespace(eval_every=50), total_steps=200, step=0)
    with caplog.at_level(logging.WARNING, logger="runner.callbacks"):
        EarlyStopping(patience=3).on_fit_start(run)
        assert (
            "early stopping cannot stop this run: it evaluates 3 more time(s) before its last step "
            "(trainer.eval_every=50, 200 steps) and needs 4 (patience=3) to stop it. Evaluate more often "
            "(trainer.eval_every<=49) or lower the patience." in caplog.text
        )
        caplog.clear()
        EarlyStopping(patience=3).on_fit_start(SimpleNamespace(settings=run.settings, total_steps=201, step=0))
        resumed = EarlyStopping(patience=3)
        resumed.load_state_dict({"best": 0.5, "waited": 2})  # one more evaluation without improvement stops
        resumed.on_fit_start(SimpleNamespace(settings=run.settings, total_steps=200, step=140))
    assert caplog.text == ""  # 4 evaluations before step 201; 1 before 200 from step 140, and 1 needed


REFUSED = {
    ("callbacks=[early_stopping]", "callbacks.early_stopping.monitor=eval/accuracy"): (
        "callbacks.early_stopping.monitor=eval/accuracy: the task reports no such eval metric; after each "
        "evaluation the run has eval/loss, eval/mae"
    ),
    ("callbacks=[best_checkpoints]", "callbacks.best_checkpoints.mode=bogus"): (
        "callbacks.best_checkpoints.mode='bogus': expected min"
    ),
    (
        "callbacks=[early_stopping]",
        "callbacks.early_stopping.patience=0",
    ): "callbacks.early_stopping.patience=0",
    (
        "+callbacks.mine._target_=nowhere.Callback",
    ): "callbacks.mine._target_='nowhere.Callback' cannot be imported",
    ("callbacks=[early_stopping]", "trainer.eval_every=0"): (
        "callbacks.early_stopping: trainer.eval_every=0, so the run never evaluates while it trains and early "
        "stopping (which decides on evaluations) could never stop it."
    ),
    ("callbacks=[lr_monitor]", "+callbacks.lr_monitor.every=3"): (
        "callbacks.lr_monitor: runner.callbacks.LearningRateMonitor does not accept these settings"
    ),
}


@pytest.mark.parametrize("overrides", list(REFUSED), ids=lambda o: o[-1])
def test_callback_settings_that_cannot_work_are_refused_before_launch(overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "tracker=none"])
    with pytest.raises(ConfigError) as refused:
        check_job(cfg)
    assert REFUSED[overrides] in str(refused.value), str(refused.value)


def test_the_history_keeps_each_step_once_and_the_figures_draw_what_it_holds(tmp_path):
    history = History(tmp_path)
    for step in (10, 20, 30):
        history.add(step, {"train/loss": 1.0 / step, "train/lr": 0.1, "perf/samples_per_s": 100.0 + step})
    history.add(30, {"eval/loss": 0.5, "eval/accuracy": float("nan")})
    history.resume_at(20)  # a resumed run drops what it logs again
    history.add(30, {"train/loss": 0.02, "train/lr": 0.05, "perf/samples_per_s": 99.0})
    history.add(30, {"eval/loss": 0.4, "eval/accuracy": 0.75})
    with open(tmp_path / "history.jsonl", "a") as f:
        f.write('{"step": 40, "train/lo')  # a line cut by a kill
    rows = read_history(tmp_path)
    assert curve(rows, "train/loss") == ([10, 20, 30], [0.1, 0.05, 0.02])
    assert curve(rows, "eval/loss") == ([30], [0.4])
    figures = run_figures(rows)
    assert sorted(figures) == ["eval", "loss", "lr", "throughput"]
    (losses,) = figures["loss"].axes
    assert [line.get_label() for line in losses.lines] == ["train/loss", "eval/loss"]
    assert list(losses.lines[0].get_xdata()) == [10, 20, 30] and list(losses.lines[0].get_ydata()) == [
        0.1,
        0.05,
        0.02,
    ]
    assert [axes.get_title() for axes in figures["eval"].axes] == ["eval/accuracy"]
    assert list(figures["throughput"].axes[0].lines[0].get_ydata()) == [110.0, 120.0, 99.0]
    mixture = [
        {"step": 5, "data/share/a": 0.6, "data/share/b": 0.4, "data/weight/a": 0.7, "data/weight/b": 0.3},
        {"step": 5, "eval/loss": 2.0, "eval/loss/a": 1.5, "eval/loss/b": 3.0, "eval/accuracy": 0.5, "eval/accuracy/a": 0.6},
    ]  # fmt: skip
    figures = run_figures(mixture)
    assert [axes.get_title() for axes in figures["eval"].axes] == [
        "eval/loss, eval/loss/a, eval/loss/b", "eval/accuracy, eval/accuracy/a"
    ]  # fmt: skip
    assert [axes.get_title() for axes in figures["mixture"].axes] == [
        "data/share/a, data/weight/a", "data/share/b, data/weight/b"
    ]  # fmt: skip
    nan = History(tmp_path / "nan")
    (tmp_path / "nan").mkdir()
    nan.add(5, {"train/loss": float("inf")})
    assert read_history(tmp_path / "nan") == [{"step": 5, "train/loss": float("inf")}]


class _Run:
    """The little of a run PlotCurves reads: its dir and that this is the main process."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.engine = SimpleNamespace(is_main_process=True)


def _drawing(tmp_path: Path) -> tuple[PlotCurves, _Run, History]:
    plots, run, history = PlotCurves(), _Run(tmp_path), History(tmp_path)
    history.add(5, {"train/loss": 0.5, "train/lr": 0.1})
    plots.spare_core, plots.every_s = True, 0.0  # a drawing at every evaluation
    plots.on_fit_start(run)
    return plots, run, history


def test_one_process_started_with_the_training_draws_at_evaluations_and_the_whole_history_at_the_end(
    tmp_path, caplog
):
    """The drawer starts with the training (matplotlib imported while the run trains), draws at an
    evaluation without the loop waiting, and at the end draws again what was logged since: the run waits
    for that one and names the files. One process for all of it, gone at the end."""
    plots, run, history = _drawing(tmp_path)
    drawer = plots.drawer
    history.add(10, {"train/loss": 0.25, "eval/loss": 0.3})
    plots.on_eval_end(run, {"eval/loss": 0.3})
    assert plots.asked and plots._answered(wait=True) and "drawn" in plots.answer
    history.add(20, {"train/loss": 0.125})  # logged after that drawing started: drawn again at the end
    with caplog.at_level(logging.INFO, logger="runner.callbacks"):
        plots.on_fit_end(run, {})
    pictures = sorted(map(str, (tmp_path / "plots").glob("*.png")))
    assert [Path(p).stem for p in pictures] == ["loss", "lr"]
    assert f"plots: {tmp_path / 'plots'}/{{loss,lr}}.png" in caplog.text  # not under the working dir
    assert drawer.returncode == 0 and plots.drawer is None  # the one process, ended
    whole = tmp_path / "whole" / tmp_path.name  # the whole history drawn here (a dir of the run's name): the same pictures
    whole.mkdir(parents=True)
    shutil.copy(tmp_path / "history.jsonl", whole)
    assert [p.read_bytes() for p in draw_run(whole)] == [Path(p).read_bytes() for p in pictures]
    # The run's trainer.plots_log_scale (its resolved config): the losses on a log scale, the rates as they were.
    (whole / "resolved_config.yaml").write_text("trainer:\n  plots_log_scale: true\n")
    assert [p.read_bytes() == Path(q).read_bytes() for p, q in zip(draw_run(whole), pictures, strict=True)] == [False, True]
    log_scaled = run_figures(read_history(whole), log_scale=True)
    assert [axes.get_yscale() for axes in log_scaled["loss"].axes + log_scaled["lr"].axes] == ["log", "linear"]


@pytest.mark.parametrize("failure", ["a file where plots/ goes", "the drawer killed"])
def test_a_drawing_that_fails_is_a_warning_that_says_why_and_the_run_ends_as_it_would(
    tmp_path, caplog, failure
):
    plots, run, _ = _drawing(tmp_path)
    if failure == "the drawer killed":
        plots.drawer.kill()
        said = "the drawing process ended (exit -9)"
    else:
        (tmp_path / "plots").write_text("not a dir")
        said = "the plots could not be drawn: FileExistsError"
    with caplog.at_level(logging.INFO, logger="runner.callbacks"):
        plots.on_fit_end(run, {})
    assert said in caplog.text and "plots: " not in caplog.text
    assert plots.drawer is None


def test_a_sweeps_pictures_rank_its_jobs_by_the_objective_and_mark_the_best():
    jobs = {"0": {"optimizer.lr": "1e-3"}, "1": {"optimizer.lr": "1e-2"}, "2": {"optimizer.lr": "1e-1"}}
    results = {"0": 0.3, "1": 0.1, "2": None}  # job 2 failed
    histories = {
        name: [{"step": s, "train/loss": s * (int(name) + 1.0)} for s in (5, 10)]
        + [{"step": 10, "eval/loss": 1.0}]
        for name in jobs
    }
    figures = sweep_figures(jobs, "eval/loss", results, "minimize", histories)
    (summary,) = figures["summary"].axes
    line, star = summary.lines
    assert list(line.get_xdata()) == [1e-3, 1e-2] and list(line.get_ydata()) == [0.3, 0.1]
    assert list(star.get_xdata()) == [1e-2] and star.get_label() == "best: job 1"
    losses, objective = figures["curves"].axes
    assert [line.get_label().split(":")[0] for line in losses.lines] == ["job 1", "job 0", "job 2"]
    assert [line.get_linewidth() for line in losses.lines] == [2.5, 1.0, 1.0]  # the best bold
    assert len(objective.lines) == 3
    maximized = sweep_figures(jobs, "eval/loss", results, "maximize", histories)
    assert maximized["summary"].axes[0].lines[1].get_label() == "best: job 0"


def test_a_plain_class_with_one_callback_method_is_called_there_and_checkpointed_without_state(tmp_path):
    """...and a built-in the YAML sets to null is off: `plots` here, with trainer.plots=true, and `goodput`
    (the ledger keeps the phases before the loop, and none of the loop's)."""
    record = tmp_path / "steps.txt"
    run_to_end(
        tmp_path / "run", "+callbacks.mine._target_=probes.OnlyStepEnd", f"+callbacks.mine.record={record}",
        "trainer.max_steps=6", "trainer.checkpoint_every=3", "trainer.eval_every=0", "trainer.plots=true",
        "+callbacks.plots=null", "+callbacks.goodput=null", pythonpath=TESTS,
    )  # fmt: skip
    assert record.read_text().split() == ["1", "2", "3", "4", "5", "6"]
    assert not (tmp_path / "run" / "plots").exists()
    phases = {r["phase"] for r in read_ledger(tmp_path / "run")}
    assert {"startup", "data", "setup"} <= phases and not {"warmup", "train", "checkpoint"} & phases


def test_the_loops_own_concerns_are_built_in_callbacks_a_config_replaces_or_switches_off(tmp_path):
    trainer = TrainerConfig(progress_bar=True, plots=True, profile=ProfileConfig(active=2))
    built = built_callbacks(
        None, trainer, ledger=Ledger(tmp_path, time.time(), "startup"), processes=2, mixture={"a": 0.7, "b": 0.3}
    )
    assert {name: type(c) for name, c in built.items()} == {
        "goodput": GoodputLedger, "watchdog": HangWatchdog, "history": RecordHistory, "progress": ProgressBar, "profile": ProfileSteps,
        "plots": PlotCurves, "ranks": RankMetrics, "mixture": MixtureShares,
    }  # fmt: skip
    assert "mixture" not in built_callbacks(None, trainer, mixture={})  # data of one source
    off = TrainerConfig(progress_bar=False, plots=False, hang_timeout_s=0, rank_metrics=False)
    assert list(built_callbacks(OmegaConf.create({"history": None}), off)) == []
    assert list(built_callbacks(None, off, ledger=Ledger(None, time.time(), "startup"))) == ["history"]  # rank > 0
    mine = OmegaConf.create({"progress": {"_target_": "probes.OnlyStepEnd", "record": "x"}, "plots": None})
    built = built_callbacks(mine, trainer, processes=2)
    assert "ranks" not in built_callbacks(mine, trainer)  # a run of one process
    assert {name: type(c).__name__ for name, c in built.items()} == {
        "watchdog": "HangWatchdog", "history": "RecordHistory", "progress": "OnlyStepEnd", "profile": "ProfileSteps",
        "ranks": "RankMetrics",
    }  # fmt: skip
    assert list(built_callbacks(mine, trainer, evaluating=True)) == ["watchdog", "history"]  # mode=evaluate


def test_a_straggler_is_a_rank_whose_extra_data_wait_makes_the_steps_ratio_times_as_long():
    waits = [0.001, 0.002, 0.061, 0.001]  # steps of 0.1 s; rank 2 waits 0.06 s more than the others' median
    assert stragglers(0.1, waits, 1.5) == {2: pytest.approx(0.06)}  # 0.04 s a step without it: 2.5x
    assert stragglers(0.1, waits, 3.0) == {}  # 2.5x is not 3x
    assert stragglers(0.1, [0.02, 0.03, 0.02], 1.5) == {}  # jitter
    assert stragglers(0.1, [0.09, 0.001], 1.5) == {0: pytest.approx(0.089)}  # of two, against the other
    rows = [{"step": 5, "rank/0/data_wait_s": 0.001, "rank/1/data_wait_s": 0.07, "rank/0/step_time_s": 0.08}]
    (waits_panel, steps_panel) = run_figures(rows)["ranks"].axes
    assert waits_panel.get_title() == "data_wait_s by rank" and steps_panel.get_title() == "step_time_s by rank"
    assert [line.get_label() for line in waits_panel.lines] == ["rank 0", "rank 1"]
    assert list(waits_panel.lines[1].get_ydata()) == [0.07]


def test_the_pictures_name_the_run_and_mark_where_it_resumed_restarted_or_rolled_back(tmp_path):
    run_dir = tmp_path / "named"
    steps = ("tracker=none", "trainer.checkpoint_every=10", "trainer.log_every=5", "trainer.eval_every=10")
    run_to_end(run_dir, *steps, "trainer.max_steps=20")
    run_to_end(run_dir, *steps, "trainer.max_steps=40")  # continues from step 20
    assert marks(read_ledger(run_dir)) == [(20, "resumed")]
    figures = run_figures(read_history(run_dir), "named", marks(read_ledger(run_dir)))
    assert figures["loss"].get_suptitle() == "named"
    (losses,) = figures["loss"].axes
    assert [line.get_label() for line in losses.lines[:2]] == ["train/loss", "eval/loss"]
    assert list(losses.lines[2].get_xdata()) == [20, 20] and losses.texts[0].get_text() == "resumed"
    assert {p.stem for p in draw_run(run_dir)} == {"eval", "loss", "lr", "throughput"}
    restore = {"phase": "restore", "t0": 0.0, "t1": 0.0}
    records = [
        {**restore, "resumed_at": 0},  # the first attempt
        {**restore, "resumed_at": 30, "rolled_back_from": 36},
        {"phase": "rendezvous", "t0": 0.0, "t1": 0.0, "before": "restart"},  # a failed attempt's ranks restarted
        {**restore, "resumed_at": 40},
        {**restore, "resumed_at": 50},  # a later command resumed it
    ]
    assert marks(records) == [(30, "rolled back"), (40, "restarted"), (50, "resumed")]


def test_a_categorical_setting_is_one_position_per_value_however_many_jobs_share_it():
    """precision=fp32,bf16 x 2 learning rates: 2 categories on the precision panel, not 4 positions."""
    jobs = {
        str(n): {"precision": p, "optimizer.lr": lr}
        for n, (p, lr) in enumerate([("fp32", "1e-3"), ("fp32", "1e-2"), ("bf16", "1e-3"), ("bf16", "1e-2")])
    }
    results = {"0": 0.4, "1": 0.2, "2": 0.3, "3": 0.1}
    figures = sweep_figures(jobs, "eval/loss", results, "minimize", {})
    precision, lr = figures["summary"].axes
    assert [label.get_text() for label in precision.get_xticklabels()] == ["bf16", "fp32"]  # ranked: bf16 best
    points, star = precision.lines
    assert sorted(zip(points.get_xdata(), points.get_ydata(), strict=True)) == [(0, 0.1), (0, 0.3), (1, 0.2), (1, 0.4)]
    assert list(star.get_xdata()) == [0] and star.get_label() == "best: job 3"
    assert sorted(set(lr.lines[0].get_xdata())) == [1e-3, 1e-2]


def test_plots_of_a_sweep_dir_draw_the_sweeps_pictures_and_each_jobs_and_a_dir_of_neither_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "runner", f"hydra.sweep.dir={sweep}", "trainer.progress_bar=false",
               "trainer.plots=false", "tracker=none", "trainer.max_steps=10", "trainer.eval_every=5",
               "trainer.log_every=5", "precision=fp32,bf16", "-m"]  # fmt: skip
    swept = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert swept.returncode == 0, swept.stderr
    drawn = {sweep / "summary.png": (sweep / "summary.png").read_bytes()}
    for picture in drawn:
        picture.unlink()
    (sweep / "curves.png").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "runner.telemetry.plots", str(sweep)], env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.split()
    for job in ("0", "1"):
        assert str(sweep / job / "plots" / "loss.png") in printed and (sweep / job / "plots" / "loss.png").exists()
    assert str(sweep / "summary.png") in printed and str(sweep / "curves.png") in printed
    assert (sweep / "summary.png").read_bytes() == drawn[sweep / "summary.png"]  # as the sweep drew it
    assert Image.open(sweep / "curves.png").size[0] > 0
    neither = tmp_path / "empty"
    neither.mkdir()
    refused = subprocess.run(
        [sys.executable, "-m", "runner.telemetry.plots", str(neither)], env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and f"{neither} is neither a run's dir (no history.jsonl) nor a sweep's" in refused.stderr
    assert list(neither.iterdir()) == []  # no empty plots/ left


def test_eval_at_start_evaluates_the_untrained_model_at_step_0_and_trains_the_same(run_cli, tmp_path):
    short = ("trainer.max_steps=10", "trainer.eval_every=0", "tracker=none", "trainer.plots=false")
    first = run_cli(*short, "trainer.eval_at_start=true")
    assert first.returncode == 0, first.stderr
    assert re.search(r"^step 0/10: eval/loss=", first.stderr, re.MULTILINE)
    rows = [json.loads(line) for line in (first.run_dir / "history.jsonl").read_text().splitlines()]
    evals = [(row["step"], row["eval/loss"]) for row in rows if "eval/loss" in row]
    assert [step for step, _ in evals] == [0, 10] and evals[0][1] > evals[1][1]  # before any training

    plain = run_cli(*short, f"hydra.run.dir={tmp_path / 'plain'}")
    assert plain.returncode == 0 and "step 0/10" not in plain.stderr, plain.stderr
    last = [json.loads(line) for line in (tmp_path / "plain" / "history.jsonl").read_text().splitlines()]
    assert [r for r in rows if "train/loss" in r][-1]["train/loss"] == [r for r in last if "train/loss" in r][-1]["train/loss"]


def test_eval_train_batches_evaluates_a_fixed_training_sample_beside_each_evaluation(tmp_path):
    """trainer.eval_train_batches=2: eval_train/loss beside eval/loss at every evaluation (step 0 too),
    over the same sample on 1 and 2 processes (split batches: the same loss of the same untrained model);
    the training curve and the checkpoint's files are those of a run without it."""
    common = (
        "trainer.max_steps=10", "trainer.eval_every=5", "trainer.eval_at_start=true", "trainer.log_every=1",
        "trainer.split_batches=true", "trainer.checkpoint_every=10",
    )  # fmt: skip
    runs = {
        "one": ["trainer.eval_train_batches=2"],
        "two": ["trainer.eval_train_batches=2", "hardware=ddp", "hardware.num_processes=2"],
        "without": [],
    }
    rows, files = {}, {}
    for name, overrides in runs.items():
        run_to_end(tmp_path / name, *common, *overrides)
        rows[name] = read_history(tmp_path / name)
        files[name] = sorted(p.name for p in (tmp_path / name / "checkpoints" / "checkpoint_0").iterdir())
    sampled = {name: [(r["step"], r["eval_train/loss"]) for r in rows[name] if "eval_train/loss" in r] for name in rows}
    assert [step for step, _ in sampled["one"]] == [step for step, _ in sampled["two"]] == [0, 5, 10]
    assert sampled["one"][0][1] == pytest.approx(sampled["two"][0][1], rel=1e-6) and not sampled["without"]
    evals = [r["eval/loss"] for r in rows["one"] if "eval/loss" in r]
    assert all(a != b for a, b in zip(evals, [loss for _, loss in sampled["one"]], strict=True))
    assert sampled["one"][-1][1] < sampled["one"][0][1]
    trained = {name: [r["train/loss"] for r in rows[name] if "train/loss" in r] for name in ("one", "without")}
    assert trained["one"] == trained["without"] and files["one"] == files["without"]
