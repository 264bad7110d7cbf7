"""Hardware strategies: one class per file, each instantiated by `conf/hardware/<name>.yaml`."""

from runner.hardware.base import Strategy
from runner.hardware.cpu import SingleDevice

__all__ = ["SingleDevice", "Strategy"]
