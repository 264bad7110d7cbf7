"""`tracker=mlflow`: one MLflow run per job. Every record goes to a local journal first; a sender
process (`python -m runner.trackers.upload --serve`, one per process, shared by a sweep's jobs) delivers
it to MLflow, so neither MLflow's start-up nor a slow or unreachable server costs the training process
time at any step. At the end the run waits for its records to be in the store (at most
`finish_timeout_s`), unless it was told to `detach`."""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runner.cluster import launched_environment
from runner.cluster.slurm import slurm_job_id
from runner.config import NonNegativeFloat, PythonOnly, checked
from runner.errors import ConfigError
from runner.run_dir import TRACKING
from runner.trackers.base import Tracker, directory_setting, flatten
from runner.trackers.journal import Journal

log = logging.getLogger(__name__)

PARENT = "parent.json"  # in a sweep's TRACKING: the sweep's parent run
SENDER_LOG = "sender.log"  # in the first TRACKING a sender serves: its output
UPLOAD = "python -m runner.trackers.upload"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter value
MAX_METRICS_PER_BATCH = 1000  # MLflow's limit on one log_batch
SENDER_DELAY_S = 5.0  # a detached run starts its sender this long after its start (or at its end)


def local_store() -> tuple[str, str]:
    """The default store, in the working directory's `outputs/` (nothing to start): the tracking URI and
    the artifact root of the experiments it creates."""
    outputs = Path("outputs").resolve()
    return f"sqlite:///{outputs / 'mlflow.db'}", str(outputs / "mlartifacts")


