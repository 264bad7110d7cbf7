"""`tracker=wandb` and `log_with="wandb"`: one Weights & Biases run per job (the `wandb` extra).

W&B keeps a run's records in its own process (wandb-core) until the run ends: a training process killed
before that (kill -9, out of memory, a lost node) would lose them all. So every record goes to a journal in
the run's dir first (`<run dir>/tracking/wandb/`), then to W&B; what W&B did not finish is given to it again
by the run's next start in the same dir (a resume) or by `python -m runner.trackers.upload <run dir>`.
Offline (`tracker.mode=offline`), W&B writes the run to `<run dir>/wandb/offline-run-*` for `wandb sync`."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import netrc
import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from runner.config import PythonOnly, checked
from runner.errors import ConfigError
from runner.run_dir import TRACKING
from runner.trackers.base import Tracker, directory_setting
from runner.trackers.journal import Journal
from runner.trackers.mlflow import UPLOAD, last_steps

log = logging.getLogger(__name__)

WANDB_JOURNAL = "wandb"  # inside the run's TRACKING
EXIT_CODES = {"FINISHED": 0, "FAILED": 1, "KILLED": 75}  # 75: stopped to be resumed (EX_TEMPFAIL)


class WandbMode(str, Enum):
    """Where W&B puts a run."""

    online = "online"  # sent to the W&B server as it runs (needs `wandb login` or WANDB_API_KEY)
    offline = "offline"  # written to <run dir>/wandb/offline-run-*, sent later with `wandb sync`


class WandbTracker(Tracker):
    """Logs the job's configuration, metrics by step and files to one W&B run.

    Args:
        project: the W&B project (Accelerate's `project_name` in `init_trackers` wins).
        entity: the W&B team or user the project belongs to; None: the login's default.
        mode: online or offline; None: `$WANDB_MODE`, else online.
        run_name: the run's display name; None: the one `start` is given (the runner's loop: its job's).
        tags: W&B tags of the run (the runner's facts, such as its dir and overrides, go into its config
            under `runner`).
        group: W&B's group of runs; None: a sweep's jobs are grouped by their sweep.
        notes: a description of the run.
        log_model: also attach the final model files (as a W&B artifact of type model).
        logging_dir: where the journal and W&B's files go; None: the run's dir.
        init_kwargs: more arguments of `wandb.init` (Accelerate's `init_kwargs={"wandb": {...}}` too).
    """

    name = "wandb"

    @checked("tracker")
    def __init__(
        self,
        project: str = "runner",
        entity: str | None = None,
        mode: WandbMode | None = None,
        run_name: str | None = None,
        tags: Sequence[str] = (),
        group: str | None = None,
        notes: str | None = None,
        log_model: bool = False,
        logging_dir: PythonOnly[str | None] = None,
        init_kwargs: PythonOnly[Mapping[str, Any] | None] = None,
    ) -> None:
        self.project = project
        self.entity = entity
        self.mode = wandb_mode(mode)
        if self.mode is WandbMode.online:
            check_login()
        self.run_name = run_name
        self.tags = [str(tag) for tag in tags]
        self.group = group
        self.notes = notes
        self.log_model = log_model
        self.logging_dir = directory_setting(logging_dir, "tracker.logging_dir")
        self.init_kwargs = dict(init_kwargs or {})
        self.journal: Journal | None = None
        self.delivery: WandbDelivery | None = None
        self._logged_to: dict[str, int] = {}  # resumed: each metric's last step in the journal

    @property
    def tracker(self) -> Any:
        """The `wandb` Run (`Accelerator.get_tracker("wandb", unwrap=True)`)."""
        return self.delivery.run if self.delivery is not None else None

    def describe(self) -> str:
        entity = f"{self.entity}/" if self.entity else ""
        return f"wandb ({self.mode.value}) -> project {entity}{self.project}"

    def start(
        self,
        project_name: str | None = None,
        logging_dir: str | None = None,
        tags: Mapping[str, Any] | Sequence[str] | None = None,
        resumed_at: int | None = None,
        run_name: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        """Open the journal and the W&B run. `tags`: the runner's facts (a mapping, into the run's config)
        or W&B tags (a list); `init_kwargs` go to `wandb.init`. A run started again in the same dir keeps
        its W&B run (its id), first gives W&B what the earlier process wrote and W&B did not finish, and
        logs no metric again at a step the journal holds (resumed from a checkpoint: those steps come again)."""
        root = Path(self.logging_dir or logging_dir or ".")
        self.journal = journal = Journal(root / TRACKING / WANDB_JOURNAL)
        self._logged_to = {} if resumed_at is None else last_steps(journal.events)
        started = [event for event in journal.events if event["op"] == "start"]
        run_id = started[0]["id"] if started else uuid.uuid4().hex[:8]
        facts = dict(tags) if isinstance(tags, Mapping) else {}
        listed = list(tags) if tags is not None and not isinstance(tags, Mapping) else []
        name = self.run_name or init_kwargs.pop("name", None) or run_name
        group = self.group or init_kwargs.pop("group", None)
        if group is None and "runner.sweep_job" in facts and name and "/" in name:
            group = name.rsplit("/", 1)[0]  # a sweep's jobs, `<sweep dir>/<job>`
        init_kwargs, live = plain_values({**self.init_kwargs, **init_kwargs})  # live: a wandb.Settings, say
        self.delivery = WandbDelivery(journal, live)
        self.delivery.send_pending()  # what an earlier process of this run wrote and W&B did not finish
        self._record(
            op="start",
            id=run_id,
            project=project_name or self.project,
            entity=init_kwargs.pop("entity", self.entity),
            mode=init_kwargs.pop("mode", self.mode.value),
            name=name,
            group=group,
            notes=init_kwargs.pop("notes", self.notes),
            tags=[*self.tags, *listed],
            facts={key: str(value) for key, value in facts.items()},
            dir=str(root),
            init_kwargs=init_kwargs,
        )
        atexit.register(self._finish_at_exit)

    def _finish_at_exit(self) -> None:
        self.finish("FAILED" if hasattr(sys, "last_value") else "FINISHED")

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._record(op="params", params=values)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers and text (a one-element tensor as its number) are journaled; W&B's own objects (an image,
        a table) go to the run directly, as they cannot be written to the journal."""
        step = step or 0
        metrics, rich = plain_values(
            {key: value for key, value in values.items() if step > self._logged_to.get(key, -1)}
        )
        if metrics:
            self._record(op="metrics", metrics=metrics, step=step)
        if rich and self.tracker is not None:
            self.tracker.log(rich, step=step)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._record(op="artifact", path=str(Path(path).resolve()), artifact_path=artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """End the W&B run as `status` (its exit code: 0, 1 for FAILED, 75 and preempted for KILLED); once
        W&B has written it, the journal marks every record delivered."""
        if self.delivery is None:
            return
        atexit.unregister(self._finish_at_exit)
        self._record(op="end", status=status)
        self.delivery = None

    def _record(self, **event: Any) -> None:
        assert self.journal is not None and self.delivery is not None, "start() the tracker first"
        self.journal.append(event)
        self.journal.refresh()
        self.delivery.send_pending()


class WandbDelivery:
    """Applies a journal's events to W&B in order: `start` opens the run (a `start` while it is open
    continues it), `params` updates its config, `metrics` logs a step, `artifact` attaches a file or dir,
    `end` finishes it; W&B has written a run once it is finished, so the journal marks its events
    delivered then."""

    def __init__(self, journal: Journal, live_kwargs: Mapping[str, Any] | None = None) -> None:
        self.journal = journal
        self.live_kwargs = dict(live_kwargs or {})  # this process's `wandb.init` arguments not in the journal
        self.run: Any = None
        self.run_id: str | None = None
        self.applied = journal.state["delivered"]
        self.failed = False  # W&B failed: the rest waits in the journal for an upload

    def send_pending(self) -> None:
        """Apply the events not applied yet; a failure of W&B (a server that cannot be reached, say) is one
        warning and stops the delivery, never the training: the journal keeps the records."""
        events = self.journal.events
        while self.applied < len(events) and not self.failed:
            try:
                self._apply(events[self.applied])
            except Exception as err:
                self.failed = True
                log.warning(
                    "W&B failed (%s: %s); this run's records are kept in %s: give them to W&B with `%s %s`.",
                    type(err).__name__,
                    str(err).splitlines()[0][:200] if str(err) else "",
                    self.journal.directory,
                    UPLOAD,
                    self.journal.directory.parent.parent,
                )
                return
            self.applied += 1
            if self.run is None and self.run_id is not None:  # W&B has written the run: all delivered
                self.journal.mark_delivered(self.applied, self.run_id)

    def close_run(self, status: str) -> None:
        """End an open run as `status` without a record of it (its process died before writing one)."""
        if self.run is not None:
            self._apply({"op": "end", "status": status})
            self.journal.mark_delivered(self.applied, self.run_id)

    def _apply(self, event: dict[str, Any]) -> None:
        op = event["op"]
        if op == "start":
            if self.run is None:
                self.run = open_run(event, self.live_kwargs)
                self.run_id = event["id"]
            if event["facts"]:  # under "runner": apart from the config's own "hardware"
                facts = {key.removeprefix("runner."): value for key, value in event["facts"].items()}
                self.run.config.update({"runner": facts}, allow_val_change=True)
            return
        if self.run is None:  # the run was finished already: what follows its end belongs to no run
            return
        if op == "params":
            self.run.config.update(event["params"], allow_val_change=True)
        elif op == "metrics":
            self.run.log(event["metrics"], step=event["step"])
        elif op == "artifact":
            attach(self.run, Path(event["path"]), event["artifact_path"])
        elif op == "end":
            status = event.get("status", "FINISHED")
            if status == "KILLED":
                self.run.mark_preempting()
            self.run.finish(exit_code=EXIT_CODES.get(status, 1))
            self.run = None


def open_run(start: dict[str, Any], live_kwargs: Mapping[str, Any]) -> Any:
    """`wandb.init` of a journal's `start` event (and `live_kwargs`): the same id (a run started again
    continues its W&B run), W&B's console capture off unless its settings say otherwise (the run's log is
    its own file, attached at the end)."""
    import wandb  # the extra's import, where it is used

    return wandb.init(
        **{"settings": wandb.Settings(console="off"), **start["init_kwargs"], **live_kwargs},
        project=start["project"],
        entity=start["entity"],
        mode=start["mode"],
        name=start["name"],
        group=start["group"],
        notes=start["notes"],
        tags=start["tags"] or None,
        id=start["id"],
        resume="allow",
        dir=start["dir"],
    )


def plain_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`values` split into what JSON holds (a one-element tensor or array as its number) and the rest."""
    plain, rich = {}, {}
    for key, value in values.items():
        with contextlib.suppress(RuntimeError, ValueError):  # a tensor or array of several elements: kept
            value = value.item() if hasattr(value, "item") else value
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            rich[key] = value
        else:
            plain[key] = value
    return plain, rich


def attach(run: Any, path: Path, artifact_path: str | None) -> None:
    """A file into the run's files; a directory (the model) as an artifact of its name (`model`: type model)."""
    import wandb

    if path.is_dir():
        artifact = wandb.Artifact(f"{artifact_path or path.name}-{run.id}", type=artifact_path or "files")
        artifact.add_dir(str(path))
        run.log_artifact(artifact)
    elif path.exists():
        run.save(str(path), base_path=str(path.parent), policy="now")


def upload(run_dir: Path) -> int | None:
    """`python -m runner.trackers.upload <run dir>` for a W&B journal: give W&B what it did not finish
    (the run ends as KILLED where its process died before ending it). None: the run has no W&B journal."""
    directory = run_dir / TRACKING / WANDB_JOURNAL
    if not (directory / "events.jsonl").exists():
        return None
    journal = Journal(directory)
    pending = journal.pending
    if not pending:
        print(f"nothing to upload: W&B has all {len(journal.events)} records of {run_dir}.")
        return 0
    delivery = WandbDelivery(journal)
    delivery.send_pending()
    delivery.close_run("KILLED")
    print(f"gave W&B {pending} record(s) of {run_dir}.")
    return 0


def wandb_mode(mode: WandbMode | str | None) -> WandbMode:
    """`tracker.mode`, else `$WANDB_MODE`, else online; a ConfigError naming the one that is not a mode."""
    key, value = ("tracker.mode", mode) if mode is not None else ("$WANDB_MODE", os.environ.get("WANDB_MODE"))
    try:
        return WandbMode(getattr(value, "value", value) or "online")
    except ValueError:
        raise ConfigError(
            f"{key}={value!r}: W&B runs online (sent as they run) or offline (written to <run dir>/wandb/ for "
            "`wandb sync`). Give one of those."
        ) from None


def check_login() -> None:
    """A ConfigError, before any run starts, where W&B online has no API key: neither `$WANDB_API_KEY` nor
    a netrc entry for its server (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        if netrc.netrc(str(path)).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ConfigError(
        f"tracker=wandb with tracker.mode=online sends the run to {host}, and this machine has no W&B login "
        f"(no WANDB_API_KEY, no entry for {host} in {path}). Run `wandb login` (or set WANDB_API_KEY), or set "
        f"tracker.mode=offline to write the run to <run dir>/wandb/ and send it later with `wandb sync`; "
        f"records a run could not give W&B are kept in <run dir>/{TRACKING}/{WANDB_JOURNAL}/ ({UPLOAD})."
    )
