"""`.ci/run` can fail: it runs the README's test command with RUNNER_CI=1, where a skipped test fails
(tests/conftest.py) unless it runs in an environment of its own (`cuda`, `tpu`), and pytest's exit 5 (no
test collected) is a failure. Run on a copy of the harness: a README of one's own, this conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
import pytest

def test_runs():
    pass

def test_needs_a_cluster():
    pytest.skip("no cluster here")

@pytest.mark.cuda
def test_on_a_gpu():
    pytest.skip("needs a CUDA GPU")
'''


def ci(root: Path, command: str) -> subprocess.CompletedProcess:
    """`.ci/run` in `root`, its README's test command being `command`."""
    (root / ".ci").mkdir(exist_ok=True)
    shutil.copy(REPO / ".ci" / "run", root / ".ci" / "run")
    (root / "README.md").write_text(f"# x\n\n<!-- test-command -->\n```bash\n{command}\n```\n<!-- /test-command -->\n")
    env = {k: v for k, v in os.environ.items() if k != "RUNNER_CI" and not k.startswith("PYTEST_")}
    return subprocess.run(
        ["bash", ".ci/run"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tests").mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_some.py").write_text(TESTS)
    (tmp_path / "tests" / "empty").mkdir()
    return tmp_path


PYTEST = "python -m pytest -p no:cacheprovider -p no:randomly -q -rfs"


def test_on_ci_a_skipped_test_fails_naming_its_reason_but_not_a_gpus(project):
    proc = ci(project, f"{PYTEST} tests/test_some.py")
    assert proc.returncode == 1, proc.stdout
    assert "FAILED tests/test_some.py::test_needs_a_cluster" in proc.stdout
    assert "skipped on CI (RUNNER_CI=1), where every test must run: Skipped: no cluster here" in proc.stdout
    assert "1 failed, 1 passed, 1 skipped" in proc.stdout  # the cuda test skips as it does anywhere
    outside = subprocess.run(
        [*PYTEST.split(), "tests/test_some.py"], cwd=project, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RUNNER_CI" and not k.startswith("PYTEST_")},
    )  # fmt: skip
    assert outside.returncode == 0 and "1 passed, 2 skipped" in outside.stdout, outside.stdout


def test_on_ci_a_module_that_skips_whole_fails(project):
    (project / "tests" / "test_module.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_here')\n\ndef test_x():\n    pass\n"
    )
    proc = ci(project, f"{PYTEST} tests/test_module.py")
    assert proc.returncode != 0, proc.stdout
    assert "skipped on CI (RUNNER_CI=1), where every test must run" in proc.stdout
    assert "no_such_module_here" in proc.stdout


def test_on_ci_a_command_that_collects_no_test_fails(project):
    proc = ci(project, f"{PYTEST} tests/empty")
    assert proc.returncode == 5, proc.stdout
