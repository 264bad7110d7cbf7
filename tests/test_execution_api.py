"""The execution API under torchrun with 2 ranks: who runs what, in which order (tests/execution_api.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_every_spelling_runs_where_and_when_it_says(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    script = Path(__file__).parent / "execution_api.py"
    proc = subprocess.run([*command, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "printed by rank 0" in proc.stdout and "printed by rank 1" not in proc.stdout
    events = [line.split(maxsplit=2) for line in (tmp_path / "events").read_text().splitlines()]
    ranks: dict[str, list[int]] = {}
    times: dict[tuple[str, int], float] = {}
    for stamp, rank, event in events:
        ranks.setdefault(event, []).append(int(rank))
        times[event, int(rank)] = float(stamp)
    assert sorted(ranks["world 2"]) == [0, 1]  # Accelerator() joined torchrun's 2 ranks
    for first in ("main_process_first", "local_main_process_first"):
        assert times[first, 1] >= times[first, 0] + 0.2  # rank 1 ran the body after rank 0 finished it
    assert sorted(ranks["loaded"]) == [0, 1]
    assert sorted(ranks["stopped at 4"]) == [0, 1]  # rank 1's trigger stopped both at the same step
    assert ranks["on_main_process"] == [0] and ranks["on_local_main_process"] == [0]
    assert ranks["on_process(process_index=1)"] == [1]
    assert ranks["on_local_process(local_process_idx=1)"] == [1]
    assert ranks["on_process(function, process_index=0)"] == [0]
