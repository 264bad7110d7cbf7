"""`hydra/launcher=runner` (runner's default): where a sweep's jobs run is what their `launcher` says, so
that one run and a sweep share one set of keys. A Hydra plugin (Hydra takes launchers from the
`hydra_plugins` package only); it imports runner only when a sweep is launched, so that finding it costs
other Hydra apps nothing."""

from __future__ import annotations

from collections.abc import Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf


class RunnerLauncher(Launcher):
    """Hands a sweep's jobs to the `launch_sweep` of their `launcher` class (`runner.launchers.base.Launcher`:
    one after another in this process, unless the launcher queues them elsewhere, as `launcher=slurm` does
    with SLURM arrays, with the same `launcher.*` keys as one run). A config without a runner launcher runs
    its jobs as Hydra's basic launcher does.

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
        target = OmegaConf.select(self.config, "launcher._target_")
        if target is not None:
            from runner.launchers.base import Launcher as RunnerLauncherContract
            from runner.launchers.base import Sweep

            launcher = get_class(target)
            if isinstance(launcher, type) and issubclass(launcher, RunnerLauncherContract):
                sweep = Sweep(
                    self.hydra_context, self.task_function, self.config, job_overrides, initial_job_idx
                )
                return launcher.launch_sweep(sweep)
        basic = BasicLauncher()
        basic.setup(hydra_context=self.hydra_context, task_function=self.task_function, config=self.config)
        return basic.launch(job_overrides, initial_job_idx)
