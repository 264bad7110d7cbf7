"""`launcher=kubernetes`: the job as a Kubeflow Trainer TrainJob, and the agents of its pods."""

from runner.launchers.kubernetes.launcher import KubernetesLauncher

__all__ = ["KubernetesLauncher"]
