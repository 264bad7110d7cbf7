"""MLflow tracking against a real `mlflow server` on 127.0.0.1 and the local default store, read back
with `MlflowClient`; a server that goes away mid-run loses no metric."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import rank_checks
from conftest import cli_env, metrics_of, run_id_of, runner_command, wait_for_checkpoint, wait_for_delivery
from mlflow import MlflowClient
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runner.trackers.mlflow import Sender

pytestmark = pytest.mark.slow

TRAIN = ("trainer.max_steps=30", "trainer.log_every=5", "trainer.eval_every=10")


class Server:
    """`mlflow server` with a sqlite backend and served artifacts, on a free port of 127.0.0.1."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        command = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{self.directory / 'mlflow.db'}",
            "--artifacts-destination", str(self.directory / "artifacts"), "--workers", "1",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command,
            cwd=self.directory,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its workers with it in pause/resume
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # its graceful shutdown outlasted a loaded machine: it dies anyway
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)

    def pause(self) -> None:
        """The server stops answering (its connections wait)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module's tests (a server takes seconds to start)."""
    server = Server(tmp_path_factory.mktemp("server"))
    server.start()
    yield server
    server.stop()


def test_a_two_rank_run_logs_params_tags_metrics_and_artifacts_to_a_server(run_cli, server, tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x"],
        cwd=tmp_path,
        check=True,
    )
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.strip()
    proc = run_cli(
        *TRAIN, "hardware=ddp", "hardware.num_processes=2", f"tracker.uri={server.uri}",
        "tracker.log_model=true", "tracker.experiment_name=served", "+tracker.tags.team=vision",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    client = MlflowClient(server.uri)
    run = client.get_run(run_id_of(proc.run_dir))
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "served"
    assert run.data.params["trainer.max_steps"] == "30" and run.data.params["optimizer.lr"] == "0.001"
    tags = run.data.tags
    assert tags["git_commit"] == commit and tags["world_size"] == "2" and tags["hardware"] == "DDP"
    assert tags["precision"] == "no" and tags["team"] == "vision" and tags["host"] == socket.gethostname()
    # a run a person can find: named by its dir, tagged with it and with the command line's overrides
    assert run.info.run_name == proc.run_dir.name and tags["runner.run_dir"] == str(proc.run_dir.resolve())
    assert "hardware.num_processes=2" in tags["runner.overrides"] and "runner.sweep_job" not in tags
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        5,
        10,
        15,
        20,
        25,
        30,
    ]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [10, 20, 30]
    for rank in (0, 1):  # every rank's own figures at each log step (trainer.rank_metrics)
        for figure in ("step_time_s", "data_wait_s", "peak_host_memory_gb"):
            history = client.get_metric_history(run.info.run_id, f"rank/{rank}/{figure}")
            assert [m.step for m in history] == [5, 10, 15, 20, 25, 30] and all(m.value >= 0 for m in history)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"resolved_config.yaml", "runner.log", "model"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.safetensors"]
    assert len(client.search_runs([run.info.experiment_id])) == 1  # rank 1 logged nothing


