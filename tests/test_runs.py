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
