"""The Engine and what it wraps: `engine` (the `Engine`, its options `Accumulation` and `Loading`),
`collectives` (over nested tensors, through the strategy), `process_control` (a process's place in its
job), `data_loader` (sharded, resumable dataloaders) and `prepared` (the optimizer and scheduler that
`prepare` returns)."""

from runner.engine.engine import Accumulation, Engine, Loading

__all__ = ["Accumulation", "Engine", "Loading"]
