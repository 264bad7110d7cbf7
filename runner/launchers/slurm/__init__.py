"""`launcher=slurm`: the job on a SLURM cluster through submitit (`launcher.py`), a sweep's jobs as SLURM
arrays with the same keys (`sweep.py`), the cluster's partitions a request is checked against
(`partitions.py`), and a queued job followed to its end (`jobs.py`)."""

from runner.launchers.slurm.launcher import SlurmLauncher

__all__ = ["SlurmLauncher"]
