"""The files a run replaces whole and appends records to (`runner.files`), the tracking journal on them
(records survive the process, delivery is remembered, a torn last line is dropped) and where a tracker
sends them by default."""

from __future__ import annotations

import os

import pytest

from runner.files import JsonLines, cut_torn_line, json_lines, read_json_lines, replacing, write_text
from runner.trackers.journal import EVENTS, Journal


def test_a_replacement_that_fails_leaves_the_old_file_and_no_partial_one(tmp_path):
    target = tmp_path / "record.json"
    write_text(target, "old\n")
    with pytest.raises(OSError), replacing(target) as staging:
        staging.write_text("new, half writ")
        raise OSError(28, "No space left on device")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["record.json"]
    write_text(target, "new\n")
    assert target.read_text() == "new\n" and os.listdir(tmp_path) == ["record.json"]


def test_a_torn_line_is_not_read_and_is_cut_before_the_next_record(tmp_path):
    path = tmp_path / "records.jsonl"
    lines = JsonLines(path)
    lines.append({"n": 1})
    with open(path, "a") as f:
        f.write('{"n": 2, "long": "' + "x" * 100_000)  # a writer killed in a line longer than a read chunk
    assert json_lines(path) == [{"n": 1}]
    _, end = read_json_lines(path)
    assert end == len('{"n": 1}\n')  # where a reader that follows the file goes on
    JsonLines(path).append({"n": 3})
    assert json_lines(path) == [{"n": 1}, {"n": 3}]
    cut_torn_line(path)  # nothing torn: nothing cut
    assert json_lines(path) == [{"n": 1}, {"n": 3}]


def test_events_and_delivery_survive_a_restart(tmp_path):
    journal = Journal(tmp_path)
    for step in range(3):
        journal.append({"op": "metrics", "step": step})
    journal.refresh().mark_delivered(1, "run-1")
    again = Journal(tmp_path)
    assert [event["step"] for event in again.events] == [0, 1, 2]
    assert again.state == {"run_id": "run-1", "delivered": 1} and again.pending == 2


def test_a_reader_takes_whole_lines_only_while_the_writer_writes(tmp_path):
    writer, reader = Journal(tmp_path), Journal(tmp_path)
    writer.append({"op": "start"})
    with open(tmp_path / EVENTS, "a") as f:
        f.write('{"op": "metr')  # half a line: the writer is in the middle of it
    assert reader.refresh().events == [{"op": "start"}]
    with open(tmp_path / EVENTS, "a") as f:
        f.write('ics", "step": 1}\n')
    assert reader.refresh().events == [{"op": "start"}, {"op": "metrics", "step": 1}]


def test_a_line_cut_short_by_a_kill_is_dropped_by_the_next_writer(tmp_path):
    journal = Journal(tmp_path)
    journal.append({"op": "start"})
    with open(tmp_path / EVENTS, "a") as f:
        f.write('{"op": "metr')  # the writer died here
    again = Journal(tmp_path)
    assert again.events == [{"op": "start"}]
    again.append({"op": "end"})
    assert [event["op"] for event in Journal(tmp_path).events] == ["start", "end"]


def test_one_sender_at_a_time(tmp_path):
    first = Journal(tmp_path).lock_for_sending()
    assert first is not None and Journal(tmp_path).lock_for_sending() is None
    first.close()  # as the holder's exit does
    second = Journal(tmp_path).lock_for_sending()
    assert second is not None
    second.close()


def test_the_default_store_is_outputs_unless_mlflow_tracking_uri_names_one(tmp_path, monkeypatch):
    from runner.trackers import MLflowTracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # set but empty: as if unset
    assert MLflowTracker().uri == f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert MLflowTracker().uri == "http://tracking:5000"
    assert MLflowTracker(uri="sqlite:///x.db").uri == "sqlite:///x.db"
