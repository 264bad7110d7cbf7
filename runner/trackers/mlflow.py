"""`tracker=mlflow`: one MLflow run per job. Every record goes to a local journal first and is sent to
MLflow by a background thread, so a slow or unreachable server never stalls or fails training."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from runner.cluster import slurm_job_id
from runner.trackers.base import Tracker
from runner.trackers.journal import Journal

log = logging.getLogger(__name__)

JOURNAL_DIR = "tracking"  # inside the run's directory
PARENT = "parent.json"  # in a sweep's JOURNAL_DIR: the sweep's parent run
UPLOAD = "python -m runner.trackers.upload"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter value
MAX_METRICS_PER_BATCH = 1000  # MLflow's limit on one log_batch
SEND_INTERVAL_S = 1.0  # how often the background thread sends what was recorded


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
        run_name: the run's name; None: MLflow picks one.
        tags: extra tags for the run.
        parent_run_id: make the run a child of this one (a sweep's jobs).
        log_model: also attach the final model files.
        logging_dir: where the journal goes (`<logging_dir>/tracking/`); None: the working directory.
        finish_timeout_s: how long `finish` waits for the records still being sent.
    """

    name = "mlflow"

    def __init__(
        self,
        experiment_name: str = "runner",
        uri: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
        log_model: bool = False,
        logging_dir: str | None = None,
        finish_timeout_s: float = 120.0,
    ) -> None:
        self.experiment_name = experiment_name
        self.artifact_location: str | None = None
        uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        if uri is None:
            uri, self.artifact_location = local_store()
        self.uri = uri
        self.run_name = run_name
        self.tags = {key: str(value) for key, value in (tags or {}).items()}
        self.parent_run_id = parent_run_id
        self.log_model = log_model
        self.logging_dir = logging_dir
        self.finish_timeout_s = finish_timeout_s
        self.journal: Journal | None = None
        self._delivery: Delivery | None = None
        self._ended = threading.Event()
        self._worker: threading.Thread | None = None

    @property
    def run_id(self) -> str | None:
        return self.journal.state["run_id"] if self.journal else None

    @property
    def tracker(self) -> Any:
        """The `MlflowClient` the records are sent with (None until the first is sent)."""
        return self._delivery.client if self._delivery else None

    def start(
        self,
        project_name: str | None = None,
        logging_dir: str | None = None,
        tags: dict[str, Any] | None = None,
    ) -> None:
        self.journal = Journal(Path(self.logging_dir or logging_dir or ".") / JOURNAL_DIR)
        self._delivery = Delivery(self.journal, self.uri)
        self._worker = threading.Thread(target=self._deliver, name="mlflow-delivery", daemon=True)
        self._worker.start()
        self._record(
            op="start",
            uri=self.uri,
            experiment=project_name or self.experiment_name,
            artifact_location=self.artifact_location,
            run_name=self.run_name,
            tags={**run_facts(), **{k: str(v) for k, v in (tags or {}).items()}, **self.tags},
            parent_run_id=self.parent_run_id,
        )

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._record(op="params", params=dict(_flatten(values)))

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        metrics = {key: float(value) for key, value in values.items()}
        self._record(op="metrics", metrics=metrics, step=step or 0, timestamp=int(time.time() * 1000))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._record(op="artifact", path=str(Path(path).resolve()), artifact_path=artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        """Close the run as `status` and wait (at most `finish_timeout_s`) for the records to reach MLflow;
        what could not be sent stays in the journal, and one warning says how to upload it."""
        if self.journal is None or self._worker is None:
            return
        self._record(op="end", status=status)
        self._ended.set()
        self._worker.join(self.finish_timeout_s)
        if self.journal.pending:
            # One warning per run: after a failure's, the count is for the log file only.
            report = log.info if self._delivery is not None and self._delivery.warned else log.warning
            report(
                "MLflow: %d record(s) of this run are not at %s yet; they are kept in %s. Upload them with "
                "`%s %s`.",
                self.journal.pending,
                self.uri,
                self.journal.directory,
                UPLOAD,
                self.journal.directory.parent,
            )

    def parent_for_sweep(self, sweep_dir: Path) -> str | None:
        """Created once, before the jobs start (`SweepSummary`); recorded in the sweep's dir for its jobs."""
        record = sweep_dir / JOURNAL_DIR / PARENT
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

    def end_sweep(self, sweep_dir: Path, artifacts: list[Path]) -> None:
        record = sweep_dir / JOURNAL_DIR / PARENT
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

    def _deliver(self) -> None:
        """Every SEND_INTERVAL_S, send what the journal holds; after a failure (one warning) try once more,
        when the run ends."""
        assert self._delivery is not None and self.journal is not None
        failed = False
        while not self._ended.wait(SEND_INTERVAL_S):
            if not failed and self.journal.pending:
                failed = not self._delivery.send_pending()
        self._delivery.send_pending()


class Delivery:
    """Sends a journal's undelivered events to MLflow, in order, and records how far it got."""

    def __init__(self, journal: Journal, uri: str) -> None:
        self.journal = journal
        self.uri = uri
        self.client: Any = None
        self.warned = False

    def send_pending(self) -> bool:
        """Send every undelivered event; False when one failed (with a warning, the first time)."""
        try:
            while self.journal.pending:
                index = self.journal.state["delivered"]
                sent, run_id = self._send(self.journal.events[index:], self.journal.state["run_id"])
                self.journal.mark_delivered(index + sent, run_id)
        except Exception as err:  # the server, the network, the store: all are reasons to keep going
            if not self.warned:
                self.warned = True
                log.warning(
                    "MLflow at %s failed (%s: %s). Training goes on; the run's records are kept in %s and can "
                    "be uploaded later with `%s %s`.",
                    self.uri,
                    type(err).__name__,
                    str(err).splitlines()[0][:200] if str(err) else "",
                    self.journal.directory,
                    UPLOAD,
                    self.journal.directory.parent,
                )
            return False
        return True

    def _send(self, events: list[dict[str, Any]], run_id: str | None) -> tuple[int, str | None]:
        """Apply the first of `events` (all the metrics events that follow it in one batch); return how
        many were sent and the run id that later events go to."""
        from mlflow.entities import Metric, Param

        if self.client is None:
            self.client = mlflow_client(self.uri)
        client = self.client
        event = events[0]
        op = event["op"]
        if op == "metrics":
            batch: list[Metric] = []
            sent = 0
            for following in events:
                if (
                    following["op"] != "metrics"
                    or len(batch) + len(following["metrics"]) > MAX_METRICS_PER_BATCH
                ):
                    break
                batch += [
                    Metric(k, v, following["timestamp"], following["step"])
                    for k, v in following["metrics"].items()
                ]
                sent += 1
            client.log_batch(run_id, metrics=batch)
            return max(sent, 1), run_id
        if op == "start":
            if run_id is not None:  # the job resumed: same run
                client.update_run(run_id, status="RUNNING")
                return 1, run_id
            tags = dict(event["tags"])
            if event["parent_run_id"]:
                tags["mlflow.parentRunId"] = event["parent_run_id"]
            experiment_id = experiment(client, event["experiment"], event["artifact_location"])
            return 1, client.create_run(experiment_id, run_name=event["run_name"], tags=tags).info.run_id
        assert run_id is not None, "the journal does not start with a run"
        if op == "params":
            logged = client.get_run(run_id).data.params  # a resumed run keeps its first values
            params = [Param(k, v) for k, v in event["params"].items() if k not in logged]
            for chunk in range(0, len(params), 100):
                client.log_batch(run_id, params=params[chunk : chunk + 100])
        elif op == "artifact":
            path = Path(event["path"])
            if path.is_dir():
                client.log_artifacts(run_id, str(path), event["artifact_path"])
            elif path.exists():
                client.log_artifact(run_id, str(path), event["artifact_path"])
        elif op == "end":
            client.set_terminated(run_id, event.get("status", "FINISHED"))
        return 1, run_id


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


def _flatten(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for key, value in values.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", str(value)[:MAX_PARAM_LENGTH]
