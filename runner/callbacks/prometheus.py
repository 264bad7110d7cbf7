"""The run's figures on an HTTP endpoint that Prometheus scrapes (`callbacks=[prometheus]`)."""

from __future__ import annotations

import importlib.util
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner.callbacks.base import Callback, Run
from runner.config import Port
from runner.errors import TrainingInterrupted, install_command
from runner.telemetry.goodput import read_ledger, summarize

log = logging.getLogger(__name__)

STATES = ("running", "finished", "stopped", "failed")


def series_name(metric: str) -> tuple[str, dict[str, str]]:
    """A logged metric's Prometheus name and labels: `runner_` and the name with `_` for what Prometheus
    names cannot hold (`train/loss` -> `runner_train_loss`); `rank/<r>/<figure>` -> `runner_rank_<figure>`
    labelled `rank="<r>"`."""
    labels = {}
    if match := re.fullmatch(r"rank/(\d+)/(.+)", metric):
        labels["rank"], metric = match[1], f"rank/{match[2]}"
    return "runner_" + re.sub(r"[^a-zA-Z0-9_]", "_", metric), labels


class PrometheusExporter(Callback):
    """Serves the run's figures at `http://<main process's host>:<port>/metrics` while it trains (the main
    process's, through `prometheus_client`): `runner_step` and `runner_total_steps`, every metric the run
    logs at its latest value (`series_name`: the loss, the throughput, each rank's step time, the eval
    metrics), `runner_goodput` (the ledger's so far, at most every `goodput_every_s`), and `runner_state`
    (1 for the run's state: running, then finished, stopped or failed). Each series is labelled with the
    run (`run`: its dir's name). A scrape reads one snapshot, published at the end of each step that
    logged something: the step and every value logged at it are read together. After the run the endpoint answers for `linger_s` more seconds
    (a last scrape sees how it ended), then closes."""

    def __init__(
        self, port: Port = 9464, addr: str = "0.0.0.0", linger_s: float = 0.0, goodput_every_s: float = 30.0
    ) -> None:
        self.port, self.addr, self.linger_s, self.goodput_every_s = port, addr, linger_s, goodput_every_s
        self.server: Any = None
        self.snapshot: dict[str, Any] = {}  # what a scrape reads
        self.pending: dict[str, Any] = {}  # what this step logged, published at its end
        self.goodput_at = -float("inf")
        self.lock = threading.Lock()

    @classmethod
    def check_settings(cls, node: str, settings: Any, trainer: Any) -> list[str]:
        if importlib.util.find_spec("prometheus_client") is None:
            return [
                f"{node}: the Prometheus exporter serves its figures through prometheus_client, which is not "
                f"installed. Install it with `{install_command('prometheus')}`, or leave "
                f"{node.split('.')[-1]} out of callbacks."
            ]
        return []

    def on_fit_start(self, run: Run) -> None:
        if not run.engine.is_main_process or self.server is not None:
            return
        from prometheus_client import start_http_server  # the prometheus extra (check_settings)
        from prometheus_client.registry import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        try:
            self.server, _ = start_http_server(self.port, self.addr, registry=registry)
        except OSError as err:
            raise OSError(
                f"callbacks.prometheus.port={self.port}: the exporter cannot listen on {self.addr}:{self.port} "
                f"({err.strerror}). Choose a free port (callbacks.prometheus.port=...), or stop what holds it."
            ) from err
        self.labels = {"run": run.output_dir.name}
        self.goodput_at = time.monotonic()  # the first reading once the run has trained a while
        self.update({"step": run.step, "total_steps": run.total_steps, "state": "running"})
        log.info("metrics for Prometheus: http://%s:%d/metrics", socket.getfqdn(), self.port)

    def on_log(self, run: Run, values: dict[str, float]) -> None:
        if self.server is not None:
            self.pending |= values
            if "goodput/goodput" in values:  # the run's end: the ledger's whole summary
                self.pending["goodput"] = values["goodput/goodput"]

    def on_step_end(self, run: Run) -> None:
        """What the step logged (its window, evaluation, the callbacks' own) goes out together."""
        if not self.pending:
            return
        now = time.monotonic()
        if now - self.goodput_at >= self.goodput_every_s:
            self.goodput_at = now
            records = read_ledger(Path(run.output_dir))
            if records:
                self.pending["goodput"] = summarize(records)["goodput"]
        self.update({"step": run.step, **self.pending})

    def on_fit_end(self, run: Run, metrics: dict[str, float]) -> None:
        self.update({"step": run.step, **self.pending})
        self.close("finished")

    def on_exception(self, run: Run, error: BaseException) -> None:
        stopped = isinstance(error, (TrainingInterrupted, KeyboardInterrupt))
        self.close("stopped" if stopped else "failed")

    def update(self, values: dict[str, Any]) -> None:
        """Publish `values` (metric names, `step`, `total_steps`, `goodput`, `state`) over the snapshot's;
        nothing is pending after."""
        with self.lock:
            self.snapshot = {**self.snapshot, **values}
        self.pending = {}

    def close(self, state: str) -> None:
        if self.server is None:
            return
        self.update({"state": state})
        time.sleep(self.linger_s)
        self.server.shutdown()
        self.server.server_close()
        self.server = None

    def collect(self) -> Iterator[Any]:
        """The snapshot as Prometheus metric families (prometheus_client's collector protocol)."""
        from prometheus_client.core import GaugeMetricFamily

        with self.lock:
            snapshot = dict(self.snapshot)
        labels = self.labels
        families: dict[str, Any] = {}
        state = snapshot.pop("state", "running")
        for metric, value in snapshot.items():
            name, extra = series_name(metric)
            if name not in families:
                doc = f"the run's {metric.split('/', 2)[-1] if extra else metric} (runner)"
                families[name] = GaugeMetricFamily(name, doc, labels=[*labels, *extra])
            families[name].add_metric([*labels.values(), *extra.values()], float(value))
        states = GaugeMetricFamily(
            "runner_state", "1 for the run's state (runner)", labels=[*labels, "state"]
        )
        for name in STATES:
            states.add_metric([*labels.values(), name], float(name == state))
        yield from families.values()
        yield states
