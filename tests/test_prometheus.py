"""`callbacks=[prometheus]`, scraped for real: Debian's `prometheus` server (installed by `.ci/prometheus.sh`),
started here on 127.0.0.1 and scraping every second, reads a 2-rank run's endpoint while it trains; the
series it stored equal the run's history.jsonl."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import cli_env, run_to_end, runner_command

from runner.telemetry.history import read_history

TESTS = Path(__file__).parent
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus server: run `bash .ci/prometheus.sh`"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus(tmp_path):
    """A Prometheus server scraping 127.0.0.1:<target port> every second: (its URL, the target port)."""
    target, web = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: runner\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
    )
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{web}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "prometheus did not start"
        time.sleep(0.2)
    yield url, target
    proc.terminate()
    proc.wait(timeout=30)


def stored(url: str, query: str) -> dict[tuple[tuple[str, str], ...], dict[float, float]]:
    """The samples Prometheus stored for `query` (a range selector): labels -> {time: value}."""
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': query})}") as answer:
        result = json.load(answer)["data"]["result"]
    return {
        tuple(
            sorted((k, v) for k, v in series["metric"].items() if k not in ("__name__", "job", "instance"))
        ): {t: float(v) for t, v in series["values"]}
        for series in result
    }


def latest(rows: list[dict], metric: str, step: int) -> float:
    """The history's latest value of `metric` at a step up to `step`."""
    return [row[metric] for row in rows if row["step"] <= step and metric in row][-1]


def test_prometheus_scrapes_a_running_run_and_its_series_equal_the_history(prometheus, tmp_path):
    url, port = prometheus
    run_dir = tmp_path / "run"
    run_to_end(
        run_dir, "tracker=none", "hardware=ddp", "hardware.num_processes=2", "trainer.max_steps=300",
        "trainer.log_every=5", "trainer.eval_every=100", "callbacks=[prometheus]",
        f"callbacks.prometheus.port={port}", "callbacks.prometheus.addr=127.0.0.1",
        "callbacks.prometheus.linger_s=2.5", "callbacks.prometheus.goodput_every_s=1",
        # rank 1 reads a batch in about 20 ms: the training lasts about 6 s, scraped every second
        "data._target_=probes.SlowRankRegressionData", "+data.delay_s=0.0003", pythonpath=TESTS,
    )  # fmt: skip
    rows = read_history(run_dir)
    run = (("run", "run"),)
    (steps,) = stored(url, 'runner_step{run="run"}[10m]').values()
    losses = stored(url, 'runner_train_loss{run="run"}[10m]')[run]
    assert len([s for s in steps.values() if 0 < s < 300]) >= 3  # scraped while it trained
    assert max(steps.values()) == 300
    for at, loss in losses.items():  # each scrape: the step and what was logged up to it, together
        assert loss == latest(rows, "train/loss", int(steps[at]))
    evals = stored(url, 'runner_eval_loss{run="run"}[10m]')[run]
    assert {latest(rows, "eval/loss", int(steps[at])) for at in evals} == set(evals.values())
    ranks = stored(url, "runner_rank_step_time_s[10m]")
    assert sorted(ranks) == [(("rank", "0"), *run), (("rank", "1"), *run)]
    for labels, values in ranks.items():
        rank = dict(labels)["rank"]
        for at, value in values.items():
            assert value == pytest.approx(latest(rows, f"rank/{rank}/step_time_s", int(steps[at])), rel=1e-6)
    goodput = stored(url, 'runner_goodput{run="run"}[10m]')[run]
    readings = list(goodput.values())  # the ledger's so far, every second, then the run's own at its end
    assert len(set(readings)) >= 3 and all(0 <= g <= 1 for g in readings)
    assert readings[-1] == latest(rows, "goodput/goodput", 300)
    states = stored(url, 'runner_state{run="run"}[10m]')
    by_state = {dict(labels)["state"]: values for labels, values in states.items()}
    first, last = min(by_state["running"]), max(by_state["running"])
    assert by_state["running"][first] == 1.0 and by_state["finished"][first] == 0.0
    assert by_state["running"][last] == 0.0 and by_state["finished"][last] == 1.0  # the last scrape: finished


def test_a_port_the_exporter_cannot_take_fails_the_run_at_its_start_naming_it(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            runner_command(tmp_path / "run", "tracker=none", "trainer.max_steps=5", "callbacks=[prometheus]",
                           f"callbacks.prometheus.port={port}", "callbacks.prometheus.addr=127.0.0.1"),
            cwd=tmp_path, env=cli_env(None), capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    assert proc.returncode != 0
    assert f"callbacks.prometheus.port={port}: the exporter cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_a_port_out_of_range_is_refused_before_launch(run_cli):
    proc = run_cli("callbacks=[prometheus]", "callbacks.prometheus.port=70000")
    assert proc.returncode == 2
    assert "callbacks.prometheus.port=70000: must be >= 1 and <= 65535" in proc.stderr
