"""What `pip install` puts in place: the wheel holds the tasks folder as `runner.tasks`, no top-level
`tasks` package that could shadow (or be shadowed by) a user's."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_tasks_under_runner(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("runner-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {
        "runner/tasks/__init__.py",
        "runner/tasks/regression.py",
        "runner/data/assets/sonnets.txt",
    } <= set(names)
    assert not [name for name in names if name.startswith("tasks/")]
