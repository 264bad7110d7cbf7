"""`python -m runner` with several ranks: one dir per job, sweeps, external launchers, and failures."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import probes
import pytest
import torch
from conftest import cli_env, metrics_of, runner_command
from omegaconf import OmegaConf

from hydra_plugins.runner_launcher.launcher import RunnerLauncher
from runner import load_checkpoint_in_model
from runner.checkpoint.weights import read_weights
from runner.errors import ConfigError
from runner.launchers.base import Sweep
from runner.launchers.local import LocalLauncher
from runner.models import GPT
from runner.schemas import schemas

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
TWO_RANKS = ("hardware=ddp", "hardware.num_processes=2")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_two_ranks_write_one_job_dir(run_cli, tmp_path, start_method):
    proc = run_cli(
        *TWO_RANKS, f"launcher.start_method={start_method}", "trainer.max_steps=30", "trainer.eval_every=0"
    )
    assert proc.returncode == 0, proc.stderr
    assert metrics_of(proc)["eval/loss"] < 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no dir per rank, nothing in cwd
    log = (proc.run_dir / "runner.log").read_text()
    assert log.count(f"starting 2 ranks ({start_method})") == 1
    assert log.count("2 process(es)") == 1  # only rank 0 logs below warnings
    assert (proc.run_dir / "resolved_config.yaml").exists()


@pytest.mark.parametrize(
    ("overrides", "dtype", "micro_batches", "max_norm"),
    [
        # 2 ranks split 58 batches an epoch: 29 each, 15 steps of 2 (the last of 1) an epoch.
        (
            ["precision=fp16", "trainer.gradient_accumulation_steps=2", "trainer.max_grad_norm=0.05"],
            "float16",
            39,
            0.05,
        ),
        (
            ["experiment=gpt_sonnets", "task._target_=probes.RecordingLanguageModeling", "precision=bf16"],
            "bfloat16",
            20,
            None,
        ),
    ],
    ids=["fp16 accumulation 2 clipping", "gpt bf16"],
)
def test_two_ranks_with_precision_accumulation_and_clipping(
    run_cli, tmp_path, overrides, dtype, micro_batches, max_norm
):
    record = tmp_path / "probe"
    probes_ = [
        "task._target_=probes.RecordingRegression",
        f"+task.record={record}",
        "optimizer._target_=probes.NormRecordingAdamW",
        f"+optimizer.record={record}",
    ]
    proc = run_cli(
        *TWO_RANKS, "trainer.max_steps=20", "trainer.eval_every=0", *probes_, *overrides, pythonpath=TESTS
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 process(es)" in proc.stderr and metrics_of(proc)["eval/loss"] < 5.0
    for rank in (0, 1):
        assert probes.read(record, "task", rank) == [dtype] * micro_batches
        norms = [float(norm) for norm in probes.read(record, "optimizer", rank)]
        assert 0 < len(norms) <= 20
        if max_norm is not None:
            assert max(norms) <= max_norm * (1 + 1e-4)
    # DDP: both ranks applied the same (averaged) gradients
    assert probes.read(record, "optimizer", 0) == probes.read(record, "optimizer", 1)


def test_user_code_computing_in_the_launching_process_does_not_hang_forked_ranks(run_cli):
    # Ranks with 2 threads each hang at their first parallel op if the launching process had used its own.
    proc = run_cli(
        *TWO_RANKS,
        "hardware.num_threads=2",
        "data._target_=faulty_tasks.ComputeInInit",
        "trainer.max_steps=10",
        pythonpath=TESTS,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_fsdp_shards_gpt_blocks_in_bf16_and_saves_full_weights(run_cli):
    fsdp = ("hardware=fsdp", "hardware.num_processes=2", "hardware.shard_modules=[Block]", "precision=bf16")
    proc = run_cli(*fsdp, "experiment=gpt_sonnets", "trainer.max_steps=10", "trainer.checkpoint_every=5")
    assert proc.returncode == 0, proc.stderr
    assert metrics_of(proc)["eval/loss"] < 5.0
    assert (proc.run_dir / "checkpoints" / "checkpoint_1" / "model_0" / ".metadata").exists()  # sharded (DCP)
    settings = OmegaConf.load(proc.run_dir / "resolved_config.yaml").model
    vocab_size = read_weights(proc.run_dir / "model")["tok_emb.weight"].shape[0]  # taken from the data
    model = GPT(
        **{key: value for key, value in settings.items() if key != "_target_"} | {"vocab_size": vocab_size}
    )
    load_checkpoint_in_model(model, proc.run_dir / "model")  # full, unsharded weights


def test_deepspeed_zero3_from_a_users_json_trains_resumes_and_saves_fp32_weights(run_cli, tmp_path):
    """ZeRO-3 from the user's DeepSpeed JSON ("auto" filled from the run), bf16, engine checkpoints, a
    resumed rerun, and consolidated fp32 weights that load into a fresh GPT."""
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(
        '{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},'
        ' "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}'
    )
    deepspeed = (
        "hardware=deepspeed",
        "hardware.num_processes=2",
        f"hardware.config={ds_config}",
        "precision=bf16",
    )
    proc = run_cli(*deepspeed, "experiment=gpt_sonnets", "trainer.max_steps=10", "trainer.checkpoint_every=5")
    assert proc.returncode == 0, proc.stderr
    assert metrics_of(proc)["eval/loss"] < 5.0
    engine_state = proc.run_dir / "checkpoints" / "checkpoint_1" / "deepspeed" / "state"
    assert len(list(engine_state.glob("*optim_states.pt"))) == 2  # one partition per rank
    proc = run_cli(*deepspeed, "experiment=gpt_sonnets", "trainer.max_steps=12")
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stderr and "at step 10" in proc.stderr
    settings = OmegaConf.load(proc.run_dir / "resolved_config.yaml").model
    weights = read_weights(proc.run_dir / "model")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}  # the fp32 master weights
    model = GPT(
        **{key: value for key, value in settings.items() if key != "_target_"}
        | {"vocab_size": weights["tok_emb.weight"].shape[0]}
    )
    load_checkpoint_in_model(model, proc.run_dir / "model")


class SweepRecorder(LocalLauncher):
    """A launcher that queues a sweep's jobs nowhere: it records the sweep it is handed."""

    swept: list[Sweep] = []

    @classmethod
    def launch_sweep(cls, sweep: Sweep) -> list:
        cls.swept.append(sweep)
        return [
            f"job {number}: {' '.join(overrides)}" for number, overrides in enumerate(sweep.job_overrides)
        ]


