"""runner as users get it: the wheel, installed (not editable) into a fresh venv with its dependencies
from the package registry, run from a directory that has nothing of runner's repository in it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from runner.errors import DISTRIBUTION
from tests.conftest import metrics_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _run(command: list[str | Path], cwd: Path | None = None, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=600, **kwargs
    )
    assert proc.returncode == 0, f"{command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, REPO])
    (built,) = out.glob("runner_ml-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh venv: the local torch build first (an unpinned torch would fetch a CUDA one), then the
    wheel, whose other dependencies pip takes from the registry. Returns its bin dir."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", root])
    pip = [root / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, f"torch=={torch.__version__.split('+')[0]}"])
    _run([*pip, wheel])
    return root / "bin"


def _user_env(bin_dir: Path, home: Path) -> dict[str, str]:
    """A user's shell with the venv activated: nothing points back at this checkout."""
    keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TMPDIR", "USER")}
    return keep | {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin",
        "HOME": str(home),
        "VIRTUAL_ENV": str(bin_dir.parent),
        "PYTHONUNBUFFERED": "1",
    }


def test_the_wheel_holds_configs_tasks_and_the_starter_project(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "runner/conf/config.yaml",
        "runner/conf/hardware/fsdp.yaml",
        "runner/conf/hydra/job_logging/runner.yaml",
        "runner/conf/deepspeed/zero3.json",
        "runner/tasks/regression.py",
        "runner/data/assets/sonnets.txt",
        "runner/cli/starter/conf/experiment/example.yaml",
        "runner/cli/starter/package/model.py",
    } <= names
    # Nothing at the top level that could shadow (or be shadowed by) a user's `tasks` or `conf`; the
    # sweeper is in Hydra's namespace package for plugins, which has no __init__.py of its own.
    assert {name.split("/")[0] for name in names} == {"runner", "hydra_plugins", "runner_ml-0.1.0.dist-info"}
    assert (
        "hydra_plugins/runner_sweeper/resumable_sweeper.py" in names
        and "hydra_plugins/__init__.py" not in names
    )
    entry_points = zipfile.ZipFile(wheel).read("runner_ml-0.1.0.dist-info/entry_points.txt").decode()
    assert "runner = runner.__main__:main" in entry_points
    # every module of the source tree, a new subpackage's too (pyproject lists the packages by name)
    root = Path(__file__).resolve().parents[1]
    sources = {
        str(path.relative_to(root))
        for path in (root / "runner").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert sorted(sources - names) == []


def test_installed_runner_runs_the_default_experiment_from_an_empty_dir(venv, tmp_path):
    env = _user_env(venv, tmp_path)
    where = _run(
        [venv / "python", "-c", "import runner.cli; print(runner.cli.__file__)"], cwd=tmp_path, env=env
    )
    assert where.stdout.startswith(str(venv.parent))  # the installed copy, not this checkout
    proc = _run(
        ["runner", "trainer.max_steps=20", "trainer.eval_every=0", "tracker.detach=false"],
        cwd=tmp_path,
        env=env,
    )
    metrics = metrics_of(proc)
    assert metrics["eval/loss"] < metrics["train/loss"] * 3
    (run_dir,) = (tmp_path / "outputs" / "runs").iterdir()  # under the user's ./outputs
    written = json.loads((run_dir / "metrics.json").read_text())
    assert {k: v for k, v in written.items() if not k.startswith("perf/")} == pytest.approx(metrics, rel=1e-5)
    assert written["perf/tokens_per_s" if "perf/tokens_per_s" in written else "perf/samples_per_s"] > 0
    assert (tmp_path / "outputs" / "mlflow.db").is_file()  # the default tracker's local store, delivered


def test_an_installed_runner_resumes_a_sweep_with_its_own_sweeper(venv, tmp_path):
    env = _user_env(venv, tmp_path)
    sweep = [
        "runner",
        "-m",
        "hydra.sweep.dir=sweep",
        "optimizer.lr=1e-3,1e-4",
        "trainer.max_steps=5",
        "tracker=none",
    ]
    first = _run(sweep, cwd=tmp_path, env=env)
    assert "Launching 2 jobs locally" in first.stdout
    # matplotlib is the `plots` extra: the summary table is written, the plot is not, and the message
    # gives the command that adds it; that command, run as given, installs it.
    hint = "matplotlib is not installed (pip install 'runner-ml[plots]')"
    assert hint in first.stdout + first.stderr
    assert (tmp_path / "sweep" / "summary.csv").is_file() and not (
        tmp_path / "sweep" / "summary.png"
    ).exists()
    _run([venv / "python", "-m", "pip", "install", "-q", "runner-ml[plots]"])  # the registry's settings kept
    (tmp_path / "sweep" / "1" / "metrics.json").unlink()  # as if job 1 had been interrupted
    again = _run(sweep, cwd=tmp_path, env=env)
    assert "job(s) 0 finished before and are not run again" in again.stdout
    assert "Launching 1 jobs locally" in again.stdout and "#1 : " in again.stdout
    assert (tmp_path / "sweep" / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runner_init_writes_a_project_that_trains_on_1_and_2_processes(venv, tmp_path):
    env = _user_env(venv, tmp_path)
    _run(["runner", "init", "moons"], cwd=tmp_path, env=env)
    project = tmp_path / "moons"
    assert len((project / "README.md").read_text().splitlines()) == 3
    assert "_target_: moons.model.SmallNet" in (project / "conf" / "model" / "small_net.yaml").read_text()

    # The project's own model, task, data file and config dir; its package imports from the cwd.
    one = _run(["runner", "--config-dir", "conf", "experiment=example", "tracker=none"], cwd=project, env=env)
    two = _run(
        [
            venv / "python",
            "-m",
            "runner",
            "--config-dir",
            "conf",
            "experiment=example",
            "tracker=none",
            "hardware=ddp",
            "hardware.num_processes=2",
        ],
        cwd=project,
        env=env,
    )
    for proc in (one, two):
        metrics = metrics_of(proc)
        assert metrics["eval/accuracy"] > 0.8  # the moons are learned
        assert 0.5 < metrics["eval/p_right"] < 1  # the project's own task computed the metrics
    assert "starting 2 ranks" in two.stderr
    runs = sorted((project / "outputs" / "runs").iterdir())
    assert len(runs) == 2
    resolved = (runs[0] / "resolved_config.yaml").read_text()
    assert "moons.task.Classify" in resolved and "path: data/points.csv" in resolved


def test_a_users_mistakes_in_an_installed_runner_are_one_paragraph(venv, tmp_path):
    env = _user_env(venv, tmp_path)
    _run(["runner", "init", "proj"], cwd=tmp_path, env=env)
    project = tmp_path / "proj"
    cases = [
        (["--config-dir", "./nope", "experiment=example"], "--config-dir"),
        (
            ["--config-dir", "conf", "experiment=example", "model._target_=proj.nets.Net"],
            f"looked in the working directory {project} and the installed packages",
        ),
        (["--config-dir", "conf", "experiment=mine"], "add experiment/mine.yaml to your config dir"),
        (["hydra.searchpath=[file://confs]", "experiment=example"], "hydra.searchpath: 'confs' is not there"),
    ]
    for arguments, expected in cases:
        proc = subprocess.run(
            ["runner", *arguments, "tracker=none"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, (arguments, proc.stderr)
        assert "Traceback" not in proc.stderr and expected in proc.stderr, (arguments, proc.stderr)
    again = subprocess.run(["runner", "init", "proj"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "not empty" in again.stderr
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "conf", "data", "outputs", "proj"]


HINT = re.compile(r"pip install(?: -\S+)*\s+(\S*?)\[([\w,]+)\]")


def test_every_install_hint_names_the_distribution_and_an_extra_it_has():
    """Every `pip install ...[extra]` in runner's messages, its configs and its docs reads
    `pip install 'runner-ml[extra]'` (PyPI's `runner` is another project), naming an extra that
    pyproject.toml declares; the README's test command alone installs the checkout (`-e ".[...]"`)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    files = [
        *(REPO / "runner").rglob("*.py"),
        *(REPO / "conf").rglob("*.yaml"),
        *(REPO / "docs").glob("*.md"),
    ]
    hints = [
        (path.relative_to(REPO), m)
        for path in [*files, REPO / "README.md"]
        for m in HINT.finditer(path.read_text())
    ]
    test_command = [m for path, m in hints if m.group(1) == '".' and path.name == "README.md"]
    assert len(test_command) == 1 and "test" in test_command[0].group(2)
    wrong = [
        f"{path}: {m.group(0)}"
        for path, m in hints
        if m not in test_command
        and (
            m.group(1) != f"'{DISTRIBUTION}"
            or not set(m.group(2).split(",")) <= set(project["optional-dependencies"])
        )
    ]
    assert not wrong and len(hints) > 15, wrong
