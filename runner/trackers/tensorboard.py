"""`tracker=tensorboard` and `log_with="tensorboard"`: TensorBoard event files through torch's
`SummaryWriter` (an extra: `pip install 'runner-ml[tensorboard]'`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runner.trackers.base import Tracker, directory_setting, flatten


class TensorBoardTracker(Tracker):
    """Writes scalars (`add_scalar`), texts (`add_text`) and dicts of scalars (`add_scalars`) by step, and
    the run's configuration as hyperparameters, to `<logging_dir>/<project name>/`.

    Args:
        experiment_name: the run's folder name (Accelerate's `project_name` in `init_trackers` wins).
        logging_dir: where the folder goes; None: the Accelerator's `logging_dir` (else `project_dir`),
            which for `python -m runner` is the run's directory.
        writer_kwargs: passed on to `SummaryWriter` (`flush_secs`, `max_queue`, ...).
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(
        self, experiment_name: str = "runner", logging_dir: str | None = None, **writer_kwargs: Any
    ) -> None:
        self.experiment_name = experiment_name
        self.logging_dir = directory_setting(logging_dir, "tracker.logging_dir")
        self.writer_kwargs = writer_kwargs
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        """The `SummaryWriter`."""
        return self.writer

    def describe(self) -> str:
        return f"tensorboard -> {self.logging_dir or '<run dir>'}/{self.experiment_name}"

    @property
    def run_dir(self) -> Path | None:
        return Path(self.writer.log_dir) if self.writer is not None else None

    def start(
        self,
        project_name: str | None = None,
        logging_dir: str | None = None,
        tags: dict[str, Any] | None = None,
        resumed_at: int | None = None,
        run_name: str | None = None,
    ) -> None:
        """Open the event file; resumed, TensorBoard drops the earlier files' events after `resumed_at`
        (`purge_step`): the steps logged again replace them. TensorBoard names a run by its directory,
        under the run's own (`run_name` is not needed); the tags are its "tags" text."""
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where it is used

        root = self.logging_dir or logging_dir
        if root is None:
            raise ValueError(
                'log_with="tensorboard" needs a directory: Accelerator(project_dir=...) or '
                "logging_dir=..., or TensorBoardTracker(logging_dir=...)."
            )
        purge = {} if resumed_at is None else {"purge_step": resumed_at + 1}
        self.writer = SummaryWriter(
            str(Path(root) / (project_name or self.experiment_name)), **purge, **self.writer_kwargs
        )
        if tags:
            self.writer.add_text("tags", ", ".join(f"{k}={v}" for k, v in sorted(tags.items())))

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """The configuration as hyperparameters (nested keys joined with dots; other than numbers,
        booleans and strings as their text)."""
        flat = {
            key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in flatten(values)
        }
        from torch.utils.tensorboard.summary import hparams

        # Into the run's own event file (`add_hparams` would open a second one beside it).
        file_writer = self.writer.file_writer
        for summary in hparams(flat, metric_dict={}):
            file_writer.add_summary(summary)
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, Mapping):
                self.writer.add_scalars(key, dict(value), global_step=step, **kwargs)
            else:
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self, status: str = "FINISHED") -> None:
        if self.writer is not None:
            self.writer.close()
