"""`launcher=kubernetes`: the job as a Kubeflow Trainer TrainJob, and the agents of its pods."""

from runner.launchers.kubernetes.launcher import KubernetesLauncher
from runner.launchers.kubernetes.nodes import run_node

__all__ = ["KubernetesLauncher", "run_node"]
