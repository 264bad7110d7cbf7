"""`runner join <host:port>`: this node becomes one of an elastic job's nodes (`launcher=elastic`): it takes
the job from the first node, where `python -m runner` composed it, and starts its ranks."""

from __future__ import annotations

import sys

from runner.errors import ConfigError
from runner.launchers.elastic import join_node


def main(arguments: list[str]) -> None:
    """Join the job whose first node serves `host:port`; exit with this node's exit code."""
    if len(arguments) != 1 or arguments[0].startswith("-"):
        raise ConfigError(
            "runner join takes one argument: the host:port where the first node of a launcher=elastic job "
            "serves it (its log names it), e.g. `runner join node1:29400`."
        )
    sys.exit(join_node(arguments[0]))
