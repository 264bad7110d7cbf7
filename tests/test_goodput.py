"""The goodput ledger's arithmetic, in this process (what its records add up to), and `checkpoint_every_s`.
The runs that write a ledger (an undisturbed one, a restarted one, a killed one continued, a requeued
SLURM job, a SLURM sweep, a restarted hang) are checked where those runs are made: test_resume.py,
test_slurm.py, test_launch.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from conftest import run_to_end

from runner.run_dir import LEDGER
from runner.telemetry.console import goodput_said, metrics_line, shown
from runner.telemetry.goodput import (
    PHASES,
    Ledger,
    job_began,
    process_start_time,
    read_ledger,
    summarize,
    table,
    write_summary,
)


def record(phase: str, t0: float, t1: float, **facts) -> dict:
    return {"phase": phase, "t0": t0, "t1": t1, **facts}


def test_phases_add_up_to_the_span_with_gaps_given_to_the_record_after_them():
    records = [
        record("startup", 0.0, 2.0, before="stopped"),  # the command
        record(
            "startup", 0.0, 2.5, before="startup"
        ),  # the rank, in the same process: overlaps, counted once
        record("rendezvous", 3.0, 3.5),  # 0.5 s before it no record covers: `other`
        record("train", 3.5, 9.5, first=1, step=60, waited=1.0),
        record("finish", 10.0, 10.0, before="finish"),
    ]
    summary = summarize(records)
    assert summary["wall_s"] == 10.0
    assert summary["phases_s"] == {
        "train": 5.0,
        "startup": 2.5,
        "rendezvous": 0.5,
        "data_wait": 1.0,
        "finish": 0.5,
        "other": 0.5,
    }
    assert sum(summary["phases_s"].values()) == pytest.approx(summary["wall_s"])
    assert summary["goodput"] == 0.5
    assert list(summary["phases_s"]) == [name for name in PHASES if name in summary["phases_s"]]


def test_steps_past_the_checkpoint_a_later_attempt_resumed_from_are_lost():
    """Attempt 1 trains 1-12 (a checkpoint at 8) and dies; attempt 2, restarted, resumes at 8, trains 9-20
    (a checkpoint at 16) and dies at 18; attempt 3 resumes at 16 and finishes."""
    records = [
        record("restore", 0, 1, resumed_at=0),
        record("warmup", 1, 2, step=1),
        record("train", 2, 9, first=2, step=8),
        record("checkpoint", 9, 10, step=8),
        record("train", 10, 14, first=9, step=12, waited=0.5),
        record("startup", 16, 17, before="restart"),  # 14-16: the restart
        record("restore", 17, 18, resumed_at=8),
        record("warmup", 18, 19, step=9),
        record("train", 19, 26, first=10, step=16),
        record("checkpoint", 26, 27, step=16),
        record("train", 27, 29, first=17, step=18),
        record("startup", 30, 31, before="restart"),
        record("restore", 31, 32, resumed_at=16),
        record("warmup", 32, 33, step=17),
        record("train", 33, 36, first=18, step=20),
    ]
    summary = summarize(records)
    assert summary["lost_steps"] == 4 + 2  # 9-12 of the first attempt, 17-18 of the second
    assert summary["phases_s"]["lost"] == 4 + 2  # their records' time, data wait included
    assert summary["phases_s"]["restart"] == 2 + 1
    assert summary["phases_s"]["train"] == 7 + 7 + 3
    assert "data_wait" not in summary["phases_s"]  # the lost steps' wait is lost
    assert (summary["attempts"], summary["restarts"]) == (3, 2)
    said = table(summary)
    assert said.startswith("goodput 47.2% of 36.0 s, 3 attempt(s), 2 restart(s), 6 step(s) lost\n")
    assert "  lost            6.00 s   16.7%  steps trained after the last checkpoint" in said


def test_a_restart_that_lost_no_step_says_so():
    """Killed right after its checkpoint: the headline still counts the lost steps, as 0, not leaving them out."""
    records = [
        record("restore", 0, 1, resumed_at=0),
        record("train", 1, 5, first=1, step=8),
        record("checkpoint", 5, 6, step=8),
        record("startup", 7, 8, before="restart"),
        record("restore", 8, 9, resumed_at=8),
        record("train", 9, 12, first=9, step=12),
    ]
    summary = summarize(records)
    assert (summary["restarts"], summary["lost_steps"]) == (1, 0)
    assert table(summary).startswith("goodput 58.3% of 12.0 s, 2 attempt(s), 1 restart(s), 0 step(s) lost\n")


def test_a_run_started_afresh_in_the_dir_loses_every_step_before_it():
    records = [
        record("restore", 0, 1, resumed_at=0),
        record("train", 1, 5, first=1, step=40),
        record("startup", 100, 101, before="stopped"),  # the next command, 95 s later
        record("restore", 101, 102, resumed_at=0),
        record("train", 102, 106, first=1, step=40),
    ]
    summary = summarize(records)
    assert summary["lost_steps"] == 40 and summary["phases_s"]["lost"] == 4
    assert summary["phases_s"]["stopped"] == 95


def test_the_ledger_coalesces_steps_and_writes_each_phase_as_it_ends(tmp_path, monkeypatch):
    clock = iter(float(t) for t in range(1, 100))
    monkeypatch.setattr("runner.telemetry.goodput.time.time", lambda: next(clock))
    ledger = Ledger(tmp_path, 0.0, "startup")
    ledger.lap("setup")  # 0-1
    for step in (1, 2, 3):  # 1-2, 2-3, 3-4
        ledger.step_done(step, first=step == 1)
    assert [r["phase"] for r in read_ledger(tmp_path)] == ["setup", "warmup"]  # steps 2-3 not yet written
    for step in range(4, 9):  # 4-5 ... 8-9: step 6 ends FLUSH_S (5 s) after the record began at 2
        ledger.step_done(step)
    ledger.lap("eval", step=8)
    records = read_ledger(tmp_path)
    assert records == [
        {"phase": "setup", "t0": 0.0, "t1": 1.0, "before": "startup"},
        {"phase": "warmup", "t0": 1.0, "t1": 2.0, "step": 1, "waited": 0.0},
        {"phase": "train", "t0": 2.0, "first": 2, "t1": 7.0, "step": 6, "waited": 0.0},
        {"phase": "train", "t0": 7.0, "first": 7, "t1": 9.0, "step": 8, "waited": 0.0},
        {"phase": "eval", "t0": 9.0, "t1": 10.0, "step": 8},
    ]
    with open(tmp_path / LEDGER, "a") as f:
        f.write('{"phase": "train", "t0": 10.0, "t1"')  # a line cut by a kill: left out
    assert read_ledger(tmp_path) == records
    silent = Ledger(None, 0.0, "startup")  # another rank's
    silent.lap("setup")
    silent.step_done(1)
    assert not silent.recording


def test_a_ledger_with_bytes_that_are_not_utf8_is_read_without_them_and_says_so(tmp_path, caplog):
    """A damaged line (not UTF-8) in the middle is left out with a warning naming it; the summary is
    written; a zero-filled tail (a crash mid-write) is left out silently. (It was a UnicodeDecodeError at
    the run's end, after all its training, with no metrics.json.)"""
    ledger = Ledger(tmp_path, 0.0, "startup")
    ledger.lap("setup")
    with open(tmp_path / LEDGER, "ab") as f:
        f.write(b'{"phase": "eval", "t0": 1.0, "t1": \xff\xfe2.0}\n')
    ledger.lap("eval", step=0)
    with caplog.at_level(logging.WARNING, logger="runner.telemetry.history"):
        assert [r["phase"] for r in read_ledger(tmp_path)] == ["setup", "eval"]
    assert f"{tmp_path / LEDGER}: line(s) 2 are not JSON records (damaged bytes)" in caplog.text
    assert write_summary(tmp_path)["wall_s"] > 0
    caplog.clear()
    with open(tmp_path / LEDGER, "ab") as f:
        f.write(b"\0" * 64)
    with caplog.at_level(logging.WARNING, logger="runner.telemetry.history"):
        assert len(read_ledger(tmp_path)) == 2
    assert "line(s) 2 are not" in caplog.text and "line(s) 4" not in caplog.text  # the tail: silent


def test_the_ledger_times_the_wait_for_each_batch(tmp_path):
    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield i

    ledger = Ledger(tmp_path, time.time(), "startup")
    assert list(ledger.batches(slow())) == [0, 1, 2]
    waited = ledger.waited
    assert 0.14 < waited < 1.0
    ledger.step_done(1)
    ledger.flush()
    assert read_ledger(tmp_path)[-1]["waited"] == round(waited, 6) and ledger.waited == 0


def test_a_process_knows_when_it_started():
    before = time.time()
    started = float(
        subprocess.check_output(
            [
                sys.executable,
                "-c",
                "import time; time.sleep(0.3); import runner.telemetry.goodput as g; print(g.process_start_time())",
            ]
        )
    )
    assert before - 0.05 < started < before + 0.25  # the start, not the import 0.3 s later
    assert process_start_time() < before


@pytest.mark.slow
def test_checkpoint_every_s_checkpoints_at_the_logging_steps_once_that_long_passed(tmp_path):
    """`trainer.checkpoint_every_s` (as short as can be): a checkpoint at every logging step, none between;
    the ledger records each save with its step."""
    run_to_end(
        tmp_path / "run",
        "trainer.max_steps=40",
        "trainer.log_every=10",
        "trainer.eval_every=0",
        "trainer.checkpoint_every_s=1e-9",
        "trainer.keep_checkpoints=null",
    )
    saved = [r["step"] for r in read_ledger(tmp_path / "run") if r["phase"] == "checkpoint"]
    assert saved == [10, 20, 30, 40]
    assert len(list((tmp_path / "run" / "checkpoints").glob("checkpoint_*"))) == 4


def test_a_forked_rank_knows_its_own_start_not_its_parents():
    """The launcher's ranks are forked from the command, which asked for its start time already: a rank's
    ledger starts when the rank started (else the time of a restart would be counted as its start-up)."""
    parent = process_start_time()
    time.sleep(0.05)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the forked rank
        os.write(write, repr(job_began()).encode())
        os._exit(0)
    os.waitpid(child, 0)
    began = float(os.read(read, 100))
    os.close(read)
    os.close(write)
    assert began > parent + 0.04 and process_start_time() == parent


def test_a_quiet_console_leaves_out_what_repeats_itself_and_the_goodput_table_of_a_short_or_good_run():
    cpu = {"train/loss": 0.5, "perf/peak_memory_gb": 0.33, "perf/peak_host_memory_gb": 0.33}
    assert shown(cpu, full=False) == {"train/loss": 0.5, "perf/peak_host_memory_gb": 0.33}
    assert shown(cpu, full=True) == cpu
    cuda = cpu | {"perf/peak_memory_gb": 4.0}  # the device's memory: not the host's
    assert shown(cuda, full=False) == cuda
    assert metrics_line(cpu, full=False) == "train/loss=0.5  perf/peak_host_memory_gb=0.33"

    def summary(goodput: float, wall_s: float) -> dict:
        phases = {"train": goodput * wall_s, "startup": (1 - goodput) * wall_s}
        return {"goodput": goodput, "wall_s": wall_s, "phases_s": phases, "attempts": 1, "restarts": 0,
                "rollbacks": 0, "lost_steps": 0}  # fmt: skip

    assert goodput_said(summary(0.1, 5.0), full=False) == "goodput 10.0% of 5.0 s (each phase: trainer.console=full)"
    assert goodput_said(summary(0.8, 600.0), full=False) == "goodput 80.0% of 600.0 s (each phase: trainer.console=full)"
    low = summary(0.4, 600.0)  # a long run that lost most of its time: the table
    assert goodput_said(low, full=False) == table(low) and "\n  startup " in table(low)
    assert goodput_said(summary(0.1, 5.0), full=True) == table(summary(0.1, 5.0))
    slowed = summary(0.8, 5.0) | {"straggler_windows": 4, "straggler_ranks": [1], "straggler_s": 2.5}
    assert goodput_said(slowed, full=False).split("\n")[1:] == [  # a straggler is said whatever the goodput
        "  stragglers: rank 1 in 4 log window(s); every rank waited 2.50 s for them (within train and data_wait)"
    ]