def test_runners_hydra_launcher_hands_a_sweep_to_the_launch_sweep_of_its_launcher():
    """No launcher is named in the plugin: any `Launcher` subclass that overrides `launch_sweep` gets the
    sweep (SLURM's arrays are one; the default runs the jobs one after another, as below)."""
    plugin = RunnerLauncher()
    config = OmegaConf.create({"launcher": {"_target_": f"{__name__}.SweepRecorder"}})
    context = object()
    plugin.setup(hydra_context=context, task_function=print, config=config)  # type: ignore[arg-type]
    assert plugin.launch([["seed=1"], ["seed=2"]], 3) == ["job 0: seed=1", "job 1: seed=2"]
    (sweep,) = SweepRecorder.swept
    assert sweep.config is config and sweep.hydra_context is context and sweep.initial_job_idx == 3


def test_multirun_gives_each_job_its_own_rank_group_and_dir(run_cli, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(
        *TWO_RANKS, "optimizer.lr=1e-3,1e-2", "trainer.max_steps=10", f"hydra.sweep.dir={sweep}", "-m"
    )
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(
        p.name for p in sweep.iterdir() if p.is_dir() and p.name != "tracking"
    )  # the sweep's parent run
    assert jobs == ["0", "1"]
    for job, lr in zip(jobs, ("0.001", "0.01"), strict=True):
        assert f"lr: {lr}" in (sweep / job / "resolved_config.yaml").read_text()
        assert (sweep / job / "runner.log").read_text().count("starting 2 ranks") == 1
    assert proc.stderr.count("final metrics") == 2


def test_a_rank_that_raises_fails_the_job_with_its_traceback(run_cli, tmp_path):
    started = time.monotonic()
    proc = run_cli(*TWO_RANKS, "task._target_=faulty_tasks.RaiseOnRank1", pythonpath=TESTS)
    assert time.monotonic() - started < 30
    assert proc.returncode == 1
    assert "Training failed: rank 1 raised" in proc.stderr
    # the exception, the step, and the frames of the user's code that raised it; not runner's above them
    message = proc.stderr[proc.stderr.index("Training failed") :]
    assert "RuntimeError: injected failure on rank 1\n(at optimizer step 3 of" in message
    assert 'faulty_tasks.py", line' in message and "in training_step" in message
    assert "runner/train.py" not in message and "Traceback" not in message
    assert "runner/train.py" in (proc.run_dir / "runner.log").read_text()  # the whole traceback, in the log


def test_restarts_is_one_setting_of_every_launcher_that_takes_its_former_names():
    """launcher.restarts is declared once (`Launcher`) for every launcher; max_restarts (local, SLURM) and
    max_failures (Ray) are its former names: either sets it, two that disagree are refused naming both, and
    each has the range of restarts. (Each launcher's own restart is tested with its launcher.)"""
    for option, schema in schemas()["launcher"].items():
        fields = {f.name: f.default for f in dataclasses.fields(schema)}
        assert (fields["restarts"], fields["max_restarts"], fields["max_failures"]) == (0, None, None), option
    assert LocalLauncher(restarts=2).restarts == 2
    assert LocalLauncher(max_restarts=2).restarts == LocalLauncher(max_failures=2).restarts == 2
    assert LocalLauncher(restarts=2, max_restarts=2).restarts == 2
    with pytest.raises(ConfigError, match=r"launcher.restarts=1 and launcher.max_restarts=2: these are one setting"):
        LocalLauncher(restarts=1, max_restarts=2)
    with pytest.raises(ConfigError, match=r"launcher.max_restarts=3 and launcher.max_failures=1"):
        LocalLauncher(max_restarts=3, max_failures=1)
    with pytest.raises(ConfigError, match=r"launcher.max_failures=-1: must be >= 0"):
        LocalLauncher(max_failures=-1)


def test_restarts_are_not_spent_on_a_failure_that_a_restart_would_repeat(run_cli):
    """launcher.restarts=2 and a run that diverges (a restart would resume and diverge again): the job
    stops once, saying why it was not restarted."""
    proc = run_cli(*TWO_RANKS, "optimizer.lr=1e3", "trainer.log_every=1", "launcher.restarts=2")
    assert proc.returncode == 1
    assert "Training stopped: train/loss=" in proc.stderr and "training diverged" in proc.stderr
    assert "restart 1 of 2" not in proc.stderr and proc.stderr.count("resumed from") == 0
    assert "not restarted: a rank stopped with TrainingStopped, which a restart would repeat" in proc.stderr


def test_a_rank_killed_by_sigkill_fails_the_job_fast(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    command = [
        sys.executable, "-m", "runner", f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress_bar=false", "trainer.plots=false",
        *TWO_RANKS, "trainer.max_steps=1000000", "task._target_=faulty_tasks.RecordPid", f"+task.pid_dir={pids}",
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=cli_env(TESTS), stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(list(pids.glob("rank*"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        victim = int((pids / "rank1").read_text())
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        # Not the collectives' 30-minute timeout: the survivors error out on the dead peer, or at the latest
        # the launcher kills them after launcher.shutdown_timeout_s (30 s).
        _, stderr = proc.communicate(timeout=45)
        assert time.monotonic() - killed < 45
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert f"rank 1 (pid {victim}) was killed by SIGKILL" in stderr


def test_collective_timeout_and_the_shutdown_grace_are_configurable(run_cli):
    started = time.monotonic()
    hang = "task._target_=faulty_tasks.HangOnRank1"
    proc = run_cli(
        *TWO_RANKS, "hardware.timeout_s=3", "launcher.shutdown_timeout_s=2", hang, pythonpath=TESTS
    )
    # Rank 0's collective times out after 3 s (gloo's own words name it); the hung rank 1 takes the
    # launcher's SIGTERM as a stop request and is killed 2 s later (with the grace ignored, torch's 30 s:
    # 37-40 s in all).
    assert time.monotonic() - started < 25
    assert proc.returncode == 1
    assert "Training failed: rank 0 raised" in proc.stderr
    assert re.search(r"RuntimeError: \S+ Timed out waiting 3000ms for recv", proc.stderr), proc.stderr


def test_a_rank_that_hangs_is_ended_by_its_watchdog_naming_it_with_every_stack(run_cli):
    """No collective timeout helps here (gloo's is 30 minutes): rank 1 sleeps in its third step, rank 0
    waits for it inside torch. With trainer.hang_timeout_s=3 the job ends in seconds, naming rank 1, the
    step and the line of its own code it is stuck at, in one paragraph; each rank's stacks are in hang/."""
    started = time.monotonic()
    hang = "task._target_=faulty_tasks.HangOnRank1"
    # Both watchdogs fire 3 s after step 2 and each rank exits 1 s after its report, inside the 3 s the
    # launcher gives the ranks to exit on their own (half of launcher.shutdown_timeout_s): both report.
    proc = run_cli(
        *TWO_RANKS, "trainer.hang_timeout_s=3", "launcher.shutdown_timeout_s=6", hang, pythonpath=TESTS
    )
    assert time.monotonic() - started < 40
    assert proc.returncode == 1
    assert re.search(
        r"^Training failed: rank 1 on \S+ made no progress for \d+ s \(trainer.hang_timeout_s: 3 s\) in step 3;"
        r" its main thread is at \S+faulty_tasks.py:\d+ in training_step\. Every thread's stack: \S+rank1.txt\."
        r" Rank 0 made no progress either \(in step 3, at \S+ in backward\)\. The other ranks were stopped\.$",
        proc.stderr, re.M,
    ), proc.stderr  # fmt: skip
    assert proc.stderr.count("made no progress for") == 1, proc.stderr  # the ranks' reports are in the log
    assert proc.stderr.count("Training hung: ") == 0 and "[rank 1] Training hung: rank 1" in (proc.run_dir / "runner.log").read_text()
    stacks = (proc.run_dir / "hang" / "rank1.txt").read_text()
    assert re.search(r'faulty_tasks.py", line \d+ in training_step', stacks)
    assert re.search(r'precision.py", line \d+ in backward', (proc.run_dir / "hang" / "rank0.txt").read_text())


def test_a_rank_that_skips_a_collective_ends_the_job_naming_where_each_rank_waits(run_cli):
    """Rank 0 enters a barrier that rank 1 skips (it goes on to its gradient all-reduce): both wait inside
    torch, in different collectives. Their watchdogs end the job in seconds, the message says where each
    rank waits and that they wait in different collectives."""
    started = time.monotonic()
    skip = "task._target_=faulty_tasks.SkipCollectiveOnRank1"
    # Both watchdogs fire 3 s after step 2, and each rank exits 1 s after its report: the second reports
    # before the first's exit breaks its collective (a watchdog that fired at its next poll, up to 0.5 s
    # late, lost that race on a loaded CI), inside the 3 s that the launcher gives the ranks to exit on
    # their own (half of launcher.shutdown_timeout_s).
    proc = run_cli(
        *TWO_RANKS, "trainer.hang_timeout_s=3", "launcher.shutdown_timeout_s=6", skip, pythonpath=TESTS
    )
    assert time.monotonic() - started < 40
    assert proc.returncode == 1
    assert re.search(
        r"rank 0 on \S+ made no progress for \d+ s \(trainer.hang_timeout_s: 3 s\) in step 3;", proc.stderr
    )
    assert re.search(
        r"its main thread is at \S+faulty_tasks.py:\d+ in training_step \(waiting inside torch", proc.stderr
    )
    assert re.search(r"Rank 1 made no progress either \(in step 3, at \S+ in backward\)\.", proc.stderr)
    assert "they are in different collectives (a rank skipped a collective" in proc.stderr
    assert {p.name for p in (proc.run_dir / "hang").iterdir()} == {"rank0.txt", "rank1.txt"}


def test_a_rank_that_hangs_with_a_restart_allowed_resumes_and_finishes(run_cli):
    """launcher.max_restarts=1 (the former name of launcher.restarts): rank 1 hangs in the first attempt's
    third step; its watchdog ends it, the rank group restarts from the checkpoint of step 2 and finishes;
    the ledger counts the restart."""
    hang = "task._target_=faulty_tasks.HangOnRank1Once"
    proc = run_cli(
        *TWO_RANKS,
        "trainer.max_steps=20",
        "trainer.checkpoint_every=2",
        "trainer.hang_timeout_s=3",
        "launcher.shutdown_timeout_s=2",
        "launcher.max_restarts=1",
        hang,
        pythonpath=TESTS,
    )
    assert proc.returncode == 0, proc.stderr
    assert "launcher.max_restarts is called launcher.restarts now" in proc.stderr
    assert re.search(
        r"rank 1 made no progress \(in step 3, at \S+faulty_tasks.py:\d+ in training_step\): restart 1 of 1",
        proc.stderr,
    )
    assert (proc.run_dir / "hang" / "attempt0-rank1.txt").is_file()  # the first attempt's stacks, kept
    assert "at step 2 (epoch 0, batch 2)" in proc.stderr
    spent = json.loads((proc.run_dir / "goodput.json").read_text())
    assert (spent["attempts"], spent["restarts"]) == (2, 1)


def test_under_torchrun_ranks_train_without_spawning_and_share_one_dir(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "runner",
    ]
    proc = subprocess.run(
        [*command, "hardware=ddp", "trainer.max_steps=20", "trainer.progress_bar=false"],
        env=cli_env() | {"TMPDIR": str(scratch)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    runs = list((tmp_path / "outputs" / "runs").iterdir())
    assert len(runs) == 1  # rank 1 wrote no dir of its own
    log = (runs[0] / "runner.log").read_text()
    assert "2 process(es)" in log and "already rank 0 of 2" in log and "starting 2 ranks" not in log
    assert (runs[0] / "resolved_config.yaml").exists()
    assert not [p for p in scratch.iterdir() if p.name.startswith("runner-rank")]  # the scratch dir is gone


@pytest.mark.parametrize(
    ("hardware", "processes", "plan"), [("cpu", 1, False), ("multi_gpu", 2, False), ("multi_gpu", 2, True)]
)
def test_the_launching_process_builds_the_hardware_and_the_model_once(tmp_path, hardware, processes, plan):
    """Validation, the launcher, the checkpoint check and a rank running in the launching process share
    one strategy object; each started rank builds its own. The model is built once on the meta device by
    the checks (which `plan=true` reuses), then once for real by each rank, and by nothing else (the FLOP
    count of perf/mfu included). The data is read once per process: a rank running in the launching
    process trains on what the checks read."""
    builds, models, data = tmp_path / "builds", tmp_path / "models", tmp_path / "data"
    overrides = [
        f"hardware={hardware}",
        f"hardware._target_=probes.Counted{'DDP' if processes > 1 else 'SingleDevice'}",
        *([f"hardware.num_processes={processes}"] if processes > 1 else []),
        "model._target_=probes.CountedMLP",
        "data._target_=probes.CountedRegressionData",
        "trainer.max_steps=3",
        "tracker=none",
        f"plan={str(plan).lower()}",
    ]
    proc = subprocess.run(
        runner_command(tmp_path / "run", *overrides),
        env=cli_env(TESTS) | {"PROBE_BUILDS": str(builds), "PROBE_MODELS": str(models), "PROBE_DATA": str(data)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    pids = builds.read_text().split()
    ranks = 0 if plan else processes
    assert len(pids) == len(set(pids)) == 1 + ranks - (ranks == 1)  # once per process
    launching = pids[0]
    built = [line.split(":") for line in models.read_text().split()]
    assert built[0] == [launching, "meta"]  # the checks' model
    real = [pid for pid, device in built[1:] if device == "cpu"]
    assert len(built) == 1 + ranks and len(real) == ranks  # then one real model per rank
    assert set(real) == ({launching} if ranks == 1 else set(pids[1:]))
    reads = data.read_text().split()
    assert len(reads) == len(set(reads)) == len(pids) and reads[0] == launching  # once per process
