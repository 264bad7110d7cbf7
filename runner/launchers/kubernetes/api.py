"""The Kubernetes API, through the official client (`launcher.submit=true`): the current context, the
TrainJob created there, and its state and first pod's log followed until it ends."""

from __future__ import annotations

import logging
import time
from typing import Any

from runner.errors import ConfigError, RankFailedError, install_command
from runner.launchers.kubernetes.manifest import GROUP, NODE, PLURAL, VERSION

log = logging.getLogger(__name__)

# The labels of the TrainJob's first pod: its JobSet is named after it; its Job's completion index is 0.
FIRST_POD = "jobset.sigs.k8s.io/jobset-name={name},batch.kubernetes.io/job-completion-index=0"


def current_context() -> str:
    """The kube context this process submits to (ConfigError where the client or a context is missing)."""
    try:
        from kubernetes import config
    except ImportError:
        raise ConfigError(
            "launcher.submit=true needs the Kubernetes client, which is not installed. Install it with "
            f"`{install_command('kubernetes')}`, or set launcher.submit=false to write the TrainJob only."
        ) from None
    try:
        config.load_kube_config()
        _, active = config.list_kube_config_contexts()
    except (config.ConfigException, OSError) as err:
        raise ConfigError(
            f"launcher.submit=true: no Kubernetes context to submit to ({err}). Point KUBECONFIG (or "
            "~/.kube/config) at the cluster, or set launcher.submit=false to write the TrainJob only and "
            "apply it yourself (`kubectl apply -f <run dir>/kubernetes/trainjob.yaml`)."
        ) from None
    return active["name"]


def submit(manifest: dict[str, Any]) -> None:
    """Create the TrainJob `manifest` in its namespace (ConfigError where one of its name is there)."""
    from kubernetes import client

    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    try:
        client.CustomObjectsApi().create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)
    except client.exceptions.ApiException as err:
        if err.status == 409:
            raise ConfigError(
                f"a TrainJob named {name} is in namespace {namespace} already: delete it (`kubectl delete "
                f"trainjob {name} -n {namespace}`; its run dir stays on the volume) or set launcher.name."
            ) from None
        raise ConfigError(
            f"the cluster refused TrainJob {name}: {err.status} {err.reason}: {err.body}"
        ) from None


def follow(name: str, namespace: str, poll_interval_s: float) -> None:
    """Print the first pod's log as it grows until the TrainJob is complete; RankFailedError when it failed."""
    from kubernetes import client

    custom, core = client.CustomObjectsApi(), client.CoreV1Api()
    printed = 0
    while True:
        job = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        states = {
            c["type"]: c for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"
        }
        printed = _print_log(core, name, namespace, printed)
        if "Complete" in states:
            return
        if "Failed" in states:
            raise RankFailedError(
                f"TrainJob {name} failed: {states['Failed'].get('message', states['Failed'].get('reason'))}. "
                f"`kubectl logs -n {namespace} -l jobset.sigs.k8s.io/jobset-name={name} --prefix` shows every pod's log."
            )
        time.sleep(poll_interval_s)


def _print_log(core: Any, name: str, namespace: str, printed: int) -> int:
    """The first pod's log lines past the `printed` first, printed; how many are printed now."""
    from kubernetes import client

    pods = core.list_namespaced_pod(namespace, label_selector=FIRST_POD.format(name=name)).items
    if not pods:
        return printed
    try:
        lines = core.read_namespaced_pod_log(pods[0].metadata.name, namespace, container=NODE).splitlines()
    except client.exceptions.ApiException:  # not started yet
        return printed
    for line in lines[printed:]:
        print(line, flush=True)
    return max(printed, len(lines))
