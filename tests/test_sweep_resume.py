"""A multirun run again in its sweep dir picks up where it stopped (`hydra/sweeper=runner`, the default):
finished jobs are not run again, an interrupted one resumes from its checkpoint, the rest run; another
sweep in that dir is refused; `sweep.resume=false` starts over."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rank_checks
from conftest import cli_env, wait_for_delivery
from mlflow import MlflowClient

pytestmark = pytest.mark.slow

LRS = "optimizer.lr=1e-2,5e-3,2e-3,1e-3,5e-4,2e-4"  # 6 jobs
TRAIN = ["trainer.max_steps=300", "trainer.checkpoint_every=10", "trainer.log_every=10"]


def multirun_command(sweep: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "runner",
        f"hydra.sweep.dir={sweep}",
        "trainer.progress_bar=false", "trainer.plots=false",
        *overrides,
        "-m",
    ]


def multirun(sweep: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        multirun_command(sweep, *overrides), env=cli_env(), cwd=sweep.parent, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def refused_multirun(sweep: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`multirun` for a sweep refused before any job: forked (`rank_checks.command`, 0.3 s)."""
    return rank_checks.command(multirun_command(sweep, *overrides), sweep.parent, env=cli_env())


def snapshot(job_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file under `job_dir` with its modification time and size."""
    return {str(p.relative_to(job_dir)): (p.stat().st_mtime_ns, p.stat().st_size) for p in job_dir.rglob("*")}


def summary_rows(sweep: Path) -> list[dict[str, str]]:
    with open(sweep / "summary.csv") as f:
        return list(csv.DictReader(f))


def test_a_sweep_interrupted_in_its_fourth_job_resumes_it_and_runs_only_what_is_left(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        multirun_command(sweep, *TRAIN, LRS), env=cli_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (sweep / "3" / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "job 4 wrote no checkpoint"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr  # stopped with a checkpoint: run the same command to resume
    # the sweep's command resumes it (a job's own hydra.run.dir would resume it outside its sweep)
    assert "Run the same command with hydra.sweep.dir=sweep to resume" in stderr, stderr
    assert "hydra.run.dir=" not in stderr
    assert [(sweep / str(n) / "metrics.json").exists() for n in range(6)] == [True] * 3 + [False] * 3
    assert not (sweep / "4").exists()
    before = {n: snapshot(sweep / str(n)) for n in range(3)}

    again = multirun(sweep, *TRAIN, LRS)
    assert again.returncode == 0, again.stderr
    assert "job(s) 0, 1, 2 finished before and are not run again" in again.stdout  # Hydra's log: stdout
    assert (
        "Launching 3 jobs locally" in again.stdout and "#3 : " in again.stdout and "#0 : " not in again.stdout
    )
    assert {n: snapshot(sweep / str(n)) for n in range(3)} == before  # not run again: untouched
    assert "resumed from" in (sweep / "3" / "runner.log").read_text()
    for n in (4, 5):
        assert "resumed from" not in (sweep / str(n) / "runner.log").read_text()
    rows = summary_rows(sweep)
    assert [row["job"] for row in rows] == ["0", "1", "2", "3", "4", "5"]
    assert [float(row["optimizer.lr"]) for row in rows] == [1e-2, 5e-3, 2e-3, 1e-3, 5e-4, 2e-4]
    assert all(row["train/loss"] for row in rows)

    # one MLflow parent run for the sweep, over both commands: a child run per job, and closed at the end
    parent = json.loads((sweep / "tracking" / "parent.json").read_text())
    for job in sorted(path.parent.parent for path in sweep.glob("*/tracking/events.jsonl")):
        wait_for_delivery(job)
    client = MlflowClient(parent["uri"])
    children = client.search_runs(
        [client.get_run(parent["run_id"]).info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent['run_id']}'",
    )
    assert len(children) == 6 and all(run.info.status == "FINISHED" for run in children)
    assert client.get_run(parent["run_id"]).info.status == "FINISHED"

    # all done: a third run launches nothing and writes the same summary
    third = multirun(sweep, *TRAIN, LRS)
    assert third.returncode == 0, third.stderr
    assert "job(s) 0, 1, 2, 3, 4, 5 finished before" in third.stdout
    assert summary_rows(sweep) == rows


def test_another_sweep_in_the_dir_is_refused_naming_the_difference_and_resume_false_starts_over(tmp_path):
    sweep = tmp_path / "sweep"
    first = multirun(sweep, "trainer.max_steps=5", "tracker=none", "optimizer.lr=1e-3,1e-4")
    assert first.returncode == 0, first.stderr
    job0 = snapshot(sweep / "0")

    changed = refused_multirun(sweep, "trainer.max_steps=5", "tracker=none", "optimizer.lr=1e-3,3e-4,1e-5")
    assert changed.returncode == 2, changed.stderr
    message = changed.stderr.strip()
    assert message.startswith(
        f"Configuration error: hydra.sweep.dir={sweep} holds another sweep: it had 2 job(s), "
    )
    assert "job 1 had optimizer.lr=0.0001 where this one has optimizer.lr=0.0003" in message
    assert "sweep.resume=false" in message and "Traceback" not in changed.stderr
    assert not (sweep / "2").exists() and snapshot(sweep / "0") == job0  # nothing ran

    steps = refused_multirun(
        sweep, "trainer.max_steps=6", "tracker=none", "optimizer.lr=1e-3,1e-4"
    )  # same values, other steps
    assert (
        steps.returncode == 2
        and "job 0 had trainer.max_steps=5 where this one has trainer.max_steps=6" in steps.stderr
    )

    record = (sweep / "sweep.json").read_text()
    (sweep / "sweep.json").write_text(record[: len(record) // 2])  # cut short
    cut = refused_multirun(sweep, "trainer.max_steps=5", "tracker=none", "optimizer.lr=1e-3,1e-4")
    assert cut.returncode == 2 and "Traceback" not in cut.stderr, cut.stderr
    assert cut.stderr.strip().startswith(
        f"Configuration error: hydra.sweep.dir={sweep}: its sweep.json cannot be read (JSONDecodeError: "
    )

    over = multirun(
        sweep, "trainer.max_steps=5", "tracker=none", "optimizer.lr=1e-3,3e-4,1e-5", "sweep.resume=false"
    )
    assert over.returncode == 0, over.stderr
    replaced = list(sweep.glob("replaced-*"))
    assert len(replaced) == 1 and sorted(p.name for p in replaced[0].iterdir()) == ["0", "1"]
    assert snapshot(replaced[0] / "0") == job0  # kept, moved aside
    assert [row["optimizer.lr"] for row in summary_rows(sweep)] == ["0.001", "0.0003", "1e-05"]
    assert "resumed from" not in (sweep / "0" / "runner.log").read_text()  # a fresh job in a fresh dir


def test_a_sweep_started_in_the_same_second_as_another_takes_a_dir_of_its_own_and_ranks_by_direction(
    tmp_path,
):
    """A time-stamped sweep dir (the default's `${now:...}`) names a new sweep: one started in the same
    second (here: year) as the sweep in `<year>` takes `<year>_1` and leaves that one alone. Its summary
    ranks the jobs by `sweep.direction` (maximize: the highest eval/loss first)."""
    taken = tmp_path / time.strftime("%Y")
    taken.mkdir()
    (taken / "sweep.json").write_text("another sweep's record, being written\n")
    proc = multirun(
        tmp_path / "${now:%Y}", "trainer.max_steps=5", "tracker=none", "optimizer.lr=1e-4,1e-2",
        "sweep.direction=maximize",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in taken.iterdir()] == ["sweep.json"]
    rows = summary_rows(tmp_path / f"{taken.name}_1")
    assert [row["optimizer.lr"] for row in rows] == ["0.0001", "0.01"]
    best = max(rows, key=lambda row: float(row["eval/loss"]))
    assert rows[0]["eval/loss"] != rows[1]["eval/loss"] and best["rank (eval/loss)"] == "1"
    assert f"best: job {best['job']} (optimizer.lr={best['optimizer.lr']}): eval/loss=" in proc.stdout + proc.stderr


def test_a_diverging_job_is_recorded_and_the_sweep_goes_on_and_fails_at_the_end(tmp_path):
    """Job 1's learning rate makes its loss NaN: it stops (as a run would), jobs 0 and 2 still run, the
    summary has a row for each with its status, its MLflow run is FAILED, and the command exits 1 naming it."""
    sweep = tmp_path / "sweep"
    proc = multirun(sweep, "trainer.max_steps=20", "optimizer.lr=1e-3,1e6,1e-4")
    assert proc.returncode == 1, proc.stderr
    assert (
        "1 of 3 job(s) failed: job 1 (Training stopped: train/loss=nan at step 10"
        in proc.stdout + proc.stderr
    )
    rows = summary_rows(sweep)
    assert [(row["job"], row["status"]) for row in rows] == [
        ("0", "finished"),
        ("1", "failed"),
        ("2", "finished"),
    ]
    assert rows[0]["train/loss"] and rows[2]["train/loss"] and not rows[1]["train/loss"]
    parent = json.loads((sweep / "tracking" / "parent.json").read_text())
    for job in sorted(path.parent.parent for path in sweep.glob("*/tracking/events.jsonl")):
        wait_for_delivery(job)
    client = MlflowClient(parent["uri"])
    children = client.search_runs(
        [client.get_run(parent["run_id"]).info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent['run_id']}'",
    )
    assert sorted(run.info.status for run in children) == ["FAILED", "FINISHED", "FINISHED"]


def test_a_sweep_whose_yaml_changed_is_refused_and_one_with_its_own_subdirs_resumes(tmp_path):
    """The overrides alone do not say what a job ran: an edited experiment YAML composes other jobs under
    the same command, refused naming the setting. Jobs in dirs named by a pattern of the user's
    (`hydra.sweep.subdir`) are found finished there, not retrained."""
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\noptimizer:\n  weight_decay: 0.01\n")
    sweep = tmp_path / "sweep"
    command = [
        *("--config-dir", str(tmp_path / "conf"), "experiment=mine", "tracker=none", "trainer.max_steps=5"),
        "hydra.sweep.subdir=${hydra.job.override_dirname}",
        "trainer.seed=1,2",
    ]
    first = multirun(sweep, *command)
    assert first.returncode == 0, first.stderr
    job_dirs = sorted(path.parent for path in sweep.glob("*/metrics.json"))
    assert len(job_dirs) == 2 and all("trainer.seed=" in path.name for path in job_dirs)
    before = {path: snapshot(path) for path in job_dirs}

    again = multirun(sweep, *command)
    assert again.returncode == 0, again.stderr
    assert "job(s) 0, 1 finished before and are not run again" in again.stdout
    assert {path: snapshot(path) for path in job_dirs} == before  # not retrained

    (conf / "mine.yaml").write_text("# @package _global_\noptimizer:\n  weight_decay: 0.1\n")
    edited = multirun(sweep, *command)
    assert edited.returncode == 2, edited.stderr
    message = edited.stderr.strip()
    assert message.startswith(
        f"Configuration error: hydra.sweep.dir={sweep} holds this sweep's jobs composed with"
    )
    assert (
        "job 0: optimizer.weight_decay=0.01 there, 0.1 here" in message and "Traceback" not in edited.stderr
    )
    assert {path: snapshot(path) for path in job_dirs} == before
