"""Machines on one bridge, as network namespaces on this one (root and `ip` needed): what the Kubernetes
pods and the elastic job's nodes run in. Namespace `<name><i>` has address `<subnet>.<10 + i>`; this
machine is `<subnet>.1` on the bridge."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True)


@contextlib.contextmanager
def bridged_namespaces(name: str, subnet: str, count: int) -> Iterator[list[str]]:
    """`count` network namespaces `<name>0`... on a bridge `<name>-br`, each with a veth of its own: their
    addresses. Removed after (and before: what an interrupted session left)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need `ip` and root")
    bridge = f"{name}-br"
    _remove(name, bridge, count)
    addresses = [f"{subnet}.{10 + i}" for i in range(count)]
    _ip("link", "add", bridge, "type", "bridge")
    try:
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, address in enumerate(addresses):
            namespace, host, inside = f"{name}{i}", f"{name}-h{i}", f"{name}-n{i}"
            _ip("netns", "add", namespace)
            _ip("link", "add", host, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "set", inside, "up")
            _ip("link", "set", host, "master", bridge)
            _ip("link", "set", host, "up")
        yield addresses
    finally:
        _remove(name, bridge, count)


def _remove(name: str, bridge: str, count: int) -> None:
    for i in range(count):
        subprocess.run(["ip", "netns", "del", f"{name}{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{name}-h{i}"], capture_output=True)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def as_machine(namespace: str, hostname: str, hosts: Path) -> list[str]:
    """The command prefix that runs a command as a machine of its own: in `namespace`'s network, under
    `hostname`, with `hosts` as its /etc/hosts (where every machine's name resolves to its address). The
    command is exec'd: its pid is the prefix's."""
    return ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--mount", "--uts", "sh", "-c",
            f'mount --bind {hosts} /etc/hosts && hostname {hostname} && exec "$@"', "sh"]  # fmt: skip