class MLflowTracker(Tracker):
    """Logs the job's parameters (the flattened config), tags, metrics with their step and artifacts to
    one MLflow run.

    Args:
        experiment_name: the MLflow experiment (Accelerate's `project_name` in `init_trackers` wins).
        uri: a tracking URI (`http://host:port`, `sqlite:///...`); None: `$MLFLOW_TRACKING_URI`, else a
            SQLite store in `./outputs/mlflow.db` with artifacts in `./outputs/mlartifacts`.
        run_name: the run's name; None: the one `start` is given (the runner's loop: its job's), else MLflow's.
        tags: extra tags for the run.
        parent_run_id: make the run a child of this one (a sweep's jobs).
        log_model: also attach the final model files.
        logging_dir: where the journal goes (`<logging_dir>/tracking/`); None: the working directory.
        detach: False: `finish` (`end_training`, or the process's exit if nothing called it) returns once
            every record is in the store, or after `finish_timeout_s`, naming what was not sent and the
            upload command; True: the process exits at once and the sender delivers the rest alone (it
            dies with the process's container or job).
        finish_timeout_s: how long `finish` waits when it waits, and `run_id` for the run to exist.
    """

    name = "mlflow"

    @checked("tracker")
    def __init__(
        self,
        experiment_name: str = "runner",
        uri: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
        log_model: bool = False,
        logging_dir: PythonOnly[str | None] = None,
        detach: bool = False,
        finish_timeout_s: NonNegativeFloat = 120.0,
    ) -> None:
        if not experiment_name.strip():
            raise ConfigError(
                f"tracker.experiment_name={experiment_name!r}: an MLflow experiment needs a name. Give one "
                "(tracker.experiment_name=mnist), or leave it out for 'runner'."
            )
        self.experiment_name = experiment_name
        self.artifact_location: str | None = None
        uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        if uri is None:
            uri, self.artifact_location = local_store()
        self.uri = check_uri(uri)
        self.run_name = run_name
        self.tags = {key: str(value) for key, value in (tags or {}).items()}
        self.parent_run_id = parent_run_id
        self.log_model = log_model
        self.logging_dir = directory_setting(logging_dir, "tracker.logging_dir")
        self.detach = detach
        self.finish_timeout_s = finish_timeout_s
        self.journal: Journal | None = None
        self._client: Any = None
        self._detached = self._sent = self._ended = self._said_logged = False
        self._started = 0.0
        self._logged_to: dict[str, int] = {}  # resumed: each metric's last step in the journal

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id, once the sender has created the run (waits for it, at most
        `finish_timeout_s`); None before `start` or when the server could not be reached."""
        if self.journal is None:
            return None
        self._send()
        self._wait_for(lambda state: state["run_id"] is not None or "error" in state)
        return self.journal.state["run_id"]

    @property
    def tracker(self) -> Any:
        """An `MlflowClient` on the run's store, for what the tracker does not log itself (imports MLflow
        in this process)."""
        if self._client is None:
            self._client = mlflow_client(self.uri)
        return self._client

    def describe(self) -> str:
        return f"mlflow -> {self.uri} (experiment {self.experiment_name})"

    def warm_up(self, logging_dir: Path) -> None:
        """Start this process's sender now and have it import MLflow and open the store (seconds) while the
        run starts up; ranks forked from this process deliver through it."""
        if self.detach:
            return
        directory = Path(self.logging_dir or logging_dir) / TRACKING
        directory.mkdir(parents=True, exist_ok=True)
        Sender.shared(directory / SENDER_LOG, False).warm(self.uri)

    def start(
        self,
        project_name: str | None = None,
        logging_dir: str | None = None,
        tags: dict[str, Any] | None = None,
        resumed_at: int | None = None,
        run_name: str | None = None,
    ) -> None:
        """Open the journal and record the run's start (resumed: the journal's run goes on, and a metric is
        not logged again at a step its journal holds: MLflow cannot replace a logged value). The sender starts now, so that MLflow's start-up
        overlaps the training; detached, with the first record `SENDER_DELAY_S` later, or at `finish`:
        a short run never shares the CPU with it. A run not detached and not finished by the process's
        exit is finished then (FAILED after an uncaught exception), as MLflow's own runs are."""
        self.journal = Journal(Path(self.logging_dir or logging_dir or ".") / TRACKING)
        self._logged_to = {} if resumed_at is None else last_steps(self.journal.events)
        self._detached = self.detach
        self._started = time.monotonic()
        self._sent = self._ended = False
        self._record(
            op="start",
            uri=self.uri,
            experiment=project_name or self.experiment_name,
            artifact_location=self.artifact_location,
            run_name=self.run_name or run_name,
            tags={**run_facts(), **{k: str(v) for k, v in (tags or {}).items()}, **self.tags},
            parent_run_id=self.parent_run_id,
        )
        if not self._detached:
            self._send()
            atexit.register(self._finish_at_exit)

    def _finish_at_exit(self) -> None:
        self.finish("FAILED" if hasattr(sys, "last_value") else "FINISHED")

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        params = {key: str(value)[:MAX_PARAM_LENGTH] for key, value in flatten(values)}
        self._record(op="params", params=params)

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        step = step or 0
        metrics = {key: float(value) for key, value in values.items() if step > self._logged_to.get(key, -1)}
        if len(metrics) < len(values) and not self._said_logged:
            self._said_logged = True
            log.info(
                "MLflow: the run had logged up to step %d before its restart; steps up to there are not logged again",
                max(self._logged_to.values()),
            )
        if metrics:
            self._record(op="metrics", metrics=metrics, step=step, timestamp=int(time.time() * 1000))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._record(op="artifact", path=str(Path(path).resolve()), artifact_path=artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """Close the run as `status`. Detached, return at once: the sender delivers the rest, also after
        this process exits. Otherwise wait (at most `finish_timeout_s`) until every record is in the store;
        what could not be sent stays in the journal, and one warning says so and how to upload it."""
        if self.journal is None or self._ended:
            return
        self._record(op="end", status=status)
        self._ended = True
        atexit.unregister(self._finish_at_exit)
        self._send()
        if self._detached:
            return
        journal = self.journal
        upload = f"`{UPLOAD} {journal.directory.parent}`"
        if not self._wait_for(lambda state: state.get("closed", 0) >= len(journal.events)):
            log.warning(
                "MLflow: the records of this run are still being sent to %s after %.0f s "
                "(tracker.finish_timeout_s); the sender goes on, and what it cannot send stays in %s (upload it "
                "with %s).",
                self.uri,
                self.finish_timeout_s,
                journal.directory,
                upload,
            )
        elif pending := journal.pending:
            log.warning(
                "MLflow at %s failed (%s): %d record(s) of this run are not in it; they are kept in %s. Upload "
                "them with %s.",
                self.uri,
                journal.state.get("error", "the sender stopped"),
                pending,
                journal.directory,
                upload,
            )

    def parent_for_sweep(self, sweep_dir: Path) -> str | None:
        """Created once, before the jobs start (`SweepSummary`); recorded in the sweep's dir for its jobs."""
        record = sweep_dir / TRACKING / PARENT
        if record.exists():
            return json.loads(record.read_text())["run_id"]
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            client = mlflow_client(self.uri)
            experiment_id = experiment(client, self.experiment_name, self.artifact_location)
            run_id = client.create_run(experiment_id, run_name=sweep_dir.name, tags=run_facts()).info.run_id
        except Exception as err:  # no server: the jobs still run, as runs of their own
            log.warning(
                "MLflow at %s: no parent run for the sweep (%s); each job logs a run of its own.",
                self.uri,
                err,
            )
            return None
        record.write_text(json.dumps({"run_id": run_id, "uri": self.uri}))
        return run_id

    def start_sweep(self, sweep_dir: Path) -> None:
        record = sweep_dir / TRACKING / PARENT
        if not record.exists():
            self.parent_for_sweep(sweep_dir)
            return
        parent = json.loads(record.read_text())  # a resumed sweep: its parent runs again until `end_sweep`
        try:
            mlflow_client(parent["uri"]).update_run(parent["run_id"], status="RUNNING")
        except Exception as err:
            log.warning("MLflow at %s: the sweep's parent run was not reopened (%s).", parent["uri"], err)

    def end_sweep(self, sweep_dir: Path, artifacts: list[Path]) -> None:
        record = sweep_dir / TRACKING / PARENT
        if not record.exists():
            return
        parent = json.loads(record.read_text())
        try:
            client = mlflow_client(parent["uri"])
            for artifact in artifacts:
                client.log_artifact(parent["run_id"], str(artifact))
            client.set_terminated(parent["run_id"], "FINISHED")
        except Exception as err:
            log.warning("MLflow at %s: the sweep's parent run was not closed (%s).", parent["uri"], err)

    def _record(self, **event: Any) -> None:
        assert self.journal is not None, "start() the tracker first"
        self.journal.append(event)
        if not self._sent and time.monotonic() - self._started >= SENDER_DELAY_S:
            self._send()

    def _send(self) -> None:
        """Hand the journal to this process's sender (once per run)."""
        assert self.journal is not None
        if self._sent:
            return
        directory = self.journal.directory
        warns = self._detached and remote_store(self.uri)  # a waiting run warns itself
        try:
            Sender.shared(directory / SENDER_LOG, warns).follow(directory, self.uri)
        except BrokenPipeError:  # it had just exited: a new one
            Sender.shared(directory / SENDER_LOG, warns).follow(directory, self.uri)
        self._sent = True

    def _wait_for(self, condition: Callable[[dict[str, Any]], bool]) -> bool:
        """Wait (at most `finish_timeout_s`) until the journal's delivery state meets `condition`."""
        assert self.journal is not None
        deadline = time.monotonic() + self.finish_timeout_s
        while not condition(self.journal.refresh().state):
            if time.monotonic() > deadline or Sender.shared() is None:
                return condition(self.journal.refresh().state)
            time.sleep(0.02)
        return True


class Sender:
    """The process that delivers this process's journals, in order, and exits once every run it follows
    has ended and been sent, or once this process is gone and it has sent what was written. One per
    process: a sweep's jobs share it, and MLflow and its store are set up once.

    It runs in a session of its own (a Ctrl-C of the run does not stop it), writes its output (MLflow's
    own log lines included) to `SENDER_LOG` in the first journal's dir, and, where the first run's store is
    remote (a server can be unreachable), gets a copy of this process's stderr for its one warning per run.
    A local store's problems go to the log alone: the sender holds no console open, which a reader of a
    pipe (`| tee`, a CI log) would wait on."""

    _shared: Sender | None = None

    def __init__(self, log_file: Path | None, warn_on_console: bool) -> None:
        self.owner = os.getpid()  # a process forked from it shares the sender (its stdin pipe)
        self.log_file = log_file  # None: started early, its output to nowhere until `shared` names a file
        self.warns = warn_on_console
        console = os.dup(sys.stderr.fileno()) if warn_on_console and _has_fileno(sys.stderr) else None
        command = [sys.executable, "-m", "runner.trackers.upload", "--serve"]
        if console is not None:
            command += ["--console-fd", str(console)]
        try:
            with open(log_file or os.devnull, "ab") as output:
                self.process = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=output,
                    stderr=output,
                    pass_fds=() if console is None else (console,),
                    start_new_session=True,
                )
        finally:
            if console is not None:
                os.close(console)

    @classmethod
    def start_early(cls, arguments: list[str]) -> None:
        """Start this process's sender before `python -m runner` imports torch, so that its import of
        MLflow (seconds) runs beside the command's own start instead of beside its training; skipped where
        the command cannot track (a plan, help, another tracker, a rank other than 0). A guess: a sender
        that is given nothing to deliver exits with this process."""
        skip = {"init", "--help", "-h", "--cfg", "--info", "plan=true"}
        another = any(a.startswith("tracker=") and a != "tracker=mlflow" for a in arguments)
        rank = launched_environment()
        if skip & set(arguments) or another or (rank is not None and rank.rank != 0):
            return
        try:
            cls._shared = cls(None, False)
        except OSError:  # no process could be started: the run starts one when it needs it
            cls._shared = None
            return
        uri = os.environ.get("MLFLOW_TRACKING_URI") or local_store()[0]
        named = any(a.lstrip("+").startswith("tracker.uri=") for a in arguments)
        if not named and (remote_store(uri) or Path(uri.removeprefix("sqlite:///")).is_file()):
            cls._shared.warm(uri)  # the likely store, when that creates nothing (its config may name another)

    @classmethod
    def shared(cls, log_file: Path | None = None, warn_on_console: bool = False) -> Sender | None:
        """This process's sender; where none is running (or it holds no console where `warn_on_console`
        wants one), one started with output to `log_file`, if given (and a copy of stderr where
        `warn_on_console`). One started early writes to the first `log_file` named."""
        if cls._shared is not None and (
            not cls._shared.running() or (warn_on_console and not cls._shared.warns)
        ):
            cls._shared = None
        if cls._shared is None and log_file is not None:
            cls._shared = cls(log_file, warn_on_console)
        elif cls._shared is not None and cls._shared.log_file is None and log_file is not None:
            cls._shared.log_file = log_file
            cls._shared._request({"log": str(log_file)})
        return cls._shared

    def running(self) -> bool:
        if os.getpid() == self.owner:
            return self.process.poll() is None
        try:  # in a forked rank: not this process's child, but the same sender
            os.kill(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def warm(self, uri: str) -> None:
        """Import MLflow and open the store of `uri` now, before any journal is named."""
        self._request({"warm": uri})

    def follow(self, directory: Path, uri: str) -> None:
        """Deliver the journal in `directory` to `uri` until its run ends."""
        self._request({"journal": str(directory), "uri": uri})

    def _request(self, request: dict[str, str]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()


def last_steps(events: list[dict[str, Any]]) -> dict[str, int]:
    """Each metric's last logged step among a journal's `events`."""
    last: dict[str, int] = {}
    for event in events:
        if event["op"] == "metrics":
            last |= dict.fromkeys(event["metrics"], event["step"])
    return last


# What MLflow stores runs in: a tracking server, or a database (a SQLAlchemy URL, `+driver` allowed).
SERVER_SCHEMES = ("http", "https", "databricks")
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def check_uri(uri: str) -> str:
    """`uri` when MLflow can track to it, else a ConfigError naming `tracker.uri` (or the environment
    variable it came from), before any run starts: a known scheme, and for SQLite a directory this run
    can write the database in. Whether a server answers is found out by the sender."""
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme not in SERVER_SCHEMES + DATABASE_SCHEMES:
        raise ConfigError(
            f"tracker.uri={uri!r} (or $MLFLOW_TRACKING_URI): not a store MLflow tracks to. Give a server "
            "(http://host:5000), a local database (sqlite:///path/to/mlflow.db: nothing to start) or another "
            "database URL (postgresql://..., mysql://...); MLflow's file store (a plain path or file://) is not "
            "taken. Leave it out for the local store outputs/mlflow.db."
        )
    if scheme == "sqlite" and (database := uri.split(":///", 1)[-1]) and database != ":memory:":
        directory_setting(str(Path(database).parent), "tracker.uri")
    return uri


def remote_store(uri: str) -> bool:
    """Whether the tracking `uri` is a store across the network (a server that can be unreachable), not
    this machine's disk (SQLite, files)."""
    return uri.split(":", 1)[0] in ("http", "https", "databricks")


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # a notebook's or a test's captured stream
        return False
    return True


class Delivery:
    """Sends a journal's undelivered events to MLflow, in order, and records how far it got."""

    def __init__(self, journal: Journal, uri: str) -> None:
        self.journal = journal
        self.uri = uri
        self.client: Any = None
        self.error = ""  # the last failure

    def send_pending(self) -> bool:
        """Send every undelivered event; False when one failed (with a warning, the first time)."""
        try:
            while self.journal.pending:
                index = self.journal.state["delivered"]
                sent, run_id = self._send(self.journal.events[index:], self.journal.state["run_id"])
                self.journal.mark_delivered(index + sent, run_id)
        except Exception as err:  # the server, the network, the store: all are reasons to keep going
            first = not self.error
            self.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            if first:
                log.warning(
                    "MLflow at %s failed (%s). The run's records are kept in %s and can be uploaded later with "
                    "`%s %s`.",
                    self.uri,
                    self.error,
                    self.journal.directory,
                    UPLOAD,
                    self.journal.directory.parent,
                )
            return False
        return True

    def close_run(self, status: str) -> None:
        """End the run as `status` without a record of it (its process died before writing one)."""
        if self.journal.state["run_id"] is not None:
            try:
                self._send([{"op": "end", "status": status}], self.journal.state["run_id"])
            except Exception as err:
                log.warning("MLflow at %s: the run was not closed as %s (%s).", self.uri, status, err)

    def _send(self, events: list[dict[str, Any]], run_id: str | None) -> tuple[int, str | None]:
        """Apply the first of `events` (all the metrics events that follow it in one batch); return how
        many were sent and the run id that later events go to."""
        if self.client is None:
            self.client = mlflow_client(self.uri)
        event = events[0]
        if event["op"] == "metrics":
            return _log_metrics(self.client, events, run_id), run_id
        if event["op"] == "start":
            return 1, _start_run(self.client, event, run_id)
        assert run_id is not None, "the journal does not start with a run"
        _apply(self.client, event, run_id)
        return 1, run_id


def _log_metrics(client: Any, events: list[dict[str, Any]], run_id: str | None) -> int:
    """Log the metrics events that open `events` in one batch; return how many."""
    from mlflow.entities import Metric

    batch: list[Metric] = []
    sent = 0
    for following in events:
        if following["op"] != "metrics" or len(batch) + len(following["metrics"]) > MAX_METRICS_PER_BATCH:
            break
        batch += [
            Metric(k, v, following["timestamp"], following["step"]) for k, v in following["metrics"].items()
        ]
        sent += 1
    client.log_batch(run_id, metrics=batch)
    return max(sent, 1)


def _start_run(client: Any, event: dict[str, Any], run_id: str | None) -> str:
    """The run a journal's `start` event opens: `run_id` again when the job resumed, else a new run."""
    if run_id is not None:  # the job resumed: same run
        client.update_run(run_id, status="RUNNING")
        return run_id
    tags = dict(event["tags"])
    if event["parent_run_id"]:
        tags["mlflow.parentRunId"] = event["parent_run_id"]
    experiment_id = experiment(client, event["experiment"], event["artifact_location"])
    return client.create_run(experiment_id, run_name=event["run_name"], tags=tags).info.run_id


def _apply(client: Any, event: dict[str, Any], run_id: str) -> None:
    """Send one `params`, `artifact` or `end` event to run `run_id`."""
    from mlflow.entities import Param

    if event["op"] == "params":
        logged = client.get_run(run_id).data.params  # a resumed run keeps its first values
        params = [Param(k, v) for k, v in event["params"].items() if k not in logged]
        for chunk in range(0, len(params), 100):
            client.log_batch(run_id, params=params[chunk : chunk + 100])
    elif event["op"] == "artifact":
        path = Path(event["path"])
        if path.is_dir():
            client.log_artifacts(run_id, str(path), event["artifact_path"])
        elif path.exists():
            client.log_artifact(run_id, str(path), event["artifact_path"])
    elif event["op"] == "end":
        client.set_terminated(run_id, event.get("status", "FINISHED"))


def mlflow_client(uri: str) -> Any:
    """An `MlflowClient` for `uri` that fails within seconds, not minutes of retries, when the server is
    not there (the journal keeps what was not sent)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def run_facts() -> dict[str, str]:
    """Where the run ran: host, the git commit of the working directory, the SLURM job id."""
    facts = {"host": socket.gethostname()}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        facts["mlflow.source.git.commit"] = facts["git_commit"] = commit
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout, or no git
    if (job_id := slurm_job_id()) is not None:
        facts["slurm_job_id"] = job_id
    return facts


def experiment(client: Any, name: str, artifact_location: str | None) -> str:
    """The id of experiment `name`, created if missing (by this process or a concurrent one)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id
