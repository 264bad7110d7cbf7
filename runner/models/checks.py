"""Range checks the shipped models apply to their settings, so that a size of 0 or a dropout of 2 is
refused by name before launch instead of training a meaningless model."""

from __future__ import annotations

from runner.errors import ConfigError


def check_sizes(dropout: float = 0.0, **sizes: int) -> None:
    """A ConfigError naming each `model.<size>` below 1, and a dropout outside [0, 1)."""
    bad = [f"model.{name}={value}" for name, value in sizes.items() if value < 1]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: model sizes must be >= 1.")
    if not 0 <= dropout < 1:
        raise ConfigError(
            f"model.dropout={dropout}: must be in [0, 1) (the probability of zeroing an activation)."
        )
