"""`runner runs`: the state of each run in a dir of runs, read from their dirs while they run and after."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import cli_env, runner_command

from runner.cli import runs
from runner.errors import ConfigError

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        runner_command(run_dir, "trainer.max_steps=6", "trainer.log_every=1", *overrides),
        env=cli_env(TESTS),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _listed(capsys, *arguments: str) -> dict[str, list[str]]:
    """`runner runs arguments`' rows by the last part of the run's dir."""
    runs.main(list(arguments))
    lines = capsys.readouterr().out.splitlines()
    return {Path(line.split()[0]).name: line.split() for line in lines[1:]}


def _wait_until(condition, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)


def test_runs_lists_each_run_with_its_state_step_objective_and_differing_overrides(tmp_path, capsys):
    """A finished, a failed, a refused, a stopped (Ctrl-C), a preempted (SIGTERM) and a running run, each
    its state; the steps, the objective and the overrides that differ come from each dir; filters select."""
    root = tmp_path / "outputs"
    gate = tmp_path / "gate"
    held = {
        name: _start(root / name, "task._target_=faulty_tasks.WaitAtStep", f"+task.gate={gate}", "+task.step=3")
        for name in ("stopped", "preempted")
    }
    ended = [_start(root / "finished"), _start(root / "refused", "optimizer.lr=-1")]
    time.sleep(0.05)  # a start time is known to 10 ms (a clock tick): the failed run starts last
    ended.append(_start(root / "failed", "task._target_=faulty_tasks.RaiseAtThirdStep"))
    for proc in ended:
        proc.communicate(timeout=240)
    for name, proc in held.items():  # both at their third step: their dirs are held
        _wait_until(lambda name=name: (root / name / "history.jsonl").is_file(), proc)
    listed = _listed(capsys, str(root))
    assert {name: row[1] for name, row in listed.items()} == {
        "finished": "finished",
        "failed": "failed",
        "refused": "unstarted",
        "stopped": "running",
        "preempted": "running",
    }
    assert listed["finished"][2] == "6/6" and listed["finished"][3].startswith("eval/loss=0.")
    assert listed["failed"][-1] == "task._target_=faulty_tasks.RaiseAtThirdStep"  # what differs, alone
    held["stopped"].send_signal(signal.SIGINT)
    held["preempted"].send_signal(signal.SIGTERM)
    time.sleep(1)  # the loop takes the signal while it waits; it checkpoints at its next step
    gate.touch()
    for proc in held.values():
        assert proc.wait(timeout=120) == 75
    listed = _listed(capsys, str(root))
    assert listed["stopped"][1] == "stopped" and listed["preempted"][1] == "preempted"
    assert set(_listed(capsys, str(root), "--state", "stopped,failed")) == {"stopped", "failed"}
    assert list(_listed(capsys, str(root / "*ed"), "--last", "1")) == ["failed"]  # started last (refused: never)
    with pytest.raises(ConfigError, match="--state done: no state done"):
        runs.main([str(root), "--state", "done"])


def test_compare_prints_the_settings_that_differ_and_overlays_both_runs_curves(tmp_path, capsys, monkeypatch):
    """Two runs that differ in their learning rate: that one setting, and a PNG with a panel for the loss
    and the objective, each with both runs' curves as their histories hold them."""
    from matplotlib.image import imread

    from runner.telemetry.history import read_history
    from runner.telemetry.plots import compare_figure

    slow, fast = tmp_path / "slow", tmp_path / "fast"
    for proc in [_start(slow), _start(fast, "optimizer.lr=0.01")]:
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr
    monkeypatch.chdir(tmp_path)
    runs.main(["compare", "slow", "fast", "--out", "lr.png"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines[:2]] == [["setting", "slow", "fast"], ["optimizer.lr", "0.001", "0.01"]]
    assert lines[2] == "the curves of train/loss, eval/loss: lr.png"
    assert imread(tmp_path / "lr.png").shape[:2] == (560, 700)  # two panels of 7 x 2.8 inches at 100 dpi
    histories = {"slow": read_history(slow), "fast": read_history(fast)}
    for axes in compare_figure(histories, ["train/loss", "eval/loss", "perf/not_logged"]).axes:
        drawn = {line.get_label(): list(line.get_ydata()) for line in axes.get_lines()}
        metric = axes.get_title()
        assert drawn == {run: [row[metric] for row in rows if metric in row] for run, rows in histories.items()}
    runs.main(["compare", "slow", "slow"])
    assert capsys.readouterr().out.startswith("the runs' settings are the same")
    with pytest.raises(ConfigError, match="compare nowhere: not a run's dir"):
        runs.main(["compare", "slow", "nowhere"])
    with pytest.raises(ConfigError, match=r"--out lr.jpg: the picture is a PNG"):
        runs.main(["compare", "slow", "fast", "--out", "lr.jpg"])
