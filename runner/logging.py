"""Accelerate's `accelerate.logging` names, for scripts that import them from here (`from runner.logging
import get_logger`)."""

from runner.log import MultiProcessAdapter, get_logger

__all__ = ["MultiProcessAdapter", "get_logger"]
