"""`hydra/launcher=runner` (runner's default): where a sweep's jobs run is what their `launcher` says, so
that one run and a sweep share one set of keys. A Hydra plugin (Hydra takes launchers from the
`hydra_plugins` package only); it imports runner only when a sweep is launched on SLURM, so that finding
it costs other Hydra apps nothing."""

from __future__ import annotations

from collections.abc import Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

SLURM_LAUNCHER = "runner.launchers.slurm.SlurmLauncher"


class RunnerLauncher(Launcher):
    """A sweep's jobs with `launcher=slurm` are queued as SLURM arrays, with the same `launcher.*` keys as
    one run (`runner.launchers.slurm.launch_sweep`); any other sweep runs its jobs one after another in
    this process, as Hydra's basic launcher does (each job's own launcher starts its ranks).

    (It is not a subclass of Hydra's `BasicLauncher`, whose module Hydra's plugin scan executes again,
    replacing the class; it hands over to that class as it finds it.)
    """

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.config = config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.task_function is not None and self.hydra_context is not None
        if OmegaConf.select(self.config, "launcher._target_") == SLURM_LAUNCHER:
            from runner.launchers.slurm import launch_sweep

            return launch_sweep(
                self.hydra_context, self.task_function, self.config, job_overrides, initial_job_idx
            )
        basic = BasicLauncher()
        basic.setup(hydra_context=self.hydra_context, task_function=self.task_function, config=self.config)
        return basic.launch(job_overrides, initial_job_idx)
