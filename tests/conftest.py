from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist (the README's `-n 2 --dist loadgroup`) a test file runs whole in one worker, so its
# module fixtures (the shared reference runs) are built once; the files that submit to the one SLURM
# cluster share a group, so their jobs never wait behind each other's.
GROUPS = {"test_slurm": "slurm", "test_slurm_multinode": "slurm"}

# `.ci/run` sets RUNNER_CI=1: there (root, the README's command, every extra installed) each test runs, so
# a skip is a failure, except those of the tests that run in an environment of their own (`cuda`:
# `.ci/gpu.sh` on a GPU, `tpu`: `.ci/tpu.sh` with torch_xla).
ON_CI = os.environ.get("RUNNER_CI") == "1"
RUN_ELSEWHERE = ("cuda", "tpu")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        item.add_marker(pytest.mark.xdist_group(GROUPS.get(module, module)))


def _failed_on_ci(report: pytest.CollectReport | pytest.TestReport) -> None:
    """A skip reported on CI becomes a failure that gives the skip's reason."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped on CI (RUNNER_CI=1), where every test must run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    elsewhere = any(item.get_closest_marker(name) for name in RUN_ELSEWHERE)
    if ON_CI and report.skipped and not hasattr(report, "wasxfail") and not elsewhere:
        _failed_on_ci(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if ON_CI and report.skipped:  # a module-level skip (pytest.importorskip, allow_module_level)
        _failed_on_ci(report)


def runner_command(run_dir: Path, *overrides: str) -> list[str]:
    """`python -m runner` with its run dir at `run_dir`, no progress bar, and `overrides`. Unless they
    name a tracker (`tracker=...`, `tracker.<key>=...`), it tracks nothing (`tracker=none`): tracking is
    tested where a test names it, and elsewhere MLflow's sender would add a process, its import of MLflow
    and the wait for delivery to every run. Nor does it draw its curves (`trainer.plots=false`) unless they
    name it: each drawing is a process of its own, tested where a test names it."""
    named = any(override.lstrip("+~").startswith("tracker") for override in overrides)
    plotted = any(override.startswith("trainer.plots=") for override in overrides)
    return [
        sys.executable,
        "-m",
        "runner",
        f"hydra.run.dir={run_dir}",
        "trainer.progress_bar=false",
        *([] if named else ["tracker=none"]),
        *([] if plotted else ["trainer.plots=false"]),
        *overrides,
    ]


def run_to_end(
    run_dir: Path, *overrides: str, timeout: float = 300, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m runner` with its run dir at `run_dir` (working in its parent), which must exit 0;
    `pythonpath` adds a dir of test modules."""
    proc = subprocess.run(
        runner_command(run_dir, *overrides),
        cwd=run_dir.parent,
        env=cli_env(pythonpath),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen) -> None:
    """Wait until the run in `run_dir` (started as `proc`) marks a checkpoint latest (at most 2 minutes)."""
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.05)


@pytest.fixture
def run_cli(tmp_path):
    """Run `python -m runner <overrides>` in a fresh process with its run dir under tmp_path: one dir for
    every call of a test, so a call may resume the previous one's checkpoints; one that starts over moves
    the previous call's finished run aside (`trainer.overwrite=true`) instead of being refused."""

    def run(
        *overrides: str, timeout: float = 240, pythonpath: Path | None = None
    ) -> subprocess.CompletedProcess:
        run_dir = tmp_path / "run"
        proc = subprocess.run(
            runner_command(run_dir, "trainer.overwrite=true", *overrides),
            cwd=tmp_path,
            env=cli_env(pythonpath),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        proc.run_dir = run_dir  # type: ignore[attr-defined]
        return proc

    return run


@pytest.fixture
def forked_cli(tmp_path):
    """As `run_cli` (without `pythonpath`), for a command that ends before it starts anything (a refusal, a
    plan): `runner.cli.run` in a process forked from one that imported torch and runner once
    (`rank_checks.command`), 0.3 s a command instead of a fresh interpreter's 3.5 s."""
    import rank_checks  # torch and runner: imported by the tests that use it, not by every test's session

    def run(*overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
        run_dir = tmp_path / "run"
        command = runner_command(run_dir, "trainer.overwrite=true", *overrides)
        proc = rank_checks.command(command, tmp_path, env=cli_env(), timeout=timeout)
        proc.run_dir = run_dir  # type: ignore[attr-defined]
        return proc

    return run


def cli_env(pythonpath: Path | None = None) -> dict[str, str]:
    """The environment for a `python -m runner` subprocess; `pythonpath` adds a dir of test modules.
    Runs without a `tracker.uri` track to the session's shared MLflow store."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"PYTHONUNBUFFERED": "1"}
    env.setdefault("MLFLOW_TRACKING_URI", shared_mlflow_store())
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return env


def metrics_of(proc: subprocess.CompletedProcess) -> dict[str, float]:
    """The final metrics table that `python -m runner` logs, but the `perf/*` measurements (throughput
    and memory differ from run to run)."""
    lines = proc.stderr.split("final metrics")[1].split("time spent")[0].splitlines()[1:]
    return {
        name: float(value)
        for name, value in (line.split() for line in lines if line.startswith("  "))
        if not name.startswith("perf/")
    }


@functools.cache
def shared_mlflow_store() -> str:
    """One local MLflow store for the session's runs: its tables are created once, not in each test's
    fresh working directory (seconds each)."""
    store = Path(tempfile.mkdtemp(prefix="runner-mlflow-"))
    atexit.register(shutil.rmtree, store, ignore_errors=True)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    # The runs' experiment, with its artifacts in the store (MLflow's default would be ./mlruns of
    # whichever test's working directory created it).
    artifacts = str(store / "artifacts")
    create = (
        f"from mlflow import MlflowClient; MlflowClient({uri!r}).create_experiment('runner', {artifacts!r})"
    )
    subprocess.run([sys.executable, "-c", create], check=True, capture_output=True)
    return uri


def wait_for_delivery(run_dir: Path, timeout_s: float = 120) -> dict:
    """The MLflow journal's delivery state in `run_dir` once the sender is done with it: a run returns
    before its records reach the store (the sender delivers them)."""
    state_file, events = run_dir / "tracking" / "delivered.json", run_dir / "tracking" / "events.jsonl"
    deadline = time.monotonic() + timeout_s
    while True:
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        if state.get("closed", -1) >= len(events.read_text().splitlines()):
            return state
        assert time.monotonic() < deadline, f"the sender did not finish: {state}"
        time.sleep(0.1)


def run_id_of(run_dir: Path) -> str:
    """The MLflow run of `run_dir`'s journal, once delivered."""
    return wait_for_delivery(run_dir)["run_id"]
