"""What a launcher is given (a `Job`) and what each rank it starts runs (`train_as_rank`)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.environment import launched_environment
from runner.infer import infer
from runner.log import configure_rank_logging
from runner.task import is_inference
from runner.train import train


@dataclass
class Job:
    """One job of a run or sweep, as every rank needs it (picklable: ranks may be spawned).

    Args:
        cfg: the composed config, interpolations resolved (ranks never run Hydra again).
        output_dir: the job's directory, owned by the process that ran Hydra; every rank writes there.
        logging_config: the `logging.config.dictConfig` the job logs with (Hydra's `job_logging`).
    """

    cfg: DictConfig
    output_dir: Path
    logging_config: dict[str, Any] | None = None


class RankFailedError(RuntimeError):
    """A rank of the job raised or was killed; the other ranks were stopped."""


class Launcher(ABC):
    """Starts the ranks of a job and returns rank 0's metrics."""

    @abstractmethod
    def launch(self, job: Job) -> dict[str, float]: ...

    @abstractmethod
    def world_size(self, cfg: DictConfig) -> int:
        """How many ranks `launch` will run for `cfg` (checked against a checkpoint before launching)."""

    def check(self, cfg: DictConfig) -> None:
        """Raise ConfigError for what would fail only once launched (e.g. more than a cluster has)."""

    @abstractmethod
    def describe(self, cfg: DictConfig) -> str:
        """One line for the plan: where and how the ranks would start."""


def train_as_rank(job: Job) -> dict[str, float]:
    """The body of every rank: its logging (only rank 0 logs below warnings), then the training loop (or
    the inference task); rank 0 writes the final metrics to `metrics.json` in the job's dir."""
    env = launched_environment()
    rank = env.rank if env else 0
    configure_rank_logging(job.logging_config, rank)
    run = infer if is_inference(job.cfg.task._target_) else train
    metrics = run(job.cfg, job.output_dir)
    if rank == 0:
        (job.output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
