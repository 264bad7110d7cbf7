"""`notebook_launcher` from a plain Python session (the function lives in `__main__`, as in a notebook)
and the `python -m runner.env` report."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO, cli_env

from runner.config import CONF_DIR

pytestmark = pytest.mark.slow

SESSION = textwrap.dedent(
    """
    import torch
    from runner import Accelerator, notebook_launcher

    torch.randn(512, 512) @ torch.randn(512, 512)  # the notebook has computed (OpenMP threads ran)

    def training_function(scale):
        accelerator = Accelerator()
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        loss = model(torch.ones(2, 4)).sum() * scale
        accelerator.backward(loss)
        optimizer.step()
        total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), "sum").item()
        info = (accelerator.num_processes, accelerator.mixed_precision, total, torch.get_num_threads())
        accelerator.end_training()
        return info

    def failing_function():
        Accelerator()
        raise RuntimeError("boom in the notebook")

    print("TWO", notebook_launcher(training_function, (2.0,), num_processes=2, mixed_precision="bf16", use_port="0"))
    print("ONE", notebook_launcher(training_function, (1.0,)))
    try:
        notebook_launcher(failing_function, num_processes=2, use_port="0")
    except Exception as err:
        print("FAILED", type(err).__name__, err)
    """
)


def test_notebook_launcher_runs_a_function_of_the_session_in_two_processes():
    proc = subprocess.run(
        [sys.executable, "-c", SESSION], env=cli_env(), capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line}
    assert lines["TWO"] == "{0: (2, 'bf16', 3.0, 1), 1: (2, 'bf16', 3.0, 1)}"  # a group of 2, one thread each
    assert lines["ONE"].startswith("{0: (1, 'no', 1.0, ")  # in this process
    assert lines["FAILED"].startswith("RankFailedError process ")
    assert "RuntimeError: boom in the notebook" in lines["FAILED"] and "failing_function" in proc.stdout


def test_env_report_names_versions_backends_and_the_config_path():
    proc = subprocess.run([sys.executable, "-m", "runner.env"], env=cli_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = proc.stdout
    assert f"- torch: {torch.__version__}" in report
    assert f"  - deepspeed: {importlib.metadata.version('deepspeed')}" in report
    assert f"  - mlflow-skinny: {importlib.metadata.version('mlflow-skinny')} (required)" in report
    # every integration a bug report needs, by pyproject's extras: none left out
    for name, extra in [("wandb", "wandb"), ("tensorboard", "tensorboard"), ("ray", "ray"),
                        ("kubernetes", "kubernetes"), ("matplotlib", "plots"), ("datasets", "hf")]:  # fmt: skip
        assert f"  - {name}: {importlib.metadata.version(name)} (extra: {extra})" in report, report
    assert "pytest" not in report and "mkdocs" not in report  # the test and docs extras are tooling
    assert f"- runner: {importlib.metadata.version('runner-ml')} (" in report
    assert "gloo yes" in report and f"config search path: pkg://runner.conf ({CONF_DIR})" in report
