"""`tracker=wandb` and `log_with="wandb"`, for real in W&B's offline mode: each run's W&B file (written by
W&B's own process) is read back record by record. A run killed before W&B wrote its records loses none:
they are in the run's journal and reach W&B by `python -m runner.trackers.upload` or the run's resume.
A tracker of the user's own, by `_target_` in their config dir's tracker/ option, gets every call.
(MLflow and TensorBoard: test_tracking.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rank_checks
import torch
import wandb
from conftest import cli_env, run_to_end, runner_command
from hydra import compose, initialize_config_dir
from wandb.proto import wandb_internal_pb2 as wandb_pb

from runner import Accelerator
from runner.config import CONF_DIR
from runner.errors import ConfigError
from runner.group_schemas import register_configs
from runner.telemetry.history import read_history
from runner.trackers import WandbTracker
from runner.trackers.journal import Journal
from runner.validate import check_job

TESTS = Path(__file__).parent
OFFLINE = ("tracker=wandb", "tracker.mode=offline")
BLOCK = 32 * 1024  # W&B's run file is a LevelDB-style log: records in blocks of 32 KiB after a 7-byte header
FULL, FIRST, LAST = 1, 2, 4


def records(path: Path) -> list:
    """The protobuf records of a W&B run file (`run-<id>.wandb`), whole records only."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    found, position, pieces = [], 7, b""
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:  # a block's tail too short for a header: padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            position += BLOCK - position % BLOCK
            continue
        pieces += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_pb.Record()
            record.ParseFromString(pieces)
            found.append(record)
            pieces = b""
    return found


class WandbRun:
    """What one W&B run file holds: its run record, config, history rows by step, tags, exit code."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config: dict = {}
        self.rows: dict[int, dict] = {}
        self.exit_code: int | None = None
        self.preempting = False
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
            elif kind == "config":
                self.config |= {_key(item): json.loads(item.value_json) for item in record.config.update}
            elif kind == "history":
                row = {_key(item): json.loads(item.value_json) for item in record.history.item}
                self.rows[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
            elif kind == "exit":
                self.exit_code = record.exit.exit_code
            elif kind == "preempting":
                self.preempting = True


def _key(item) -> str:
    """A record item's key (a key with a slash is written as its parts)."""
    return item.key or "/".join(item.nested_key)


def offline_runs(run_dir: Path) -> list[WandbRun]:
    """The run dir's W&B offline runs, oldest first."""
    return [WandbRun(path) for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))]


def written_by_wandb(run_dir: Path, steps: set[int], timeout_s: float = 20.0) -> list[WandbRun]:
    """`offline_runs` once the last holds an exit record and rows at `steps` (W&B's own process may write
    the run's last records just after `finish` returns in this process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = offline_runs(run_dir)
        if runs and runs[-1].exit_code is not None and steps <= set(runs[-1].rows):
            return runs
        if time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def logged(run_dir: Path) -> dict[int, dict]:
    """The run's history.jsonl by step (what runner logged)."""
    rows: dict[int, dict] = {}
    for entry in read_history(run_dir):
        step = int(entry.pop("step"))
        rows.setdefault(step, {}).update(entry)
    return rows


def _measured(row: dict) -> dict:
    """A row without its timings and memory (which differ from run to run)."""
    return {key: value for key, value in row.items() if not key.startswith("perf/")}


