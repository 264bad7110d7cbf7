"""Telling a rank started by a launcher (torchrun, srun) from a plain process, from its environment."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from runner.cluster import launched_environment
from runner.cluster.slurm import first_host
from runner.errors import ConfigError
from runner.hardware import DDP
from runner.launchers.local import LocalLauncher

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = (
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and whatever a test sets (`ClusterEnvironment.export` too) is undone after."""
    for name in (*LAUNCHER_VARS, *SLURM_VARS, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        monkeypatch.setenv(name, "")  # records the original state, which undo restores
        monkeypatch.delenv(name)
    return monkeypatch


def test_plain_process_and_single_task_slurm_job_are_not_ranks(clean_env):
    assert launched_environment() is None
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")  # an sbatch script: runner may start its own ranks
    assert launched_environment() is None


def test_torchrun_variables(clean_env):
    for name, value in zip(LAUNCHER_VARS, ("3", "4", "1", "2", "10.0.0.5", "29400"), strict=True):
        clean_env.setenv(name, value)
    env = launched_environment()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 29400)


SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "6",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
    "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_JOB_ID": "12345",
}


def test_srun_variables(clean_env):
    for name, value in SRUN.items():
        clean_env.setenv(name, value)
    env = launched_environment()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 6, 1, 2)
    assert env.master_addr == "gpu07" and env.master_port == 20000 + 12345
    env.export()
    assert os.environ["RANK"] == "5" and os.environ["MASTER_ADDR"] == "gpu07"


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("localhost", "localhost"), ("node[03-05,09],gpu1", "node03"), ("a[7]", "a7"), ("x1,x2", "x1")],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_a_slurm_step_started_by_hand_must_have_the_ranks_per_node_the_hardware_asks(clean_env):
    """`srun --ntasks-per-node 2 python -m runner hardware.num_processes=4`: each task is one rank, so the
    hardware's 4 per node cannot be; refused before the ranks meet (torchrun's ranks are not checked)."""
    for name, value in SRUN.items():
        clean_env.setenv(name, value)
    launcher, cfg = LocalLauncher(), OmegaConf.create({"hardware": {"num_processes": 4}})
    with pytest.raises(ConfigError, match=r"SLURM started 2 task\(s\) on this node \(6 in all\)"):
        launcher.check(cfg, DDP(device="cpu", num_processes=4, oversubscribe=True))
    launcher.check(cfg, DDP(device="cpu", num_processes=2, oversubscribe=True))
    assert launched_environment().ranks_per_node_problem(2) is None

