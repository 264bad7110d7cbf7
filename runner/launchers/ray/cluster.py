"""The Ray cluster as the launching process sees it before anything is submitted: connecting to it, its
alive nodes and their resources, whether a worker group fits (and where Ray would likely put it), and
whether every node writes to the run dir the launching process reads."""

from __future__ import annotations

import logging
import os
import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.errors import ConfigError, install_command

log = logging.getLogger(__name__)

# launcher.placement -> Ray's placement group strategy
PLACEMENTS = {
    "pack": "PACK",
    "spread": "SPREAD",
    "strict_pack": "STRICT_PACK",
    "strict_spread": "STRICT_SPREAD",
}
# The launching process's variables that its ranks get too (Ray's workers have their raylet's environment,
# not the command's): where code is found, and the settings of what runs in a rank.
FORWARDED_PREFIXES = (
    "RUNNER_",
    "MLFLOW_",
    "WANDB_",
    "HF_",
    "HUGGING_FACE_",
    "TOKENIZERS_",
    "TORCH_",
    "NCCL_",
    "GLOO_",
    "CUDA_LAUNCH_BLOCKING",
)


def require_ray(what: str) -> None:
    """ConfigError unless Ray Train is installed."""
    try:
        import ray.train  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{what} needs Ray Train, which is not installed. Install it with `{install_command('ray')}` "
            "(on every node of the cluster too)."
        ) from None


