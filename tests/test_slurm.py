"""`launcher=slurm` (one run, and a sweep's jobs as arrays) on a real SLURM cluster on this machine (slurmctld,
slurmd, slurmdbd; `bash .ci/slurm.sh up` starts it, as CI does). Without one these tests skip, saying so."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rank_checks
from conftest import cli_env, metrics_of, runner_command

from runner.telemetry.goodput import read_ledger

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
TWO_TASKS = ["launcher=slurm", "hardware=ddp", "hardware.num_processes=2"]


@pytest.fixture(scope="module")
def slurm() -> None:
    """Skip unless a SLURM cluster answers here."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        pytest.skip("no SLURM on this machine: `bash .ci/slurm.sh up` (as root) starts one")
    proc = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.skip(
            f"SLURM does not answer ({proc.stderr.strip()}): `bash .ci/slurm.sh up` (as root) starts it"
        )


def run(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        runner_command(run_dir, *overrides),
        env=env or cli_env(TESTS),
        cwd=run_dir.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


def refused(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`run` for a command refused before anything is queued: forked (`rank_checks.command`, 0.3 s)."""
    return rank_checks.command(runner_command(run_dir, *overrides), run_dir.parent, env=cli_env(TESTS))


def job_id(run_dir: Path, proc: subprocess.Popen) -> str:
    """The SLURM job id of the run in `run_dir`, once submitit has written its files."""
    deadline = time.monotonic() + 60
    while not (submitted := list((run_dir / "slurm").glob("*_submitted.pkl"))):
        assert proc.poll() is None and time.monotonic() < deadline, "the job was not submitted"
        time.sleep(0.1)
    return submitted[0].name.split("_")[0]


def test_a_two_task_ddp_job_trains_exactly_as_two_local_ranks(slurm, tmp_path):
    proc = run(tmp_path / "slurm", *TWO_TASKS, "trainer.max_steps=30")
    assert proc.returncode == 0, proc.stderr
    assert "submitted SLURM job" in proc.stderr and "1 node(s) x 2 task(s)" in proc.stderr
    assert "2 process(es)" in proc.stderr  # rank 0's log, streamed while the job ran
    assert sorted(p.name for p in (tmp_path / "slurm" / "slurm").glob("*_log.err"))[-1].endswith("_1_log.err")
    local = run(tmp_path / "local", "hardware=ddp", "hardware.num_processes=2", "trainer.max_steps=30")
    assert local.returncode == 0, local.stderr
    assert metrics_of(proc) == metrics_of(local)
    weights = [tmp_path / name / "model" / "model.safetensors" for name in ("slurm", "local")]
    assert weights[0].read_bytes() == weights[1].read_bytes()


def test_wait_false_returns_once_queued_and_the_job_writes_its_metrics(slurm, tmp_path):
    run_dir = tmp_path / "run"
    proc = run(run_dir, "launcher=slurm", "launcher.wait=false", "trainer.max_steps=20")
    assert proc.returncode == 0, proc.stderr
    assert "not waiting" in proc.stderr and "final metrics" not in proc.stderr
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.json").exists():
        assert time.monotonic() < deadline, "the queued job wrote no metrics"
        time.sleep(0.5)


def sweep_on_slurm(
    sweep: Path, *overrides: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m runner -m launcher=slurm <overrides>` with its sweep dir at `sweep`."""
    return subprocess.run(
        [sys.executable, "-m", "runner", f"hydra.sweep.dir={sweep}", "trainer.progress_bar=false", "trainer.plots=false",
         "launcher=slurm", *overrides, "-m"],
        env=env or cli_env(), cwd=sweep.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_sweep_runs_as_a_slurm_array_with_one_dir_per_job(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    proc = sweep_on_slurm(
        sweep,
        "trainer.max_steps=20",
        "hardware=ddp",
        "hardware.num_processes=2",
        "optimizer.lr=1e-3,1e-4",
    )
    assert proc.returncode == 0, proc.stderr
    tasks = array_tasks(sweep)
    assert len(tasks) == 2 and tasks[0].endswith("_0") and tasks[1].endswith("_1")
    assert tasks[0].split("_")[0] == tasks[1].split("_")[0]  # one array
    array = tasks[0].split("_")[0]
    assert (
        f"submitted SLURM array {array}: job(s) 0, 1 of the sweep, each 1 node(s) x 2 task(s)" in proc.stdout
    )
    logs = sorted(p.name.split("_")[1:3] for p in (sweep / "slurm").glob("*_log.err"))  # <array>_<job>_<task>
    assert logs == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]  # one task per rank
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["optimizer.lr"] for row in rows] == ["0.001", "0.0001"]
    assert all(
        0 < float(row["goodput"]) < 1 and float(row["wall_s"]) > 0 for row in rows
    )  # each job's ledger
    assert "time spent by 2 job(s): " in proc.stdout
    for job in ("0", "1"):
        assert (sweep / job / "metrics.json").exists() and (sweep / job / "model").is_dir()
        log = (sweep / job / "runner.log").read_text()
        assert "2 process(es)" in log and "already rank 1" not in log  # rank 1 logs warnings only


def test_sweep_jobs_that_ask_for_other_tasks_are_arrays_of_their_own(slurm, tmp_path):
    """A swept `hardware.num_processes` changes what a job asks of SLURM: each run of jobs that ask the same
    is one array, each job with one task per rank."""
    sweep = tmp_path / "sweep"
    proc = sweep_on_slurm(
        sweep, "trainer.max_steps=5", "tracker=none", "hardware=ddp", "hardware.num_processes=1,2,2"
    )
    assert proc.returncode == 0, proc.stderr
    tasks = array_tasks(sweep)
    arrays = {task.split("_")[0] for task in tasks}
    assert len(tasks) == 3 and len(arrays) == 2
    assert "job(s) 0 of the sweep, each 1 node(s) x 1 task(s)" in proc.stdout
    assert "job(s) 1, 2 of the sweep, each 1 node(s) x 2 task(s)" in proc.stdout
    for job, ranks in enumerate((1, 2, 2)):
        assert f"{ranks} process(es)" in (sweep / str(job) / "runner.log").read_text()


def test_a_preempted_job_requeues_itself_and_ends_bitwise_equal_to_an_uninterrupted_run(slurm, tmp_path):
    train = [
        "trainer.max_steps=600",
        "trainer.eval_every=200",
        "trainer.checkpoint_every=50",
        "model.dropout=0.1",
    ]
    reference = run(tmp_path / "reference", "hardware=ddp", "hardware.num_processes=2", *train)
    assert reference.returncode == 0, reference.stderr
    run_dir = tmp_path / "run"
    env = cli_env()
    began = time.time()
    proc = subprocess.Popen(
        runner_command(run_dir, *TWO_TASKS, *train),
        env=env,
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        job = job_id(run_dir, proc)
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # what SLURM sends before preempting
        _, stderr = proc.communicate(timeout=240)
        measured = time.time() - began
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert f"requeueing SLURM job {job}" in stderr
    assert "Restarts=1" in subprocess.check_output(["scontrol", "show", "job", job], text=True)
    assert "resumed from" in (run_dir / "runner.log").read_text()
    weights = [d / "model" / "model.safetensors" for d in (run_dir, tmp_path / "reference")]
    assert weights[0].read_bytes() == weights[1].read_bytes()
    # The ledger: the queue before each attempt (the first and the requeued), nothing lost (the
    # preempted attempt checkpointed where it stopped), and its phases account for the command's time.
    summary = json.loads((run_dir / "goodput.json").read_text())
    assert (summary["attempts"], summary["restarts"], summary["lost_steps"]) == (2, 0, 0)
    assert summary["phases_s"]["queued"] > 0 and "lost" not in summary["phases_s"]
    assert sum(summary["phases_s"].values()) == pytest.approx(summary["wall_s"])
    assert measured - 0.3 - 0.02 * measured <= summary["wall_s"] <= measured  # 0.3 s: torch's teardown
    queued = [r for r in read_ledger(run_dir) if r.get("before") == "queued"]
    assert len(queued) == 2  # each attempt's first record says the time before it was the queue


def test_a_job_whose_rank_is_killed_is_reported_failed(slurm, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    run_dir = tmp_path / "run"
    overrides = [*TWO_TASKS, "trainer.max_steps=1000000", "task._target_=faulty_tasks.RecordPid"]
    proc = subprocess.Popen(
        runner_command(run_dir, *overrides, f"+task.pid_dir={pids}"),
        env=cli_env(TESTS),
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        job = job_id(run_dir, proc)
        deadline = time.monotonic() + 120
        while len(list(pids.glob("rank*"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        (pids / "rank1").read_text()
        subprocess.run(["kill", "-KILL", (pids / "rank1").read_text()], check=True)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert f"Training failed: SLURM job {job} ended FAILED" in stderr


def test_a_job_whose_rank_is_killed_is_submitted_again_and_finishes_from_its_checkpoint(slurm, tmp_path):
    """launcher.restarts=1: rank 1 killed after a checkpoint; the command submits the job again, which
    resumes from that checkpoint and finishes; the ledger has both attempts."""
    pids = tmp_path / "pids"
    pids.mkdir()
    run_dir = tmp_path / "run"
    overrides = [
        *TWO_TASKS,
        "trainer.max_steps=200",
        "trainer.checkpoint_every=20",
        "launcher.restarts=1",
    ]
    proc = subprocess.Popen(
        runner_command(run_dir, *overrides, "task._target_=faulty_tasks.RecordPid", f"+task.pid_dir={pids}"),
        env=cli_env(TESTS),
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = job_id(run_dir, proc)
        deadline = time.monotonic() + 120
        while not ((run_dir / "checkpoints" / "latest").exists() and (pids / "rank1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        subprocess.run(["kill", "-KILL", (pids / "rank1").read_text()], check=True)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert re.search(
        rf"SLURM job {first} ended FAILED without a result: restart 1 of 1, a new SLURM job resumes", stderr
    )
    assert stderr.count("submitted SLURM job") == 2 and "resumed from" in (run_dir / "runner.log").read_text()
    summary = json.loads((run_dir / "goodput.json").read_text())
    assert summary["attempts"] == 2 and (run_dir / "metrics.json").exists()


def test_a_job_whose_rank_hangs_fails_naming_the_rank_from_its_watchdogs_report(slurm, tmp_path):
    """Rank 1 of a SLURM job sleeps in its third step: its watchdog ends it (exit 124), and the command
    says what the report says (the rank, its host, the step, its line), not only the job's state."""
    proc = subprocess.run(
        runner_command(
            tmp_path / "run", *TWO_TASKS, "trainer.hang_timeout_s=3", "task._target_=faulty_tasks.HangOnRank1"
        ),
        env=cli_env(TESTS), cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert re.search(
        r"Training failed: rank 1 on \S+ made no progress for \d+ s \(trainer.hang_timeout_s: 3 s\) in step 3",
        proc.stderr,
    )
    assert re.search(r"its main thread is at \S+faulty_tasks.py:\d+ in training_step", proc.stderr)
    assert (tmp_path / "run" / "hang" / "rank1.txt").is_file()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["launcher.partition=gpu"],
            "launcher.partition='gpu': the cluster has no such partition (it has ",
        ),
        (["launcher.nodes=3"], "launcher.nodes=3: partition debug has 1 node(s). Ask for at most 1."),
        (["launcher.cpus_per_task=1000"], "each node would need 2000 CPUs (tasks per node x cpus_per_task)"),
        (
            ["launcher.gpus_per_node=2", "hardware.num_processes=null"],
            "the nodes of partition debug have no GPUs",
        ),
        (["launcher.mem_gb=100000"], "launcher.mem_gb=100000.0: the nodes of partition debug have"),
        (["launcher.time_min=0"], "launcher.time_min=0: must be >= 1."),
        (
            ["launcher.restarts=1", "launcher.wait=false"],
            "launcher.restarts=1 with launcher.wait=false",
        ),
    ],
)
def test_what_the_cluster_cannot_give_is_refused_before_anything_is_queued(
    slurm, tmp_path, overrides, message
):
    proc = refused(tmp_path / "run", *TWO_TASKS, *overrides)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and "submitted" not in proc.stderr
    assert not (tmp_path / "run" / "slurm").exists()


def test_a_bad_sweep_is_refused_before_its_array_is_queued(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    proc = sweep_on_slurm(sweep, "launcher.partition=nope", "optimizer.lr=1e-3,1e-4")
    assert proc.returncode == 2, proc.stderr
    assert "launcher.partition='nope': the cluster has no such partition" in proc.stderr
    assert not (sweep / "slurm").exists()
    proc = sweep_on_slurm(sweep, "launcher.wait=false", "optimizer.lr=1e-3,1e-4")
    assert proc.returncode == 2, proc.stderr
    assert "Configuration error: launcher.wait=false in a sweep: the sweep waits for its jobs" in proc.stderr
    assert not (sweep / "slurm").exists()


def test_without_sbatch_launcher_slurm_says_so_before_anything_starts(tmp_path):
    env = cli_env() | {"PATH": str(Path(sys.executable).parent)}  # python, and no SLURM commands
    proc = run(tmp_path / "run", "launcher=slurm", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "launcher=slurm: `sbatch` is not on PATH" in proc.stderr and "launcher=local" in proc.stderr


def test_without_submitit_launcher_slurm_names_the_pip_install(tmp_path):
    hidden = tmp_path / "no_submitit"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['submitit'] = None  # not installed\n")
    proc = run(tmp_path / "run", "launcher=slurm", env=cli_env(hidden))
    assert proc.returncode == 2, proc.stderr
    assert "launcher=slurm needs submitit, which is not installed" in proc.stderr
    assert "pip install 'runner-ml[slurm]'" in proc.stderr


def test_every_setting_of_launcher_slurm_reaches_the_batch_script(tmp_path):
    """launcher=slurm's settings as sbatch and srun get them: each in the batch script that submitit
    writes for the job (a setting dropped on the way would be missing), the requeues at the time limit
    in the executor that queues it (a sweep's arrays are queued by the same executor)."""
    pytest.importorskip("submitit")
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from runner.config import CONF_DIR
    from runner.group_schemas import register_configs

    register_configs()
    settings = {
        "partition": "big", "nodes": "2", "gpus_per_node": "4", "cpus_per_task": "6", "mem_gb": "64",
        "time_min": "90", "account": "lab", "qos": "high", "constraint": "a100", "signal_delay_s": "77",
        "max_timeouts": "5", "name": "mine", "setup": "['module load cuda']", "srun_args": "['--cpu-bind=none']",
    }  # fmt: skip
    overrides = [f"launcher.{key}={value}" for key, value in settings.items()]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["launcher=slurm", *overrides, "+launcher.sbatch_args.mail-type=END"])
    executor = instantiate(cfg.launcher).executor(tmp_path, tasks_per_node=4)
    script = executor._make_submission_file_text("python -m submitit.core._submit", "uid").splitlines()
    sbatch = {line.removeprefix("#SBATCH ") for line in script if line.startswith("#SBATCH ")}
    assert {
        "--partition=big", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=6",
        "--mem=65536MB", "--time=90", "--account=lab", "--qos=high", "--constraint=a100",
        "--signal=USR2@77", "--job-name=mine", "--mail-type=END",
    } <= sbatch  # fmt: skip
    assert script[script.index("# setup") + 1] == "module load cuda"
    srun = next(line for line in script if line.startswith("srun "))
    assert "--kill-on-bad-exit=1 --cpu-bind=none python -m submitit" in srun
    assert executor.max_num_timeout == 5


def test_slurm_time_limits_and_gres_are_read_as_sinfo_prints_them():
    from runner.launchers.slurm.partitions import _gpus, _minutes

    assert [_minutes(t) for t in ("infinite", "30", "30:00", "2:00:00", "1-00:00:00", "1-12", "0:30")] == [
        None, 30, 30, 120, 1440, 2160, 1,
    ]  # fmt: skip
    assert [_gpus(g) for g in ("(null)", "gpu:8", "gpu:a100:4(S:0-1)", "gpu:2,gpu:v100:4")] == [0, 8, 4, 4]


@pytest.mark.parametrize("plugin", ["installed", "not installed"])
def test_hydras_submitit_launcher_is_refused_naming_launcher_slurm_and_its_keys(tmp_path, plugin):
    """One SLURM path: the Hydra plugin's sweep launcher, installed or not, is refused before anything runs,
    naming runner's way and where each of the plugin's keys went."""
    hidden = tmp_path / "no_plugin"
    hidden.mkdir()
    if plugin == "not installed":
        (hidden / "sitecustomize.py").write_text(
            "import sys\nsys.modules['hydra_plugins.hydra_submitit_launcher'] = None  # not installed\n"
        )
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "runner", f"hydra.sweep.dir={sweep}", "hydra/launcher=submitit_slurm",
         "optimizer.lr=1e-3,1e-4", "-m"],
        env=cli_env(hidden), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    refusal = proc.stderr.strip().splitlines()[-1]
    assert refusal.startswith(
        "Configuration error: hydra/launcher=submitit_slurm: runner runs a sweep on SLURM"
    )
    assert "add launcher=slurm to the sweep" in refusal and "timeout_min -> time_min" in refusal
    assert not (sweep / "0").exists()
    local = subprocess.run(
        [sys.executable, "-m", "runner", f"hydra.sweep.dir={sweep}", "hydra/launcher=submitit_local",
         "optimizer.lr=1e-3,1e-4", "-m"],
        env=cli_env(hidden), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert local.returncode == 2, local.stderr
    assert local.stderr.strip().splitlines()[-1] == (
        "Configuration error: hydra/launcher=submitit_local: runner runs a sweep's jobs here one after another "
        "with the default launcher, each starting its own ranks: leave hydra/launcher out."
    )
    assert not (sweep / "0").exists()


def test_a_configuration_error_found_in_a_rank_is_reported_as_one(slurm, tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    proc = run(
        tmp_path / "run",
        "launcher=slurm",
        "data=text",
        f"data.path={tiny}",
        "task=language_modeling",
        "model=gpt",
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # after rank 0's streamed log (its traceback included)
    assert last.startswith("Configuration error: data.path=") and "bytes are too few" in last


def test_a_slurm_sweep_run_again_resubmits_only_its_cancelled_array_tasks(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    overrides = ["trainer.max_steps=20", "optimizer.lr=1e-1,1e-2,1e-3,1e-4"]
    command = [sys.executable, "-m", "runner", f"hydra.sweep.dir={sweep}", "trainer.progress_bar=false", "trainer.plots=false",
               "launcher=slurm", *overrides, "-m"]  # fmt: skip
    proc = subprocess.Popen(command, env=cli_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tasks := array_tasks(sweep)):
            assert proc.poll() is None and time.monotonic() < deadline, "the array was not submitted"
            time.sleep(0.02)
        array = tasks[0].split("_")[0]
        # once they run (submitit never learns of array tasks cancelled before they started: it would wait)
        while running(f"{array}_2", f"{array}_3") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the array's tasks did not start"
            time.sleep(0.05)
        subprocess.run(["scancel", f"{array}_2", f"{array}_3"], check=True)
        _, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode != 0, stderr  # two of its jobs did not finish
    assert [(sweep / str(n) / "metrics.json").exists() for n in range(4)] == [True, True, False, False]
    finished = {
        n: sorted((p.name, p.stat().st_mtime_ns) for p in (sweep / str(n)).rglob("*")) for n in (0, 1)
    }

    again = sweep_on_slurm(sweep, *overrides)
    assert again.returncode == 0, again.stderr
    resubmitted = [task for task in array_tasks(sweep) if not task.startswith(f"{array}_")]
    assert len(resubmitted) == 2 and len({task.split("_")[0] for task in resubmitted}) == 1  # one array of 2
    assert {
        n: sorted((p.name, p.stat().st_mtime_ns) for p in (sweep / str(n)).rglob("*")) for n in (0, 1)
    } == finished
    with open(sweep / "summary.csv") as f:
        assert [row["optimizer.lr"] for row in csv.DictReader(f)] == ["0.1", "0.01", "0.001", "0.0001"]


def running(*jobs: str) -> int:
    """How many of `jobs` SLURM runs now."""
    states = subprocess.run(
        ["squeue", "--noheader", "--format=%i %T", "--jobs", ",".join(jobs)], capture_output=True, text=True
    ).stdout.split("\n")
    return sum(line.endswith(" RUNNING") for line in states)


def array_tasks(sweep: Path) -> list[str]:
    """The `<array job>_<task>` of each array task submitit queued for the sweep (its `_submitted.pkl`)."""
    return sorted(p.name.removesuffix("_submitted.pkl") for p in (sweep / "slurm").glob("*_submitted.pkl"))
