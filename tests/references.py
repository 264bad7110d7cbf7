"""Results kept as test assets (tests/assets/): loss curves, and checkpoints an earlier commit wrote, which
every later commit must reproduce and resume. A change that moves a number, or can no longer read an old
checkpoint, fails where it is made instead of in a user's run.

`RUNNER_RECORD_REFERENCES=1 python -m pytest <tests>` stores them anew from the code checked out (refused
with RUNNER_CI=1): only for a change meant to change them, said in its commit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

ASSETS = Path(__file__).parent / "assets"
RECORD = os.environ.get("RUNNER_RECORD_REFERENCES") == "1"
if RECORD and os.environ.get("RUNNER_CI") == "1":
    raise RuntimeError("RUNNER_RECORD_REFERENCES=1 under RUNNER_CI=1: CI compares against the stored assets")


def curve(name: str, losses: list[float], tolerance: float) -> None:
    """`losses` are the stored curve `name`, step by step within `tolerance` (absolute); stored when
    recording."""
    path = ASSETS / "curves" / f"{name}.json"
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(losses, indent=1) + "\n")
        return
    if not path.is_file():
        pytest.fail(f"{path} is missing: store it with RUNNER_RECORD_REFERENCES=1 (see tests/references.py)")
    stored = json.loads(path.read_text())
    assert len(losses) == len(stored), f"{name}: {len(losses)} losses, the stored curve has {len(stored)}"
    for step, (ours, theirs) in enumerate(zip(losses, stored, strict=True)):
        assert abs(ours - theirs) <= tolerance, (
            f"{name}: loss {ours!r} at step {step} where the stored curve has {theirs!r} (tolerance {tolerance})"
        )


def checkpoint(name: str) -> Path | None:
    """The stored checkpoint `name` (a directory), or None while recording (the test then stores the one
    it writes with `store_checkpoint`)."""
    if RECORD:
        return None
    path = ASSETS / "checkpoints" / name
    if not path.is_dir():
        pytest.fail(f"{path} is missing: store it with RUNNER_RECORD_REFERENCES=1 (see tests/references.py)")
    return path


def store_checkpoint(name: str, written: Path) -> None:
    """Keep the checkpoint dir `written` as the asset `name` (recording only)."""
    assert RECORD
    path = ASSETS / "checkpoints" / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(written, path)