def connect(address: str, runtime_env: dict[str, Any]) -> None:
    """This process joined to the Ray cluster at `address` ("auto": the one this machine belongs to,
    "local": one started for this command, else "host:port"), once; ConfigError when none answers."""
    import ray

    if ray.is_initialized():  # a sweep's job runs inside the cluster, already joined
        return
    if address not in ("auto", "local") and not re.fullmatch(HEAD, address):
        raise ConfigError(
            f"launcher.address={address!r}: expected auto (the cluster this machine belongs to, or RAY_ADDRESS), "
            "local (one started on this machine for the run), or the head's <host>:<port> (ray start --head "
            "prints it, e.g. 10.0.0.1:6379)."
        )
    head = _auto_address() if address == "auto" else address
    if head and re.fullmatch(HEAD, head):  # Ray retries a head that is not there, or does not answer, for minutes
        host, _, port = head.removeprefix("ray://").rpartition(":")
        if (silent := _unanswered(host, int(port))) is not None:
            raise ConfigError(_no_cluster(address, f"{head}: {silent}")) from None
    env_vars = {
        name: value
        for name, value in os.environ.items()
        if name == "PYTHONPATH" or name.startswith(FORWARDED_PREFIXES)
    }
    cwd = os.getcwd()  # a user's `_target_: mypkg.MyNet` is found from the command's dir, as here
    env_vars["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, env_vars.get("PYTHONPATH")]))
    runtime_env = dict(runtime_env)
    runtime_env["env_vars"] = {**env_vars, **runtime_env.get("env_vars", {})}
    try:
        ray.init(
            address=None if address == "local" else address,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            log_to_driver=True,
        )
    except ConnectionError as err:
        raise ConfigError(_no_cluster(address, str(err).splitlines()[0])) from None


HEAD = r"(ray://)?[\w.\-]+:\d+"  # a head's address: host:port (ray:// for Ray Client)
ANSWER_S = 10.0  # how long a head's port has to connect and answer
# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server (a Ray head's GCS, Ray
# Client's server) answers with a SETTINGS frame of its own.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _unanswered(host: str, port: int) -> str | None:
    """Why `host:port` is not a head that answers within ANSWER_S (None: it answers as gRPC does): nothing
    accepts connections there, or something does and never answers (Ray's own client would wait minutes)."""
    try:
        with socket.create_connection((host, port), timeout=ANSWER_S) as connection:
            connection.sendall(HTTP2_PREFACE)
            answer = connection.recv(9)
    except TimeoutError:
        return f"it accepted a connection but gave no answer within {ANSWER_S:.0f} s, as a Ray head does at once"
    except OSError as err:
        return err.strerror or str(err)
    if len(answer) < 4 or answer[3] != 4:  # the first frame a gRPC server sends is SETTINGS (type 4)
        return "what answers there is not a Ray head (it does not speak gRPC)"
    return None


def _auto_address() -> str | None:
    """Where `address=auto` looks: RAY_ADDRESS, else the cluster that `ray start` last started on this
    machine (the address it leaves in Ray's temp dir)."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    started = Path(os.environ.get("RAY_TMPDIR", "/tmp/ray"), "ray_current_cluster")
    return started.read_text().strip() if started.exists() else None


def _no_cluster(address: str, why: str) -> str:
    return (
        f"launcher.address={address}: no Ray cluster answers there ({why}). Start one (`ray start --head` on the "
        "head node, `ray start --address=<head>:6379` on the others), give its address "
        "(launcher.address=<head>:6379, or RAY_ADDRESS with launcher.address=auto), or use "
        "launcher.address=local to start one on this machine for the run."
    )


@dataclass(frozen=True)
class Node:
    """An alive node of the cluster: its id, address and resources."""

    node_id: str
    ip: str
    cpus: float
    gpus: float

    @property
    def name(self) -> str:
        return f"{self.ip} ({self.node_id[:8]})"


def alive_nodes() -> list[Node]:
    import ray

    return [
        Node(
            node["NodeID"],
            node["NodeManagerAddress"],
            node["Resources"].get("CPU", 0),
            node["Resources"].get("GPU", 0),
        )
        for node in ray.nodes()
        if node["Alive"]
    ]


def placement(nodes: list[Node], workers: int, cpus: float, gpus: float, strategy: str) -> dict[str, int]:
    """Where Ray would put `workers` workers of `cpus` CPUs and `gpus` GPUs each (node name -> workers), on
    an idle cluster; ConfigError naming what is missing where they cannot all be placed (Ray would wait for
    them forever)."""
    free = {node.name: [node.cpus, node.gpus] for node in nodes}

    def fits(name: str) -> bool:
        return free[name][0] >= cpus and free[name][1] >= gpus

    placed: dict[str, int] = {}
    order = list(free)
    for _ in range(workers):
        if strategy in ("pack", "strict_pack"):
            candidates = [name for name in order if fits(name)]
            candidates.sort(key=lambda name: -placed.get(name, 0))  # fill the node already used
        else:  # spread: the node with the fewest of this group's workers
            candidates = [
                name for name in order if fits(name) and (strategy == "spread" or name not in placed)
            ]
            candidates.sort(key=lambda name: placed.get(name, 0))
        if strategy == "strict_pack" and placed:
            candidates = [name for name in candidates if name in placed]
        if not candidates:
            raise ConfigError(_unplaceable(nodes, workers, cpus, gpus, strategy))
        name = candidates[0]
        free[name][0] -= cpus
        free[name][1] -= gpus
        placed[name] = placed.get(name, 0) + 1
    return placed


def _unplaceable(nodes: list[Node], workers: int, cpus: float, gpus: float, strategy: str) -> str:
    total_cpus, total_gpus = sum(n.cpus for n in nodes), sum(n.gpus for n in nodes)
    has = f"the cluster has {len(nodes)} node(s), {total_cpus:g} CPU(s) and {total_gpus:g} GPU(s) in all"
    asks = (
        f"{workers} worker(s) of launcher.cpus_per_worker={cpus:g} and launcher.gpus_per_worker={gpus:g} "
        f"with launcher.placement={strategy}"
    )
    if strategy == "strict_spread":
        why = "one worker per node needs as many nodes that each hold one worker"
    elif strategy == "strict_pack":
        why = "all of them on one node needs a node that holds them all"
    else:
        why = "they do not fit in what the nodes have"
    return (
        f"{asks}: {has}, and {why}; Ray would wait for the resources forever. Ask for fewer workers "
        "(hardware.num_processes), fewer CPUs or GPUs per worker, another launcher.placement, or add nodes."
    )


def check_shared(run_dir: Path, nodes: list[Node]) -> None:
    """ConfigError unless every node writes to `run_dir` and this process reads what it wrote (the ranks
    write checkpoints and reports there, and the launcher reads them): a task on each node writes a file
    named by a token this process made."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = ray.remote(num_cpus=0)(_write_probe)
    answers = ray.get(
        [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            ).remote(str(run_dir), f".ray-probe-{token}-{index}")
            for index, node in enumerate(nodes)
        ]
    )
    problems = []
    for index, (node, problem) in enumerate(zip(nodes, answers, strict=True)):
        written = run_dir / f".ray-probe-{token}-{index}"
        if problem is None and not written.exists():
            problem = "it wrote there, but not to the disk this process reads: a path of its own"
        written.unlink(missing_ok=True)
        if problem is not None:
            problems.append(f"node {node.name}: {problem}")
    if problems:
        raise ConfigError(
            f"the run dir {run_dir} is not storage every node of the Ray cluster writes and this process reads "
            f"({'; '.join(problems)}). The ranks write checkpoints, metrics and reports there and the launcher "
            "reads them: put the run on a filesystem every node mounts at the same path (NFS, Lustre, a cloud "
            "filesystem) with hydra.run.dir=<path on it> (hydra.sweep.dir for a sweep), and run the command "
            "from a node that mounts it."
        )


def _write_probe(run_dir: str, name: str) -> str | None:
    """On a node: write `name` into `run_dir`; why it could not, or None."""
    try:
        Path(run_dir, name).write_text(name)
    except OSError as err:
        return f"cannot write there ({err.strerror or err})"
    return None