@pytest.mark.slow
def test_a_run_is_in_its_wandb_file_with_every_value_at_its_step(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ("trainer.max_steps=10", "trainer.log_every=2", "trainer.eval_every=5")
    run_to_end(run_dir, *OFFLINE, "tracker.tags=[baseline]", "tracker.notes=first try", *overrides)
    (run,) = offline_runs(run_dir)
    assert run.rows == logged(run_dir)  # every logged value at its step, nothing else
    assert sorted(run.rows) == [2, 4, 5, 6, 8, 10]
    assert (
        run.run.display_name == "run" and list(run.run.tags) == ["baseline"] and run.run.notes == "first try"
    )
    assert run.run.project == "runner" and run.exit_code == 0
    assert run.config["trainer"]["max_steps"] == 10  # the resolved config
    facts = run.config["runner"]  # where the run came from
    assert facts["run_dir"] == str(run_dir) and facts["hardware"] == "SingleDevice"
    assert "trainer.max_steps=10" in facts["overrides"]
    assert (run.path.parent / "files" / "resolved_config.yaml").is_file()  # the run's files attached
    delivered = json.loads((run_dir / "tracking" / "wandb" / "delivered.json").read_text())
    assert delivered["run_id"] == run.run.run_id and delivered["delivered"] > 0


@pytest.mark.slow
def test_every_ranks_figures_are_in_the_wandb_file_and_a_slow_rank_is_named_a_straggler(tmp_path):
    """A 2-rank run whose rank 1 takes 1 ms to read each sample (64 a batch): every rank's step time, data
    wait and memory are tracked at each log step, rank 1 is named a straggler once, and the ledger has it."""
    run_dir = tmp_path / "run"
    proc = run_to_end(
        run_dir, *OFFLINE, "hardware=ddp", "hardware.num_processes=2", "trainer.max_steps=20",
        "trainer.log_every=5", "trainer.eval_every=0", "data._target_=probes.SlowRankRegressionData",
        "+data.delay_s=0.001", pythonpath=TESTS,
    )  # fmt: skip
    (run,) = offline_runs(run_dir)
    assert run.rows == logged(run_dir)
    figures = {"step_time_s", "data_wait_s", "peak_host_memory_gb"}  # a CPU device's memory is the host's
    for step in (5, 10, 15, 20):
        row = run.rows[step]
        assert {key for key in row if key.startswith("rank/")} == {f"rank/{r}/{f}" for r in (0, 1) for f in figures}
        assert row["rank/1/data_wait_s"] > 0.05 > 0.01 > row["rank/0/data_wait_s"]  # 64 ms a batch on rank 1
        assert row["rank/0/step_time_s"] == pytest.approx(row["rank/1/step_time_s"], rel=0.1)  # in lockstep
        assert row["rank/1/step_time_s"] > row["rank/1/data_wait_s"]
    said = [line for line in proc.stderr.splitlines() if "straggler" in line]
    assert len(said) == 2 and "rank 1 is a straggler: it waits" in said[0], proc.stderr[-3000:]
    assert "trainer.straggler_ratio=1.5" in said[0] and "stragglers: rank 1 in 4 log window(s)" in said[1]
    lines = proc.stderr.splitlines()
    before = lines[lines.index(said[0]) - 1]  # the warning follows the line of the window it is about
    assert re.search(r"step (5|10|15|20)/20: train/loss", before), proc.stderr[-3000:]
    summary = json.loads((run_dir / "goodput.json").read_text())
    assert summary["straggler_windows"] == 4 and summary["straggler_ranks"] == [1]
    assert summary["straggler_s"] > 15 * 0.05  # the windows' excess wait (each step's at least 50 ms)


@pytest.mark.slow
def test_a_killed_run_loses_no_record_and_its_resume_logs_each_step_once(tmp_path):
    """Killed (-9) at step 13 after its checkpoint of step 8: the journal holds steps 1-12, which the upload
    command gives W&B (the run ends preempted, 75); the resume continues the same W&B run from step 13
    (steps 9-12, logged again from the checkpoint, are not logged twice)."""
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    overrides = (
        *OFFLINE, "trainer.max_steps=20", "trainer.log_every=1", "trainer.eval_every=10", "trainer.checkpoint_every=8",
        "task._target_=faulty_tasks.WaitAtStep", f"+task.gate={gate}", "+task.step=13",
    )  # fmt: skip
    proc = subprocess.Popen(
        runner_command(run_dir, *overrides),
        cwd=tmp_path,
        env=cli_env(TESTS),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    journal = run_dir / "tracking" / "wandb" / "events.jsonl"
    deadline = time.monotonic() + 120
    # The trackers hear step 12 before the callbacks (the history): kill once both have it.
    while not (journal.exists() and '"step": 12' in journal.read_text() and 12 in logged(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 12"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    before = logged(run_dir)
    assert sorted(before) == list(range(1, 13))
    upload = subprocess.run(
        [sys.executable, "-m", "runner.trackers.upload", str(run_dir)],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert upload.returncode == 0, upload.stderr
    uploaded = offline_runs(run_dir)[-1]
    assert uploaded.rows == before and uploaded.exit_code == 75 and uploaded.preempting
    gate.touch()
    done = run_to_end(run_dir, *overrides, pythonpath=TESTS)
    assert "resumed from" in done.stderr
    resumed = offline_runs(run_dir)[-1]
    assert resumed.run.run_id == uploaded.run.run_id  # the same W&B run, continued
    after = logged(run_dir)
    assert sorted(after) == list(range(1, 21))
    same = [step for step in range(1, 13) if _measured(after[step]) == _measured(before[step])]
    assert same == list(range(1, 13))  # bitwise: steps 9-12 trained again from the checkpoint
    assert resumed.rows == {step: after[step] for step in range(13, 21)}
    assert resumed.exit_code == 0
    again = subprocess.run(
        [sys.executable, "-m", "runner.trackers.upload", str(run_dir)],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0 and "nothing to upload" in again.stdout


def test_accelerators_wandb_tracker_takes_accelerates_arguments(tmp_path, monkeypatch):
    """`log_with="wandb"`, `init_trackers(..., init_kwargs={"wandb": ...})`, `get_tracker("wandb",
    unwrap=True)` (the wandb Run), as with Accelerate; `$WANDB_MODE` decides the mode."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    accelerator = Accelerator(cpu=True, log_with="wandb", project_dir=str(tmp_path))
    accelerator.init_trackers(
        "ported", config={"lr": 0.1}, init_kwargs={"wandb": {"tags": ["ported"], "name": "first"}}
    )
    run = accelerator.get_tracker("wandb", unwrap=True)
    assert run.project == "ported" and run.name == "first"
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.log({"loss": torch.tensor(0.5)}, step=1)  # a one-element tensor: its number
    accelerator.log(
        {"loss": 0.25, "scores": wandb.Histogram([1, 2, 2, 3])}, step=2
    )  # W&B's own: to W&B as is
    accelerator.end_training()
    (written,) = written_by_wandb(tmp_path, {0, 1, 2})
    assert written.rows[2].pop("scores/_type") == "histogram"
    assert sum(written.rows[2].pop("scores/values")) == 4 and written.rows[2].pop("scores/bins")
    assert written.rows == {0: {"loss": 1.0}, 1: {"loss": 0.5}, 2: {"loss": 0.25}}
    assert list(written.run.tags) == ["ported"] and written.config["lr"] == 0.1 and written.exit_code == 0


def test_wandb_online_without_a_login_is_refused_before_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["tracker=wandb"])
    with pytest.raises(ConfigError, match=r"this machine has no W&B login .* Run `wandb login`"):
        check_job(cfg)
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    with pytest.raises(ConfigError, match=r"\$WANDB_MODE='dryrun': W&B runs online .* or offline"):
        WandbTracker()
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # a key: online is taken (nothing is sent here)
    assert WandbTracker(mode="online").describe() == "wandb (online) -> project runner"


def test_a_resumed_run_gives_wandb_what_a_killed_process_journaled(tmp_path, monkeypatch):
    """The journal of a process killed before W&B wrote anything (its start, config and 3 steps, no end):
    the next start in the same dir gives W&B those records first, in the same W&B run, then its own."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    killed = WandbTracker(run_name="job")
    killed.journal = Journal(tmp_path / "tracking" / "wandb")
    events = [
        {"op": "start", "id": "abcd1234", "project": "runner", "entity": None, "mode": "offline", "name": "job",
         "group": None, "notes": None, "tags": [], "facts": {}, "dir": str(tmp_path), "init_kwargs": {}},
        {"op": "params", "params": {"lr": 0.1}},
        *({"op": "metrics", "metrics": {"train/loss": 1.0 / step}, "step": step} for step in (1, 2, 3)),
    ]  # fmt: skip
    for event in events:
        killed.journal.append(event)
    resumed = WandbTracker()
    resumed.start(logging_dir=str(tmp_path), resumed_at=2)
    resumed.log({"train/loss": 9.0}, step=3)  # logged by the killed process: not again
    resumed.log({"train/loss": 0.25}, step=4)
    resumed.finish()
    (written,) = written_by_wandb(tmp_path, {1, 2, 3, 4})
    assert written.run.run_id == "abcd1234" and written.config["lr"] == 0.1 and written.exit_code == 0
    assert written.rows == {step: {"train/loss": 1.0 / step} for step in (1, 2, 3, 4)}


@pytest.mark.slow
def test_a_tracker_of_ones_own_by_target_in_a_config_dir_gets_every_call(tmp_path):
    """As Accelerate's `register_tracker_class`: a GeneralTracker subclass named in `<config dir>/tracker/
    file.yaml`, built with its settings (`prefix` reaches it) and called at the run's start, config,
    every logged step and end; a setting it does not take is refused before launch."""
    (tmp_path / "conf" / "tracker").mkdir(parents=True)
    (tmp_path / "conf" / "tracker" / "file.yaml").write_text(
        "_target_: probes.FileTracker\npath: ${hydra:runtime.output_dir}/calls.jsonl\nprefix: mine/\n"
    )
    run_dir = tmp_path / "run"
    mine = ("--config-dir", str(tmp_path / "conf"), "tracker=file")
    run_to_end(run_dir, *mine, "trainer.max_steps=20", "trainer.log_every=5", pythonpath=TESTS)
    calls = [json.loads(line) for line in (run_dir / "calls.jsonl").read_text().splitlines()]
    assert [call["op"] for call in calls] == ["start", "config", *["log"] * 5, "log", "finish"]  # 5 + goodput
    assert calls[1]["max_steps"] == 20
    received: dict[int, dict] = {}
    for call in calls[2:-1]:
        received.setdefault(call["step"], {}).update(call["values"])
    assert received == {
        step: {f"mine/{key}": value for key, value in row.items()} for step, row in logged(run_dir).items()
    }
    typo = rank_checks.command(
        runner_command(tmp_path / "typo", *mine, "+tracker.pathh=x"), tmp_path, env=cli_env(TESTS)
    )
    assert typo.returncode == 2
    assert "tracker: probes.FileTracker does not accept these settings" in typo.stderr
    assert not (tmp_path / "typo" / "resolved_config.yaml").exists()  # no rank started
