"""The seed pages' code snippets, run unchanged by 2 processes under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SNIPPETS = Path(__file__).parent / "snippets"


def test_execution_snippets_under_torchrun(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*command, str(SNIPPETS / "execution.py"), str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Accelerate is the best") == 1 and proc.stdout.count("done") == 1
    events = [line.split(maxsplit=2) for line in (tmp_path / "events").read_text().splitlines()]
    by_event: dict[str, list[int]] = {}
    for _, rank, event in events:
        by_event.setdefault(event, []).append(int(rank))
    assert sorted(by_event["world 2"]) == [0, 1]  # Accelerator() saw torchrun's 2 ranks
    # main_process_first: the main process downloads, the other finds the cache.
    assert by_event["download"] == [0]
    download_time = next(float(t) for t, _, event in events if event == "download")
    assert all(float(t) > download_time for t, _, event in events if event == "load")
    assert sorted(by_event["map"]) == [0, 1]
    assert sorted(by_event["stopped after 4"]) == [0, 1]  # rank 1's trigger stopped both at once
    assert by_event["progress_bar disabled=False"] == [0] and by_event["progress_bar disabled=True"] == [1]
    for once in ("once_per_server", "push_to_hub", "once", "index_zero", "local_index_zero"):
        assert by_event[once] == [0], once
