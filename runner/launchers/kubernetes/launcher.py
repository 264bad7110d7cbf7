"""`launcher=kubernetes`: the job as a Kubeflow Trainer TrainJob (runtime `torch-distributed`) whose pods
each run `python -m runner` with this command's overrides and start their node's ranks."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.cluster import TrainJobNode, launched_node
from runner.config import NonNegativeInt, PositiveFloat, PositiveInt, checked
from runner.errors import ConfigError, TrainingInterrupted
from runner.files import write_text
from runner.hardware.base import Strategy
from runner.launchers.base import Job, Launcher
from runner.launchers.kubernetes.api import current_context, follow, submit
from runner.launchers.kubernetes.manifest import (
    RESERVED,
    check_name,
    check_object_names,
    check_trainjob,
    job_name,
    require_kubeflow,
    trainjob,
)
from runner.launchers.local import LocalLauncher
from runner.launchers.nodes import FirstNode

log = logging.getLogger(__name__)

MANIFEST = Path("kubernetes") / "trainjob.yaml"  # in the command's run dir


class KubernetesLauncher(Launcher):
    """Write the job as a TrainJob of Kubeflow Trainer's `torch-distributed` runtime: `nodes` pods of
    `image`, each running `python -m runner` with this command's overrides and `hardware.num_processes`
    ranks, the PersistentVolumeClaim `volume` mounted at `mount_path`, where the pods' run dir is. With
    `submit`, create it in the current kube context and follow it (its state, the first pod's log).

    In the pods (the runtime's `PET_*` variables set), the first pod's command composes and checks the job
    and hands it to the others; each pod starts its node's ranks, numbered node by node, and they meet as
    one job (torch's static rendezvous at the first pod). After a rank failed, each pod's agent starts its
    node's ranks again, up to `restarts` times, and they meet afresh and resume from the run dir's latest
    checkpoint; a pod that fails beyond that fails the TrainJob, and the same TrainJob submitted again
    resumes from there too.

    Args:
        image: the container image of the pods: runner and the project installed, its working dir holding
            the project as this command's does (`--config-dir` and relative paths are read there).
        nodes: the pods (the TrainJob's `numNodes`).
        namespace: the namespace of the TrainJob.
        runtime: the ClusterTrainingRuntime it refers to.
        gpus_per_node, cpus_per_node, mem_gb: each pod's resources (requests and limits; `nvidia.com/gpu`);
            None: the runtime's.
        volume: the PersistentVolumeClaim (ReadWriteMany) every pod mounts at `mount_path`.
        mount_path: where the pods mount `volume`.
        run_dir: the run dir in the pods, under `mount_path`; None: `mount_path`/<this command's run dir
            relative to its working dir>.
        env: more environment variables of the pods (not the runtime's `PET_*`).
        name: the TrainJob's name; None: runner-<the run dir's name>.
        submit: create the TrainJob in the current kube context and follow it; false: write it only.
        poll_interval_s: seconds between looks at the TrainJob's state while following it.
        **kwargs: `restarts` (`Launcher`): each pod's agent restarts its node's ranks (Kubeflow's TrainJob
            has no failure policy of its own to set: the JobSet's is its runtime's).
    """

    @checked("launcher")
    def __init__(
        self,
        image: str | None = None,
        nodes: PositiveInt = 1,
        namespace: str = "default",
        runtime: str = "torch-distributed",
        gpus_per_node: NonNegativeInt = 0,
        cpus_per_node: PositiveFloat | None = None,
        mem_gb: PositiveFloat | None = None,
        volume: str | None = None,
        mount_path: str = "/runs",
        run_dir: str | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        submit: bool = False,
        poll_interval_s: PositiveFloat = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.image = image
        self.nodes = nodes
        self.namespace = namespace
        self.runtime = runtime
        self.gpus_per_node = gpus_per_node
        self.cpus_per_node = cpus_per_node
        self.mem_gb = mem_gb
        self.volume = volume
        self.mount_path = mount_path
        self.run_dir = run_dir
        self.env = dict(env or {})
        self.name = name
        self.submit = submit
        self.poll_interval_s = poll_interval_s

    def world_size(self, cfg: DictConfig, strategy: Strategy) -> int:
        return self.nodes * strategy.num_processes

    def check(self, cfg: DictConfig, strategy: Strategy) -> None:
        """In a pod: the pod is the node the TrainJob says. Elsewhere: what the TrainJob needs, refused
        before it is written (and the kube context, before it is submitted)."""
        node = launched_node()
        if node is not None:
            self._check_node(node, strategy)
            return
        require_kubeflow("launcher=kubernetes")
        if self.image is None:
            raise ConfigError(
                "launcher.image is not set: the container image the pods run, with runner and your project "
                "installed (e.g. launcher.image=registry.example.com/team/project:v1)."
            )
        if self.volume is None:
            raise ConfigError(
                "launcher.volume is not set: the PersistentVolumeClaim (ReadWriteMany) that every pod mounts "
                f"at launcher.mount_path={self.mount_path}, where the run dir is. Without it the checkpoints and "
                "results would end with the pods. Set launcher.volume=<claim name>."
            )
        check_object_names(self.image, self.namespace, self.volume)
        mount = Path(self.mount_path)
        # normalized first: /runs/../etc names /etc
        if not mount.is_absolute() or (
            self.run_dir is not None and not Path(os.path.normpath(self.run_dir)).is_relative_to(mount)
        ):
            raise ConfigError(
                f"launcher.run_dir={self.run_dir} is not under launcher.mount_path={self.mount_path} (an absolute "
                "path): the pods' run dir must be on the volume. Set launcher.run_dir under the mount path, or "
                "leave it null."
            )
        if reserved := sorted(set(self.env) & set(RESERVED)):
            raise ConfigError(
                f"launcher.env sets {', '.join(reserved)}: the runtime sets these in every pod (they place the "
                "pod in the job). Leave them out; launcher.nodes and hardware.num_processes decide them."
            )
        if self.name is not None:
            check_name(self.name, "launcher.name")
        if self.submit:
            current_context()

    def _check_node(self, node: TrainJobNode, strategy: Strategy) -> None:
        if node.node_rank != 0:  # only the first pod composes (`python -m runner.launchers.kubernetes`)
            raise ConfigError(
                f"this pod is node {node.node_rank} of its TrainJob (PET_NODE_RANK) and ran `python -m runner`: "
                "only the first pod composes the job, the others take it from there. Every pod of a TrainJob "
                "that runner writes runs `python -m runner.launchers.kubernetes`: write this one again with "
                "`python -m runner launcher=kubernetes ...`."
            )
        if (node.nodes, node.procs_per_node) != (self.nodes, str(strategy.num_processes)):
            raise ConfigError(
                f"this pod's TrainJob has {node.nodes} node(s) of {node.procs_per_node} process(es) "
                f"(PET_NNODES, PET_NPROC_PER_NODE), the config launcher.nodes={self.nodes} and "
                f"hardware.num_processes={strategy.num_processes}: the TrainJob was edited or written for "
                "other settings. Write it again with `python -m runner launcher=kubernetes ...`."
            )

    def describe(self, cfg: DictConfig, strategy: Strategy) -> str:
        gpus = f", {self.gpus_per_node} GPU(s)" if self.gpus_per_node else ""
        where = f"submitted to kube context {current_context()}" if self.submit else "written, not submitted"
        restarts = f", each pod's ranks restarted up to {self.restarts} time(s)" if self.restarts else ""
        return (
            f"KubernetesLauncher: a TrainJob ({self.runtime}) of {self.nodes} pod(s) x {strategy.num_processes} "
            f"process(es){gpus}, image {self.image}, namespace {self.namespace}, run dir on volume {self.volume} "
            f"at {self.mount_path}{restarts}; {where}"
        )

    def launch(self, job: Job) -> dict[str, float]:
        node = launched_node()
        if node is not None:  # the first pod (the others never compose: `run_node`)
            first = FirstNode(node.master_addr, node.master_port, node.nodes - 1)
            first.launch(job, self.restarts)
            strategy = job.strategy
            ranks = strategy.num_processes if strategy is not None else int(node.procs_per_node)
            try:
                return LocalLauncher(restarts=self.restarts).launch_node(job, node, ranks)
            finally:
                del first  # the store the pods met at, until the ranks are done
        manifest = self.trainjob(job)
        path = job.output_dir / MANIFEST
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, yaml.safe_dump(manifest, sort_keys=False))
        name, run_dir = manifest["metadata"]["name"], self.pod_run_dir(job.output_dir)
        if not self.submit:
            log.info(
                "wrote TrainJob %s to %s (`kubectl apply -f %s` starts it); the pods' run dir: %s on volume %s",
                name,
                path,
                path,
                run_dir,
                self.volume,
            )
            return {}
        submit(manifest)
        log.info(
            "submitted TrainJob %s to namespace %s; the pods' run dir: %s", name, self.namespace, run_dir
        )
        try:
            follow(name, self.namespace, self.poll_interval_s)
        except KeyboardInterrupt:
            raise TrainingInterrupted(
                f"stopped following; TrainJob {name} goes on (`kubectl delete trainjob {name} -n "
                f"{self.namespace}` stops it)."
            ) from None
        log.info("TrainJob %s is complete; its run dir: %s on volume %s", name, run_dir, self.volume)
        return {}

    def skip(self, reason: str) -> None:
        node = launched_node()
        if node is not None:
            FirstNode(node.master_addr, node.master_port, node.nodes - 1).skip(reason)

    def pod_run_dir(self, output_dir: Path) -> str:
        """The run dir in the pods: `run_dir`, else the command's, relative to its working dir, under the
        mount path."""
        if self.run_dir is not None:
            return self.run_dir
        relative = (
            output_dir.resolve().relative_to(Path.cwd())
            if output_dir.resolve().is_relative_to(Path.cwd())
            else Path(output_dir.name)
        )
        return str(Path(self.mount_path) / relative)

    def trainjob(self, job: Job) -> dict:
        """The TrainJob of `job`, checked against Kubeflow's schema."""
        hydra = HydraConfig.get()
        strategy = job.strategy
        assert strategy is not None  # the command built it
        options = [
            f"--config-dir={_relative(source.path)}"
            for source in hydra.runtime.config_sources
            if source.provider == "command-line"
        ]
        if hydra.job.config_name != "config":
            options.append(f"--config-name={hydra.job.config_name}")
        overrides = [o for o in hydra.overrides.task if not o.startswith("hydra.run.dir=")]
        limits = {
            key: value
            for key, value in {
                "nvidia.com/gpu": str(self.gpus_per_node) if self.gpus_per_node else None,
                "cpu": f"{self.cpus_per_node:g}" if self.cpus_per_node else None,
                "memory": f"{self.mem_gb:g}G" if self.mem_gb else None,
            }.items()
            if value is not None
        }
        manifest = trainjob(
            name=self.name or job_name(job.output_dir.name),
            namespace=self.namespace,
            runtime=self.runtime,
            image=str(self.image),
            args=[*options, *overrides, f"hydra.run.dir={self.pod_run_dir(job.output_dir)}"],
            nodes=self.nodes,
            procs_per_node=strategy.num_processes,
            limits=limits,
            env=self.env,
            claim=str(self.volume),
            mount_path=self.mount_path,
        )
        check_trainjob(manifest)
        return manifest


def _relative(path: str) -> str:
    """A config dir as the pods read it: relative to the working dir where it lies under it."""
    path = path.removeprefix("file://")
    return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else path
