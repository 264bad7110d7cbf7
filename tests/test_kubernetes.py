"""`launcher=kubernetes`: the TrainJob it writes, read by Kubeflow's own TrainJob model, and that TrainJob's
pods run for real as two network namespaces on this machine, each given what the `torch-distributed`
runtime gives a pod: its `PET_*` variables, the first pod's name in the job's headless service (resolved
through a hosts file mounted for the pod alone), its own hostname and the volume at the mount path. No
Kubernetes API server can run here: submitting is refused without a kube context, and not tested further."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import cli_env, runner_command
from netns import as_machine, bridged_namespaces

from runner.errors import ConfigError
from runner.hardware import DDP
from runner.launchers.kubernetes import KubernetesLauncher

pytestmark = pytest.mark.slow

POD_NAMESPACE, SUBNET = "runner-kpod", "10.251.79"  # pod i: namespace runner-kpod<i> at SUBNET.(10+i)
PODS = 2
TRAIN = [
    "trainer.max_steps=60",
    "trainer.eval_every=30",
    "trainer.checkpoint_every=20",
    "model.dropout=0.1",
    "hardware=ddp",
]
TRAINJOB = [
    "launcher=kubernetes",
    "launcher.image=registry.example.com/runner:test",
    "launcher.volume=runs",
    f"launcher.nodes={PODS}",
    "hardware.num_processes=1",
    "launcher.cpus_per_node=1.5",
    "launcher.mem_gb=2",
    "+launcher.env.RUNNER_TEST_POD=yes",
]
WEIGHTS = Path("model") / "model.safetensors"


@pytest.fixture(scope="module")
def pod_network() -> Iterator[list[str]]:
    """Two network namespaces on a bridge, as two pods' networks: their addresses."""
    with bridged_namespaces(POD_NAMESPACE, SUBNET, PODS) as addresses:
        yield addresses


def start_pods(manifest: dict, addresses: list[str], workdir: Path) -> list[subprocess.Popen]:
    """The TrainJob's pods started: its command and arguments in each namespace, with the trainer's
    environment and what the runtime adds (`PET_*`, the master's name, the pod's hostname), the first pod
    started last; by node rank. Each is the pod's agent itself (nsenter, unshare and sh exec it)."""
    name, trainer = manifest["metadata"]["name"], manifest["spec"]["trainer"]
    master = f"{name}-node-0-0.{name}"  # the runtime's PET_MASTER_ADDR: the first pod in the headless service
    procs = []
    for rank in reversed(range(PODS)):
        # As the kubelet writes a pod's /etc/hosts (its own name), with the master's name the cluster's DNS gives.
        pod = f"{name}-node-0-{rank}"
        hosts = workdir / f"hosts-{rank}"
        hosts.write_text(f"127.0.0.1 localhost\n{addresses[rank]} {pod}\n{addresses[0]} {master}\n")
        env = cli_env() | {e["name"]: e["value"] for e in trainer["env"]}
        env |= {
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": "29500",
        }
        command = [*as_machine(f"{POD_NAMESPACE}{rank}", pod, hosts), *trainer["command"], *trainer["args"]]
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                cwd=workdir,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # a pod's processes end together (`finished`)
            )
        )
    return procs[::-1]


