"""The TrainJob that `launcher=kubernetes` writes: a Kubeflow Trainer v2 `TrainJob` of the
`torch-distributed` runtime, checked against the model classes of Kubeflow's own SDK
(`kubeflow_trainer_api`)."""

from __future__ import annotations

import re
from typing import Any

from runner.errors import ConfigError, install_command

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
NODE = "node"  # the runtime's replicated job and trainer container
VOLUME = "runner-runs"  # the run dir's volume, as the pod spec names it
MANAGER = "runner"  # the runtime patch's owner
NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 40  # the JobSet names each pod <name>-node-<job>-<index>-<suffix>, within DNS's 63
RESERVED = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def require_kubeflow(what: str) -> None:
    """ConfigError unless Kubeflow's SDK (its TrainJob models) is installed."""
    try:
        import kubeflow_trainer_api  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{what} needs Kubeflow's SDK (the TrainJob models it checks the TrainJob against), which is not "
            f"installed. Install it with `{install_command('kubernetes')}`."
        ) from None


def job_name(run_dir_name: str) -> str:
    """A TrainJob name made from a run dir's name: runner-<name>, lower case, letters, digits and '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"runner-{run_dir_name}".lower())[:MAX_NAME]
    return name.strip("-")


LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # DNS-1123 label: a namespace (at most 63)
SUBDOMAIN = re.compile(rf"{LABEL}(\.{LABEL})*")  # DNS-1123 subdomain: a claim's name (at most 253)
# A container image reference: [registry[:port]/]path[:tag][@digest] (the distribution spec's grammar)
COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE = re.compile(
    rf"(?:[a-zA-Z0-9.-]+(?::\d+)?/)?{COMPONENT}(?:/{COMPONENT})*(?::\w[\w.-]{{0,127}})?(?:@[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{{32,}})?"
)


def check_object_names(image: str, namespace: str, claim: str) -> None:
    """ConfigError naming the setting when the image, namespace or claim is not what Kubernetes takes."""
    if not IMAGE.fullmatch(image):
        raise ConfigError(
            f"launcher.image={image!r}: not a container image reference ([registry[:port]/]name[:tag][@digest], "
            "lower-case, no spaces), which the pods could not pull. Give the image as `docker push` named it, e.g. "
            "registry.example.com/team/project:v1."
        )
    if not re.fullmatch(LABEL, namespace) or len(namespace) > 63:
        raise ConfigError(
            f"launcher.namespace={namespace!r}: a namespace is a DNS label (lower-case letters, digits and '-', at "
            "most 63, starting and ending with a letter or digit), so Kubernetes would refuse the TrainJob. Give the "
            "namespace as `kubectl get namespaces` lists it."
        )
    if not SUBDOMAIN.fullmatch(claim) or len(claim) > 253:
        raise ConfigError(
            f"launcher.volume={claim!r}: a PersistentVolumeClaim's name is a DNS subdomain (lower-case letters, "
            "digits, '-' and '.'), so no claim has it. Give the claim as `kubectl get pvc` lists it."
        )


def check_name(name: str, key: str) -> None:
    if not NAME.fullmatch(name) or len(name) > MAX_NAME:
        raise ConfigError(
            f"{key}={name!r}: a TrainJob's name must be lower-case letters, digits and '-', start with a letter, "
            f"end with a letter or digit, and hold at most {MAX_NAME} characters (its pods' names add to it). "
            "Pick such a name, or leave it null to name it after the run dir."
        )


def trainjob(
    *,
    name: str,
    namespace: str,
    runtime: str,
    image: str,
    args: list[str],
    nodes: int,
    procs_per_node: int,
    limits: dict[str, str],
    env: dict[str, str],
    claim: str,
    mount_path: str,
) -> dict[str, Any]:
    """The TrainJob: `nodes` pods of `image`, each running `python -m runner.launchers.kubernetes <args>` with
    `procs_per_node` ranks and `limits`, the PersistentVolumeClaim `claim` mounted at `mount_path`."""
    trainer: dict[str, Any] = {
        "image": image,
        "command": ["python", "-m", "runner.launchers.kubernetes"],  # the first pod composes, the others join
        "args": list(args),
        "numNodes": nodes,
        "numProcPerNode": procs_per_node,
        "env": [
            {"name": key, "value": str(value)} for key, value in {"PYTHONUNBUFFERED": "1", **env}.items()
        ],
    }
    if limits:
        trainer["resourcesPerNode"] = {"limits": dict(limits), "requests": dict(limits)}
    pod = {
        "volumes": [{"name": VOLUME, "persistentVolumeClaim": {"claimName": claim}}],
        "containers": [{"name": NODE, "volumeMounts": [{"name": VOLUME, "mountPath": mount_path}]}],
    }
    node_job = {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": MANAGER},
        },
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": runtime},
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": MANAGER,
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node_job]}}},
                }
            ],
        },
    }


def check_trainjob(manifest: dict[str, Any]) -> None:
    """`manifest` read by Kubeflow's own `TrainJob` model and written back unchanged: every field known
    to the schema, of its type (ConfigError naming what is not)."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
    from pydantic import ValidationError

    try:
        again = TrainerV1alpha1TrainJob.from_dict(manifest).to_dict()
    except ValidationError as err:
        raise ConfigError(f"the TrainJob does not match Kubeflow's TrainJob schema: {err}") from None
    if again != manifest:
        raise ConfigError(
            "the TrainJob does not match Kubeflow's TrainJob schema: fields it does not know were dropped "
            f"(written {manifest}, read back {again})."
        )
