"""`python -m runner.env`: what this machine offers runner, to paste into a bug report."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys

import torch
import torch.distributed as dist

from runner.cluster import available_cores, rank_variables
from runner.config import CONF_DIR, CONF_SEARCH_PATH
from runner.errors import DISTRIBUTION

# The extras of the distribution that are tooling, not integrations a run uses.
TOOLING = ("test", "docs", "tpu")
# Packages runner works with that no extra installs: shown where they are installed.
ALSO = ("peft", "accelerate", "matplotlib")
ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MLFLOW_TRACKING_URI", "DS_ACCELERATOR")


def report() -> str:
    """The report, as Markdown."""
    lines = [
        "## runner environment",
        f"- runner: {_version(DISTRIBUTION)} ({os.path.dirname(os.path.abspath(__file__))})",
        f"- Python: {sys.version.split()[0]} ({sys.executable}); platform: {platform.platform()}",
        f"- CPU cores available: {available_cores()}",
        f"- torch: {torch.__version__} (CUDA build: {torch.version.cuda or 'none'})",
        f"- devices: {_devices()}",
        "- distributed backends: "
        + ", ".join(f"{name} {'yes' if available() else 'no'}" for name, available in _backends().items()),
        "- integrations:",
        *(f"  - {name}: {_version(name)} ({source})" for name, source in integrations().items()),
        f"- config search path: {CONF_SEARCH_PATH} ({CONF_DIR}), then Hydra's `--config-dir` / `hydra.searchpath`",
        "- environment: " + (", ".join(f"{k}={v}" for k, v in _variables().items()) or "none set"),
    ]
    return "\n".join(lines)


def integrations() -> dict[str, str]:
    """Each package runner requires or an extra of it installs (from the installed distribution's own
    requirements, so none is left out), as its name -> where it comes from; then those of `ALSO` installed."""
    found: dict[str, str] = {}
    for requirement in importlib.metadata.requires(DISTRIBUTION) or []:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)  # type: ignore[union-attr]
        extra = re.search(r"""extra == ["']([^"']+)["']""", requirement)
        if name == "torch" or (extra and extra.group(1) in TOOLING):
            continue
        found.setdefault(name, f"extra: {extra.group(1)}" if extra else "required")
    for name in ALSO:
        if name not in found and _version(name) != "not installed":
            found[name] = "installed beside runner"
    return found


def _variables() -> dict[str, str]:
    return {k: os.environ[k] for k in ENVIRONMENT if k in os.environ} | rank_variables()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> str:
    if not torch.cuda.is_available():
        return "cpu only"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} CUDA GPU(s): " + ", ".join(names)


def _backends() -> dict[str, object]:
    return {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available, "mpi": dist.is_mpi_available}


if __name__ == "__main__":
    print(report())