def test_the_default_store_is_local_inside_outputs_and_whole_when_the_run_exits(tmp_path):
    env = cli_env()
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", *TRAIN, "trainer.progress_bar=false", "trainer.plots=false", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proc.wait(timeout=300)
    # Its stderr is a pipe (as under `| tee` or in a CI log): it ends with the run's process; the sender
    # holds no copy of it.
    exited = time.monotonic()
    stderr = proc.stderr.read()
    assert time.monotonic() - exited < 0.5, "the pipe stayed open after the run's process exited"
    assert proc.returncode == 0, stderr
    # Every record is in the store when the process has exited (read at once, nothing waited for).
    state = json.loads((tmp_path / "run" / "tracking" / "delivered.json").read_text())
    events = (tmp_path / "run" / "tracking" / "events.jsonl").read_text().splitlines()
    assert state["delivered"] == state["closed"] == len(events)
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    run = client.get_run(state["run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["eval/loss"] < 0.5
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [5, 10, 15, 20, 25, 30]
    assert run.info.artifact_uri.startswith(str(tmp_path / "outputs" / "mlartifacts"))
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"resolved_config.yaml", "runner.log"}
    # Creating the store logs MLflow's INFO lines: in the sender's log, not on the console.
    assert (
        "Creating initial MLflow database tables"
        in (tmp_path / "run" / "tracking" / "sender.log").read_text()
    )
    assert "mlflow" not in stderr.lower() and "alembic" not in stderr.lower()


ACCELERATE_SCRIPT = """
import sys
from runner import Accelerator
accelerator = Accelerator(cpu=True, log_with="all", project_dir=sys.argv[1])
accelerator.init_trackers("ported", config={"lr": 0.1})
for step in range(3):
    accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
if sys.argv[2] == "end":
    accelerator.end_training()
"""


@pytest.mark.parametrize("ending", ["end", "exit"])
def test_a_ported_scripts_records_are_in_the_store_when_it_exits(tmp_path, ending):
    """`Accelerator(log_with="all")`: once `end_training()` returns, or the script simply exits, every
    record is in the MLflow store (as under Accelerate), the run FINISHED."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = tmp_path / "script.py"
    script.write_text(ACCELERATE_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "project"), ending],
        env=cli_env() | {"MLFLOW_TRACKING_URI": store}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("ported").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [1.0, 0.5, 1 / 3]


def test_the_sender_that_a_runs_end_waits_for_runs_at_the_normal_priority(tmp_path):
    """The run's end waits for its sender, so the sender must not run at idle priority: inside a job's
    CPU cgroup (SLURM's, a Kubernetes pod's) with the other processes keeping every core busy, one at
    SCHED_IDLE got a tenth of a core, and a ported script's exit waited out `finish_timeout_s` (40 s)
    where one at the normal priority was done in 14 s."""
    sender = Sender(tmp_path / "sender.log", False)
    sender.warm("no-such-scheme://store")  # refused, and logged, once MLflow is imported
    deadline = time.monotonic() + 60
    while "not ready yet" not in (tmp_path / "sender.log").read_text():
        assert sender.running() and time.monotonic() < deadline, (tmp_path / "sender.log").read_text()
        time.sleep(0.1)
    try:
        assert os.sched_getscheduler(sender.process.pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, sender.process.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        sender.process.stdin.close()
        sender.process.wait(timeout=30)


def test_a_sender_that_was_given_nothing_to_send_exits_with_its_command():
    """`python -m runner` starts its sender before it knows whether it will track (a refused command, a
    plan): once the command is gone without naming a journal, the sender exits at once instead of
    finishing MLflow's import first (seconds of CPU after every refusal)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import mlflow"], check=True)
    import_s = time.monotonic() - started
    sender = Sender(None, False)
    started = time.monotonic()
    sender.process.stdin.close()  # the command exits
    sender.process.wait(timeout=60)
    assert sender.process.returncode == 0
    assert time.monotonic() - started < 0.25 * import_s, (time.monotonic() - started, import_s)  # 0.4 s, 5 s


def test_a_run_stopped_by_a_signal_ends_killed_and_its_resumption_finished(tmp_path):
    run_dir = tmp_path / "run"
    command = runner_command(
        run_dir, "trainer.max_steps=100000", "trainer.checkpoint_every=50", "tracker=mlflow"
    )
    proc = subprocess.Popen(command, env=cli_env(), stderr=subprocess.PIPE, text=True)
    wait_for_checkpoint(run_dir, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    client = MlflowClient(cli_env()["MLFLOW_TRACKING_URI"])
    assert client.get_run(run_id_of(run_dir)).info.status == "KILLED"
    resumed = subprocess.run(
        runner_command(run_dir, "trainer.max_steps=100", "tracker=mlflow"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert client.get_run(run_id_of(run_dir)).info.status == "FINISHED"  # the same run, resumed


def test_a_run_that_raises_ends_failed(run_cli):
    proc = run_cli(
        *TRAIN,
        "tracker=mlflow",
        "task._target_=faulty_tasks.RaiseAtThirdStep",
        pythonpath=Path(__file__).parent,
    )
    assert proc.returncode == 1 and "injected failure at step 3" in proc.stderr
    # one process: the same report as a rank's, the user's frames only; the whole traceback in the log
    assert "Training failed: RuntimeError: injected failure at step 3\n(at optimizer step 3 of" in proc.stderr
    assert 'faulty_tasks.py", line' in proc.stderr and "Traceback" not in proc.stderr
    assert "runner/train.py" in (proc.run_dir / "runner.log").read_text()
    client = MlflowClient(cli_env()["MLFLOW_TRACKING_URI"])
    assert client.get_run(run_id_of(proc.run_dir)).info.status == "FAILED"


def test_tracker_none_tracks_nothing(run_cli):
    proc = run_cli(*TRAIN, "tracker=none")
    assert proc.returncode == 0, proc.stderr
    assert not (proc.run_dir / "tracking").exists()


def test_a_server_that_dies_mid_run_loses_no_metric(server, tmp_path):
    """The module's server, stopped mid-run and started again on its store (as the tests after it find it)."""
    run_dir, gate = tmp_path / "run", tmp_path / "server-stopped"
    command = [
        sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", "trainer.progress_bar=false", "trainer.plots=false",
        f"tracker.uri={server.uri}", "trainer.max_steps=600", "trainer.log_every=10", "trainer.eval_every=100",
        "tracker.detach=false",  # the sender starts with the run (detached, it would start 5 s in)
        "task._target_=faulty_tasks.WaitAtStep", f"+task.gate={gate}", "+task.step=55",  # waits for the stop
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=cli_env(Path(__file__).parent), stderr=subprocess.PIPE, text=True
    )
    delivered = run_dir / "tracking" / "delivered.json"
    deadline = time.monotonic() + 120
    while not (
        delivered.exists() and json.loads(delivered.read_text())["delivered"] >= 3
    ):  # run, params, metrics
        assert proc.poll() is None and time.monotonic() < deadline, "nothing reached the server"
        time.sleep(0.05)
    server.stop()
    try:
        gate.touch()  # the run goes on from step 55 with the server gone
        _, stderr = proc.communicate(timeout=300)
    finally:
        server.start()  # the same store, back up
    assert proc.returncode == 0, stderr  # training went on
    assert stderr.count("MLflow at") == 1 and "python -m runner.trackers.upload" in stderr  # one warning
    upload = subprocess.run(
        [sys.executable, "-m", "runner.trackers.upload", str(run_dir)],
        env=cli_env(),
        capture_output=True,
        text=True,
    )
    assert upload.returncode == 0, upload.stderr
    client = MlflowClient(server.uri)
    run = client.get_run(run_id_of(run_dir))
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(10, 601, 10))  # every logged step, once
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == list(
        range(100, 601, 100)
    )
    assert run.info.status == "FINISHED"
    again = subprocess.run(
        [sys.executable, "-m", "runner.trackers.upload", str(run_dir)],
        env=cli_env(),
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0 and "nothing to upload" in again.stdout


def test_only_the_main_process_tracks(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    results = rank_checks.run_ranks(rank_checks.tracking_from_two_ranks, str(tmp_path))
    assert results[1] == {"run_id": None, "tracker": "BlankTracker"}
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    run = client.get_run(results[0]["run_id"])
    assert run.data.params == {"lr": "0.1", "model.width": "8"}
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [1.0, 0.5, 1 / 3]
    assert run.data.metrics["rank"] == 0.0


def test_a_sweep_is_one_parent_run_with_a_child_per_job_and_a_summary(run_cli, server, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        *TRAIN, f"tracker.uri={server.uri}", "optimizer.lr=1e-3,1e-2", f"hydra.sweep.dir={sweep}", "-m"
    )
    assert proc.returncode == 0, proc.stderr
    client = MlflowClient(server.uri)
    parent = client.get_run(json.loads((sweep / "tracking" / "parent.json").read_text())["run_id"])
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"summary.csv", "summary.png", "curves.png"}
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert sorted(run.data.params["optimizer.lr"] for run in children) == ["0.001", "0.01"]
    named = {run.data.tags["runner.sweep_job"]: run for run in children}
    for job, run in named.items():  # each job named <sweep dir>/<job>, tagged with its dir and overrides
        assert run.info.run_name == f"sweep/{job}" and run.data.tags["runner.run_dir"] == str(sweep / job)
        assert f"optimizer.lr={run.data.params['optimizer.lr']}" in run.data.tags["runner.overrides"].split()
    assert sorted(named) == ["0", "1"]
    # One sender for the sweep's process: it writes its log in the first job's dir only.
    assert [p.parent.parent.name for p in sweep.glob("*/tracking/sender.log")] == ["0"]
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    for job, row in enumerate(rows):
        metrics = json.loads((sweep / str(job) / "metrics.json").read_text())
        assert row["job"] == str(job) and float(row["eval/loss"]) == metrics["eval/loss"]
    assert [row["optimizer.lr"] for row in rows] == ["0.001", "0.01"]
    # ranked by trainer.objective (eval/loss, lower is better), the best named, the pictures too
    best = min(rows, key=lambda row: float(row["eval/loss"]))
    assert sorted(rows, key=lambda row: int(row["rank (eval/loss)"]))[0] is best
    output = proc.stdout + proc.stderr
    assert f"best: job {best['job']} (optimizer.lr={best['optimizer.lr']}): eval/loss=" in output
    for picture in ("summary.png", "curves.png"):
        assert (sweep / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(sweep / picture) in output
    assert "sweep summary" in output  # printed


def test_the_objective_drives_an_optuna_sweep(run_cli, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "trainer.max_steps=20", "tracker=none", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4",
        "hydra.sweeper.sampler.seed=0", "optimizer.lr=interval(0.0001,0.1)", f"hydra.sweep.dir={sweep}", "-m",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    trials = {
        float(OmegaConf.load(job / ".hydra" / "overrides.yaml")[0].split("=")[1]): json.loads(
            (job / "metrics.json").read_text()
        )["eval/loss"]
        for job in sweep.glob("[0-9]*")
    }
    assert len(trials) == 4
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert best.best_value == min(trials.values())
    assert trials[best.best_params["optimizer.lr"]] == best.best_value


def test_a_server_that_is_not_there_costs_one_warning_and_keeps_everything(run_cli):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    proc = run_cli(*TRAIN, f"tracker.uri=http://127.0.0.1:{closed}")
    assert proc.returncode == 0, proc.stderr
    # One warning, from the run that waited for its records: the error and the upload command.
    assert proc.stderr.count("MLflow at") == 1 and "python -m runner.trackers.upload" in proc.stderr
    events = (proc.run_dir / "tracking" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["op"] for line in events].count(
        "metrics"
    ) == 6 + 3 + 1  # train every 5, eval every 10, the goodput at the end
    state = json.loads((proc.run_dir / "tracking" / "delivered.json").read_text())
    assert state["delivered"] == 0 and f"127.0.0.1:{closed}" in state["error"]  # nothing was sent


def test_a_detached_run_exits_before_its_records_are_sent_and_the_sender_delivers_them(server, tmp_path):
    """With the server paused, the run still exits at once; resumed, the server gets every record."""
    env = cli_env() | {"MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}  # the sender waits for the paused server
    run_dir = tmp_path / "run"
    try:
        server.pause()
        with open(tmp_path / "stderr", "w") as stderr:  # a file: the sender's copy of it holds no pipe open
            code = subprocess.run(
                runner_command(run_dir, *TRAIN, f"tracker.uri={server.uri}", "tracker.detach=true"),
                env=env,
                stderr=stderr,
                timeout=240,
            ).returncode
        assert code == 0, (tmp_path / "stderr").read_text()
        state_file = run_dir / "tracking" / "delivered.json"
        assert not state_file.exists() or json.loads(state_file.read_text())["delivered"] == 0  # nothing yet
        server.resume()
        state = wait_for_delivery(run_dir)
        assert state["delivered"] == len((run_dir / "tracking" / "events.jsonl").read_text().splitlines())
        client = MlflowClient(server.uri)
        run = client.get_run(state["run_id"])
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [10, 20, 30]
    finally:
        server.resume()


def test_a_waiting_run_waits_for_its_records_at_most_finish_timeout_s(server, tmp_path):
    """`tracker.detach=false` (the default): the run waits for the sender, and says so when the server does
    not answer."""
    env = cli_env() | {"MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}
    run_dir = tmp_path / "run"
    try:
        delivered = subprocess.run(
            runner_command(tmp_path / "first", *TRAIN, f"tracker.uri={server.uri}", "tracker.detach=false"),
            env=env, stderr=subprocess.DEVNULL, timeout=240,
        )  # fmt: skip
        assert delivered.returncode == 0
        state = json.loads((tmp_path / "first" / "tracking" / "delivered.json").read_text())  # read at exit
        assert (
            state["closed"] == state["delivered"] == 2 + 6 + 3 + 1 + 2 + 1
        )  # start, params, metrics, goodput, artifacts, end
        server.pause()
        with open(tmp_path / "stderr", "w") as stderr:
            code = subprocess.run(
                runner_command(
                    run_dir, *TRAIN, f"tracker.uri={server.uri}", "tracker.detach=false", "tracker.finish_timeout_s=3"
                ),
                env=env, stderr=stderr, timeout=240,
            ).returncode  # fmt: skip
        assert code == 0
        assert "still being sent" in (tmp_path / "stderr").read_text()  # it waited 3 s, then said so
        server.resume()
        assert (
            MlflowClient(server.uri).get_run(wait_for_delivery(run_dir)["run_id"]).info.status == "FINISHED"
        )
    finally:
        server.resume()


def test_a_run_its_watchdog_ends_for_hanging_ends_failed(tmp_path):
    """A hang is a failure, not a stop to be resumed: the watchdog ends the rank (os._exit) having closed
    the trackers' run as FAILED (the sender would otherwise close a run its process left open as KILLED)."""
    run_dir = tmp_path / "run"
    hang = ["task._target_=faulty_tasks.WaitAtStep", f"+task.gate={tmp_path / 'never'}", "+task.step=3"]
    proc = subprocess.run(
        runner_command(run_dir, *hang, "trainer.hang_timeout_s=2", "trainer.log_every=1", "tracker=mlflow"),
        env=cli_env(Path(__file__).parent), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 124, proc.stderr
    assert "Training hung: rank 0 on " in proc.stderr  # one process, no launcher: its rank says it
    client = MlflowClient(cli_env()["MLFLOW_TRACKING_URI"])
    assert client.get_run(run_id_of(run_dir)).info.status == "FAILED"


def test_a_run_killed_outright_keeps_its_metrics_and_ends_killed(tmp_path):
    """kill -9 writes no end record: the sender sends what was written and closes the run as KILLED."""
    run_dir = tmp_path / "run"
    command = runner_command(
        run_dir, "trainer.max_steps=100000", "trainer.log_every=10", "trainer.eval_every=0", "tracker=mlflow"
    )
    proc = subprocess.Popen(command, env=cli_env(), stderr=subprocess.DEVNULL)
    events, state_file = run_dir / "tracking" / "events.jsonl", run_dir / "tracking" / "delivered.json"
    deadline = time.monotonic() + 120
    while not (
        state_file.exists() and json.loads(state_file.read_text())["delivered"] >= 5
    ):  # the sender runs
        assert proc.poll() is None and time.monotonic() < deadline, "nothing was delivered"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    state = wait_for_delivery(run_dir)
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert lines[-1]["op"] != "end" and state["delivered"] == len(lines)
    client = MlflowClient(cli_env()["MLFLOW_TRACKING_URI"])
    run = client.get_run(state["run_id"])
    assert run.info.status == "KILLED"
    logged = [event["step"] for event in lines if event["op"] == "metrics"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == logged


def test_tracker_tensorboard_writes_the_runs_metrics_into_its_directory(run_cli):
    proc = run_cli(*TRAIN, "tracker=tensorboard", "tracker.experiment_name=tb")
    assert proc.returncode == 0, proc.stderr
    events = EventAccumulator(str(proc.run_dir / "tb"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [5, 10, 15, 20, 25, 30]
    assert losses[-1].value < losses[0].value
    assert f"{metrics_of(proc)['train/loss']:.4f}" == f"{losses[-1].value:.4f}"
    # The config as hyperparameters, in the run's one event file (not a second, empty one beside it).
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    assert len(list((proc.run_dir / "tb").glob("events.out.tfevents.*"))) == 1