def finished(pods: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    """The pods' ends, by node rank; a pod not ended within 300 s is killed with its ranks, as are the
    others then."""
    try:
        results = []
        for proc in pods:
            out, _ = proc.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
        return results
    finally:
        kill(pods)


def kill(pods: list[subprocess.Popen]) -> None:
    """The pods still running killed, with their ranks."""
    for proc in pods:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_pods(manifest: dict, addresses: list[str], workdir: Path) -> list[subprocess.CompletedProcess]:
    """The TrainJob's pods run to their end, by node rank."""
    return finished(start_pods(manifest, addresses, workdir))


@pytest.fixture(scope="module")
def local_weights(tmp_path_factory) -> bytes:
    """The weights of TRAIN on 2 local processes, which the TrainJob's 2 pods of 1 process each match."""
    run_dir = tmp_path_factory.mktemp("local")
    local = subprocess.run(
        runner_command(run_dir, *TRAIN, "hardware.num_processes=2"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert local.returncode == 0, local.stderr
    return (run_dir / WEIGHTS).read_bytes()


def write_trainjob(run_dir: Path, volume: Path, *overrides: str) -> tuple[dict, subprocess.CompletedProcess]:
    """The TrainJob the command writes for TRAIN on 2 pods (their volume at `volume`), and its process."""
    volume.mkdir(exist_ok=True)
    written = subprocess.run(
        runner_command(run_dir, *TRAIN, *TRAINJOB, f"launcher.mount_path={volume}", *overrides),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert written.returncode == 0, written.stderr
    return yaml.safe_load((run_dir / "kubernetes" / "trainjob.yaml").read_text()), written


def test_the_trainjob_matches_kubeflows_schema_and_its_pods_train_bitwise_as_local_ranks(
    pod_network, local_weights, tmp_path
):
    """The TrainJob of 2 pods x 1 process, read by Kubeflow's model; its pods (network namespaces, the first
    one's name resolved as the headless service resolves it) form one job of 2 ranks that ends with bitwise
    the weights of the same run on 2 local processes. Run again, the first pod finds the run finished and
    the other stops at once."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    volume = tmp_path / "volume"
    manifest, written = write_trainjob(tmp_path / "submit", volume)
    assert TrainerV1alpha1TrainJob.from_dict(manifest).to_dict() == manifest  # nothing unknown to the schema
    trainer, name = manifest["spec"]["trainer"], manifest["metadata"]["name"]
    assert name == "runner-submit" and manifest["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (PODS, 1)
    resources = {"cpu": "1.5", "memory": "2G"}  # launcher.cpus_per_node and mem_gb, for each pod
    assert trainer["resourcesPerNode"] == {"limits": resources, "requests": resources}
    assert {"name": "RUNNER_TEST_POD", "value": "yes"} in trainer["env"]
    assert trainer["command"] == ["python", "-m", "runner.launchers.kubernetes"]
    run_dir = volume / "submit"
    assert trainer["args"][-1] == f"hydra.run.dir={run_dir}" and "launcher.nodes=2" in trainer["args"]
    pod = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][
        0
    ]
    spec = pod["template"]["spec"]["template"]["spec"]
    assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == "runs"
    assert spec["containers"][0]["volumeMounts"][0]["mountPath"] == str(volume)
    assert (
        f"wrote TrainJob {name} to {tmp_path / 'submit' / 'kubernetes' / 'trainjob.yaml'}" in written.stderr
    )
    assert not run_dir.exists()  # written, not run

    pods = run_pods(manifest, pod_network, tmp_path)
    assert [p.returncode for p in pods] == [0, 0], "\n".join(p.stdout[-3000:] for p in pods)
    assert "final metrics" in pods[0].stdout and "nothing to run" not in pods[1].stdout
    assert (run_dir / WEIGHTS).read_bytes() == local_weights

    again = run_pods(manifest, pod_network, tmp_path)
    assert [p.returncode for p in again] == [0, 0], "\n".join(p.stdout[-3000:] for p in again)
    assert "nothing to train" in again[0].stdout
    assert f"node 1: nothing to run: {run_dir} holds a run that finished at step 60" in again[1].stdout


def test_with_restarts_each_pod_restarts_its_ranks_and_the_job_ends_as_if_never_interrupted(
    pod_network, local_weights, tmp_path
):
    """launcher.restarts=1: the second pod's rank killed (-9) after a checkpoint; each pod's agent starts
    its node's ranks again (the first pod's rank lost its peer), they meet afresh, resume from the latest
    checkpoint and end with bitwise the weights of the uninterrupted local run."""
    volume = tmp_path / "volume"
    manifest, _ = write_trainjob(tmp_path / "submit", volume, "launcher.restarts=1")
    assert "launcher.restarts=1" in manifest["spec"]["trainer"]["args"]
    run_dir = volume / "submit"
    pods = start_pods(manifest, pod_network, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "latest").exists():
            assert all(p.poll() is None for p in pods) and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        rank = int(subprocess.check_output(["pgrep", "-P", str(pods[1].pid), "-n"], text=True).split()[0])
        os.kill(rank, signal.SIGKILL)
    except BaseException:
        kill(pods)
        raise
    ended = finished(pods)
    assert [p.returncode for p in ended] == [0, 0], "\n".join(p.stdout[-3000:] for p in ended)
    assert "was killed by SIGKILL: restart 1 of 1, the ranks resume from the run's latest checkpoint" in ended[1].stdout
    assert "restart 1 of 1" in ended[0].stdout and "resumed from" in ended[0].stdout
    assert (run_dir / WEIGHTS).read_bytes() == local_weights


def test_submitting_without_a_kube_context_is_refused_before_anything_is_written(tmp_path):
    proc = subprocess.run(
        runner_command(tmp_path / "run", "hardware=ddp", *TRAINJOB, "launcher.submit=true"),
        env=cli_env() | {"KUBECONFIG": str(tmp_path / "no-such-config")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Configuration error: launcher.submit=true: no Kubernetes context to submit to" in proc.stderr
    assert not (tmp_path / "run" / "kubernetes").exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"volume": "runs"}, "launcher.image is not set"),
        ({"image": "i:1"}, "launcher.volume is not set"),
        (
            {"image": "i:1", "volume": "runs", "run_dir": "/elsewhere/x"},
            "is not under launcher.mount_path=/runs",
        ),
        (
            {"image": "i:1", "volume": "runs", "env": {"PET_NODE_RANK": "1"}},
            "launcher.env sets PET_NODE_RANK",
        ),
        ({"image": "i:1", "volume": "runs", "name": "Run_1"}, "launcher.name='Run_1': a TrainJob's name"),
        # what Kubernetes would refuse once submitted, or what would leave the volume
        ({"image": "my image:1", "volume": "runs"}, "launcher.image='my image:1': not a container image reference"),
        ({"image": "", "volume": "runs"}, "launcher.image='': not a container image reference"),
        ({"image": "i:1", "volume": "runs", "namespace": "My_Team"}, "launcher.namespace='My_Team': a namespace is a DNS label"),
        ({"image": "i:1", "volume": "Runs Claim"}, "launcher.volume='Runs Claim': a PersistentVolumeClaim's name is a DNS subdomain"),
        (
            {"image": "i:1", "volume": "runs", "run_dir": "/runs/../etc"},
            "launcher.run_dir=/runs/../etc is not under launcher.mount_path=/runs",
        ),
    ],
)
def test_what_a_trainjob_cannot_be_is_refused_naming_the_setting(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        KubernetesLauncher(**settings).check(None, None)  # type: ignore[arg-type]


def test_a_mapping_of_env_given_whole_says_how_hydra_takes_it(forked_cli):
    """`launcher.env={FOO: '1'}` adds no key (Hydra merges it into the empty mapping): the refusal says how
    to give it; `++` gives it whole."""
    proc = forked_cli("launcher=kubernetes", "launcher.image=i:1", "launcher.volume=runs", "launcher.env={FOO: '1'}")
    assert proc.returncode == 2, proc.stderr
    assert (
        "Configuration error: launcher.env.FOO: launcher.env holds keys of your own, and Hydra adds none to it from "
        "`launcher.env={...}` (it merges that mapping into the one there). Add the key with +launcher.env.FOO=<value>, "
        "or give the whole mapping with ++launcher.env={FOO: <value>}." in proc.stderr
    )
    whole = forked_cli("launcher=kubernetes", "launcher.image=i:1", "launcher.volume=runs", "++launcher.env={FOO: '1'}", "plan=true")
    assert whole.returncode == 0, whole.stderr


def test_a_pod_of_a_trainjob_written_for_other_settings_is_refused(monkeypatch):
    for name, value in {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0",
                        "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "29500"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"this pod's TrainJob has 3 node\(s\) of 1 process\(es\)"):
        KubernetesLauncher(image="i:1", volume="runs", nodes=2).check(None, DDP(num_processes=1))  # type: ignore[arg-type]
    monkeypatch.setenv("PET_NODE_RANK", "1")  # another pod than the first, given the CLI (an older TrainJob)
    with pytest.raises(ConfigError, match=r"this pod is node 1 of its TrainJob .*python -m runner\.launchers\.kubernetes"):
        KubernetesLauncher(image="i:1", volume="runs", nodes=3).check(None, DDP(num_processes=1))  # type: ignore[arg-type]


def test_without_kubeflows_sdk_the_install_line_is_given(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "kubeflow_trainer_api", None)
    with pytest.raises(ConfigError, match=r"pip install .*\[kubernetes\]"):
        KubernetesLauncher(image="i:1", volume="runs").check(None, None)  # type: ignore[arg-type]
