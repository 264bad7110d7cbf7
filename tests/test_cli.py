"""`python -m runner` end to end, in fresh processes (slow: each starts Python, torch and Hydra)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import probes
import pytest
import rank_checks
import references
import torch
from conftest import cli_env, metrics_of, run_to_end, runner_command
from omegaconf import OmegaConf
from safetensors.torch import load_file

from runner.plan import checkpoint_periods, loss_per_failure
from runner.telemetry.history import read_history

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent


def in_a_terminal(command: list[str], cwd: Path) -> tuple[int, str]:
    """Run `command` with its stderr on a pseudo-terminal (as in an interactive shell): its exit code and
    what it wrote there."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    reader, writer = pty.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 24 rows of 120 columns
    proc = subprocess.Popen(command, cwd=cwd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=writer)
    os.close(writer)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                chunk = os.read(reader, 65536)
            except OSError:  # the terminal closed with the process
                return
            if not chunk:
                return
            chunks.append(chunk)

    thread = threading.Thread(target=read)
    thread.start()
    code = proc.wait(timeout=300)
    thread.join(timeout=30)
    os.close(reader)
    return code, b"".join(chunks).decode(errors="replace")


def test_default_experiment_trains_and_leaves_config_and_log(run_cli, tmp_path):
    proc = run_cli("trainer.progress_bar=true")
    assert proc.returncode == 0, proc.stderr
    metrics = metrics_of(proc)
    assert metrics["eval/loss"] < 0.2 and metrics["train/loss"] < 0.2  # the target variance is ~0.4
    assert "train:" not in proc.stderr  # piped: no progress bar
    # A quiet console (trainer.console's default): on a CPU one memory figure, the goodput's headline.
    assert "perf/peak_host_memory_gb=" in proc.stderr and "perf/peak_memory_gb" not in proc.stderr
    assert "s (each phase: trainer.console=full)\n" in proc.stderr and "  startup " not in proc.stderr
    code, terminal = in_a_terminal(
        runner_command(tmp_path / "tty", "trainer.progress_bar=true", "tracker=none", "trainer.console=full"),
        tmp_path,
    )
    assert code == 0 and "train: 100%" in terminal  # on a terminal the progress bar ran
    assert "perf/peak_memory_gb=" in terminal and "  startup " in terminal  # trainer.console=full: all of it
    files = {p.name for p in proc.run_dir.iterdir()}
    assert {"resolved_config.yaml", "runner.log", ".hydra", "history.jsonl"} <= files
    assert "plots" not in files  # trainer.plots=false (the tests' default): none drawn
    log = (proc.run_dir / "runner.log").read_text()
    assert "step 200/200" in log and "final metrics" in log
    assert "${" not in (proc.run_dir / "resolved_config.yaml").read_text()
    history = read_history(proc.run_dir)
    losses = [row["train/loss"] for row in history if "train/loss" in row]
    assert len(losses) == 20  # logged every 10 of its 200 steps
    references.curve("default-experiment", losses + [row["eval/loss"] for row in history if "eval/loss" in row], 1e-5)


@pytest.mark.parametrize(
    ("experiment", "metric", "bound"),
    [("mlp_digits", "eval/accuracy", 0.5), ("gpt_sonnets", "eval/loss", 4.0)],
)
def test_experiments_run_a_few_steps(run_cli, experiment, metric, bound):
    proc = run_cli(f"experiment={experiment}", "trainer.max_steps=20", "trainer.eval_every=0")
    assert proc.returncode == 0, proc.stderr
    value = metrics_of(proc)[metric]
    assert value > bound if metric == "eval/accuracy" else value < bound


def probed(record: Path) -> list[str]:
    """Overrides that train the default experiment through the recording task and optimizer of
    tests/probes.py (run with `pythonpath=TESTS`)."""
    return [
        "task._target_=probes.RecordingRegression",
        f"+task.record={record}",
        "optimizer._target_=probes.NormRecordingAdamW",
        f"+optimizer.record={record}",
        "trainer.max_steps=30",
        "trainer.eval_every=0",
        "tracker=none",
    ]


@pytest.fixture(scope="module")
def unclipped_norms(tmp_path_factory) -> list[float]:
    """The gradient norms of a plain fp32 run: they must exceed the clipping threshold below, else the
    clipping test could not tell clipping from none."""
    run_dir = tmp_path_factory.mktemp("fp32")
    proc = subprocess.run(
        runner_command(run_dir / "run", *probed(run_dir / "probe")),
        env=cli_env(TESTS),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(probes.read(run_dir / "probe", "task")) == {"float32"}
    return [float(norm) for norm in probes.read(run_dir / "probe", "optimizer")]


CLIP = 0.05


@pytest.mark.parametrize(
    ("overrides", "dtype", "micro_batches_per_step", "max_norm"),
    [
        (["precision=bf16"], "bfloat16", 1, None),
        (["precision=fp16"], "float16", 1, None),
        (["trainer.gradient_accumulation_steps=4"], "float32", 4, None),
        ([f"trainer.max_grad_norm={CLIP}"], "float32", 1, CLIP),
        (
            ["precision=fp16", "trainer.gradient_accumulation_steps=4", f"trainer.max_grad_norm={CLIP}"],
            "float16",
            4,
            CLIP,
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_precision_accumulation_and_clipping_reach_the_training_step(
    run_cli, tmp_path, unclipped_norms, overrides, dtype, micro_batches_per_step, max_norm
):
    """Each option is seen where it acts: the dtype the model computes in, the micro-batches consumed per
    optimizer step, the norm of the gradients the optimizer applies."""
    proc = run_cli(*probed(tmp_path / "probe"), *overrides, pythonpath=TESTS)
    assert proc.returncode == 0, proc.stderr
    micro_batches, norms = (
        probes.read(tmp_path / "probe", "task"),
        probes.read(tmp_path / "probe", "optimizer"),
    )
    assert set(micro_batches) == {dtype}
    # 58 batches an epoch: with 4 per step, each epoch's last step takes the 2 left (as Accelerate syncs at
    # the end of the dataloader), so 30 steps are 2 epochs, 116 micro-batches.
    assert len(micro_batches) == {1: 30, 4: 116}[micro_batches_per_step]
    assert 0 < len(norms) <= 30  # fp16 may skip a step whose gradients overflowed
    if max_norm is None:
        assert max(unclipped_norms) > CLIP  # (so that the clipping cases below do bind)
    else:
        assert max(float(norm) for norm in norms) <= max_norm * (1 + 1e-4)
    assert metrics_of(proc)["eval/loss"] < 1.0


def test_epochs_sgd_and_a_constant_schedule_reach_the_loop(run_cli, tmp_path):
    proc = run_cli(
        *probed(tmp_path / "probe"),
        "trainer.max_steps=null",
        "trainer.max_epochs=1",
        "optimizer=sgd",
        "optimizer._target_=probes.NormRecordingSGD",  # SGD's settings (momentum) reach an SGD
        "optimizer.lr=0.02",
        "scheduler=constant",
        pythonpath=TESTS,
    )
    assert proc.returncode == 0, proc.stderr
    batches = math.ceil(4096 * 0.9 / 64)  # one epoch of the training split
    assert len(probes.read(tmp_path / "probe", "task")) == batches
    assert f"for {batches} steps" in proc.stderr
    assert len(probes.read(tmp_path / "probe", "optimizer")) == batches
    assert "lr: 0.02\n  momentum: 0.9" in (proc.run_dir / "resolved_config.yaml").read_text()
    assert metrics_of(proc)["train/lr"] == pytest.approx(0.02)  # still the base rate at the end: constant
    assert metrics_of(proc)["eval/loss"] < 1.0


def test_the_schedules_step_counts_are_optimizer_steps_on_any_number_of_processes(tmp_path):
    """scheduler.warmup_steps=3, decay_steps=8, min_lr: the logged rate peaks at step 3 and is min_lr
    from step 8 on, the same curve on 1 process and on 2 (whose scheduler steps twice an update)."""
    curves = {}
    for ranks, hardware in ((1, []), (2, ["hardware=ddp", "hardware.num_processes=2"])):
        run_dir = tmp_path / str(ranks)
        run_to_end(
            run_dir, *hardware, "scheduler=cosine", "scheduler.warmup_steps=3", "scheduler.decay_steps=8",
            "scheduler.min_lr=0.001", "optimizer.lr=0.01", "trainer.max_steps=10", "trainer.log_every=1",
            "trainer.eval_every=0", "trainer.save_model=false",
        )  # fmt: skip
        curves[ranks] = [row["train/lr"] for row in read_history(run_dir) if "train/lr" in row]
    assert curves[1] == pytest.approx(curves[2]) and len(curves[1]) == 10
    assert max(curves[1]) == pytest.approx(0.01) and curves[1].index(max(curves[1])) in (2, 3)
    assert curves[1][-3:] == pytest.approx([0.001] * 3)


@pytest.mark.parametrize("hardware", ["deepspeed", "fsdp", "multi_gpu"])
def test_a_parallel_backend_in_one_process_trains_like_the_cpu_group(run_cli, hardware):
    """num_processes=1 trains in this process, in a process group of one (DeepSpeed included, whose engine
    wants LOCAL_RANK although no launcher set it)."""
    steps = ("trainer.max_steps=20", "trainer.eval_every=0", "tracker=none")
    reference = run_cli(*steps)
    proc = run_cli(*steps, f"hardware={hardware}", "hardware.num_processes=1")
    assert proc.returncode == 0, proc.stderr
    assert "starting" not in proc.stderr  # no rank was launched
    assert metrics_of(proc) == pytest.approx(metrics_of(reference), rel=1e-5)


def test_how_often_a_run_evaluates_does_not_change_its_training(run_cli):
    """The eval loader draws its seed from torch's global RNG (as Accelerate leaves it), which the dropout
    masks come from too: the Trainer keeps evaluation's draws out of training's."""
    steps = ("experiment=gpt_sonnets", "model.dropout=0.2", "trainer.max_steps=6", "trainer.log_every=2")
    weights = []
    for every in (0, 2):
        proc = run_cli(*steps, f"trainer.eval_every={every}", "tracker=none")
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.count("eval/loss=") == (1 if every == 0 else 3)  # at the end; every 2 steps
        weights.append((proc.run_dir / "model" / "model.safetensors").read_bytes())  # the next run moves it
    assert weights[0] == weights[1]


def test_random_tokens_feed_a_gpt_of_their_vocabulary(run_cli):
    proc = run_cli(
        "experiment=gpt_sonnets",
        "data=random_tokens",
        "data.vocab_size=50",
        "data.seq_len=16",
        "data.num_samples=64",
        "trainer.max_steps=5",
        "tracker=none",
    )
    assert proc.returncode == 0, proc.stderr
    assert "vocab_size: 50" in (proc.run_dir / "resolved_config.yaml").read_text()
    assert abs(metrics_of(proc)["eval/loss"] - math.log(50)) < 0.2  # nothing to learn: ln(vocabulary)


def test_user_csv_jsonl_and_text_files(run_cli, tmp_path):
    rows = [{"a": i % 7, "b": (i * 3) % 5, "label": "odd" if i % 2 else "even"} for i in range(120)]
    (tmp_path / "rows.csv").write_text(
        "a,b,label\n" + "".join(f"{r['a']},{r['b']},{r['label']}\n" for r in rows)
    )
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "notes.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    for path in ("rows.csv", "rows.jsonl"):
        proc = run_cli(
            "data=table",
            f"data.path={path}",
            "data.target=label",
            "task=classification",
            "trainer.max_steps=5",
        )
        assert proc.returncode == 0, proc.stderr
        assert 0.0 <= metrics_of(proc)["eval/accuracy"] <= 1.0
    proc = run_cli(
        "experiment=gpt_sonnets",
        "data=text",
        "data.path=notes.txt",
        "trainer.max_steps=5",
        "trainer.eval_every=0",
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [  # one of each way the command refuses; every refusal's message: tests/test_config.py
        (
            ["trainer.max_step=5"],  # composing
            "trainer.max_step: there is no key 'max_step' in 'trainer'. Did you mean trainer.max_steps?",
        ),
        (["data=table", "data.path=missing.csv", "data.target=y"], "data.path='missing.csv': no such file"),
        (["optimizer.lr=-1"], "optimizer.lr=-1: must be > 0."),  # a declared range
        (["optimizer.betas=[0.9]"], "optimizer: torch.optim.AdamW refuses its settings (IndexError: list index out of range)"),
        (
            [
                "hardware=ddp",
                "hardware.num_processes=2",
                "trainer.split_batches=true",
                "data.batch_size=33",
            ],
            "data.batch_size=33 is the global batch and must split evenly over the 2 processes",
        ),  # with the world the launcher will start
        (["hardware=deepspeed", "hardware.config=missing.json"], "not a readable DeepSpeed JSON file"),
    ],
)
def test_bad_input_gives_one_paragraph_and_no_traceback(forked_cli, overrides, expected):
    proc = forked_cli(*overrides)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    message = proc.stderr.strip()
    assert message.startswith("Configuration error: ") and expected in message
    assert "\n" not in message  # one paragraph
    written = sorted(p.name for p in proc.run_dir.iterdir()) if proc.run_dir.exists() else []
    assert written in ([], ["runner.log"])  # nothing but the log (composition errors: not even that)
    assert "step " not in message and "starting" not in message  # nothing trained, no rank started


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.max_step=5"], "Did you mean trainer.max_steps?"),
        (["hardware=ddp", "hardware.num_processes=two"], "hardware.num_processes: Value 'two'"),
        (["hardware=fdsp"], "hardware=fdsp: there is no option 'fdsp' in the config group 'hardware'"),
        (["data=tokens", "data.path=missing"], "data.path='missing': no token shards there (no such directory"),
        (["data=table", "data.path=gone.csv", "data.target=y"], "data.path='gone.csv': no such file"),
        (["data=image_folder", "data.path=images"], "data.path='images': no such folder"),
        (["data=hf", "data.path=.", "data.tokenizer=gpt2"], "data.tokenizer='gpt2': not a tokenizer directory"),
    ],
)
def test_a_config_that_does_not_compose_is_refused_before_torch_loads(tmp_path, overrides, expected):
    """`python -m runner` composes before it imports torch: a misspelt key, a wrong type, an unknown
    option or a data file that is not there is refused without waiting for torch (`-X importtime` lists
    every module imported)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "runner", *overrides],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "runner.compose" in imported and "torch" not in imported
    assert "Configuration error: " in proc.stderr and expected in proc.stderr
    assert not (tmp_path / "outputs").exists()  # no run dir claimed


def test_deepspeed_without_its_extra_names_the_pip_install(run_cli, tmp_path):
    hidden = tmp_path / "no_deepspeed"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None  # not installed\n")
    proc = run_cli("hardware=deepspeed", pythonpath=hidden)
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip()
    assert message.startswith(
        "Configuration error: hardware=deepspeed needs DeepSpeed, which is not installed"
    )
    assert "pip install --no-build-isolation" in message and "\n" not in message


def test_plan_prints_what_the_run_would_do_and_starts_nothing(run_cli):
    proc = run_cli(
        "plan=true",
        "tracker=mlflow",
        "hardware=deepspeed",
        "hardware.zero_stage=3",
        "hardware.num_processes=2",
        "precision=bf16",
    )
    assert proc.returncode == 0, proc.stderr
    header, *lines = proc.stdout.strip().splitlines()
    assert header == "plan (nothing was started):"
    plan = dict(line.split(maxsplit=1) for line in lines)
    assert plan["launcher"] == "LocalLauncher: 1 node x 2 process(es), started with fork"
    assert plan["devices"].startswith("2 x cpu")
    assert (
        plan["hardware"].startswith("runner.hardware.deepspeed.DeepSpeed")
        and "'zero_stage': 3" in plan["hardware"]
    )
    assert plan["precision"] == "bf16"
    assert (
        plan["batch"]
        == "64 per device x 2 device(s) x 1 accumulation step(s) = 128 samples per optimizer step"
    )
    assert plan["steps"].startswith("200 optimizer steps") and "resume from nothing" in plan["checkpoints"]
    assert plan["failure"].startswith("every step since the start is trained again (no periodic checkpoint")
    assert plan["tracker"].startswith("mlflow -> ")
    assert plan["model"] == "runner.models.MLP, 202K parameters"
    assert plan["perf/mfu"] == "not reported: no peak FLOP/s is known for cpu; set hardware.peak_flops"
    assert (
        "optimizer 0.8 MB (sharded)" in plan["memory/device"]
    )  # AdamW's 2 fp32 states, 0.2M params, 2 ranks
    assert "starting" not in proc.stderr and "step " not in proc.stderr
    assert not (proc.run_dir / "resolved_config.yaml").exists() and not (proc.run_dir / "tracking").exists()


def test_every_problem_is_reported_at_once(forked_cli):
    proc = forked_cli(
        "trainer.gradient_accumulation_steps=0", "trainer.max_grad_norm=-1", "model._target_=nope.Model"
    )
    assert proc.returncode == 2
    paragraphs = proc.stderr.removeprefix("Configuration error: ").strip().split("\n\n")
    assert len(paragraphs) == 3, proc.stderr
    assert paragraphs[0].startswith("model._target_='nope.Model' cannot be imported")
    assert "trainer.gradient_accumulation_steps=0: must be >= 1" in paragraphs[1]
    assert "trainer.max_grad_norm=-1.0: must be > 0" in paragraphs[2]
    # The launcher's checks and those that build the data, the model and the optimizer: together too.
    proc = forked_cli("hardware=ddp", "hardware.num_processes=4096", "optimizer.lr=-1")
    assert proc.returncode == 2
    paragraphs = proc.stderr.removeprefix("Configuration error: ").strip().split("\n\n")
    assert paragraphs[0] == "optimizer.lr=-1: must be > 0.", paragraphs
    assert "CPU core(s) for 4096 CPU ranks" in paragraphs[1]
    assert len(paragraphs) == 2  # the data, model and optimizer are not built with a setting known wrong


def test_plan_states_what_a_failure_costs_from_the_checkpoint_periods():
    trainer = OmegaConf.create({"checkpoint_every": 50, "checkpoint_every_s": 600.0, "log_every": 10})
    assert checkpoint_periods(trainer) == ["every 50 steps", "every 600 s (at a logging step)"]
    assert loss_per_failure(trainer) == (
        "up to 50 steps (25 on average) or up to 600 s of steps and 10 more (300 s on average) trained again, "
        "whichever is less, plus the restart"
    )


def test_plan_estimates_activations_from_a_step_on_meta_tensors(forked_cli):
    sizes = []
    for batch in (16, 32):
        proc = forked_cli("plan=true", "experiment=gpt_sonnets", f"data.batch_size={batch}")
        assert proc.returncode == 0, proc.stderr
        line = next(line for line in proc.stdout.splitlines() if line.strip().startswith("activations"))
        sizes.append(float(line.split("about ")[1].split(" MB")[0]))
    assert sizes[0] > 1 and sizes[1] == pytest.approx(2 * sizes[0], rel=0.02)  # linear in the batch


def test_plan_still_refuses_bad_input(forked_cli):
    proc = forked_cli("plan=true", "hardware=ddp", "hardware.num_processes=0")
    assert proc.returncode == 2 and "hardware.num_processes=0: must be >= 1" in proc.stderr


@pytest.mark.parametrize(("momentum", "optimizer_mb"), [(0.9, "0.8"), (0.0, "0.0")])
def test_plan_counts_sgd_momentum_buffers(forked_cli, momentum, optimizer_mb):
    proc = forked_cli("plan=true", "optimizer=sgd", f"optimizer.momentum={momentum}")
    assert proc.returncode == 0, proc.stderr
    assert f"optimizer {optimizer_mb} MB;" in proc.stdout  # 0.2M fp32 parameters, one process


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_loss_that_becomes_nan_stops_the_run_naming_step_lr_and_precision(run_cli, ranks):
    more = ["hardware=ddp", "hardware.num_processes=2"] if ranks == 2 else []
    proc = run_cli("optimizer.lr=1e8", "trainer.log_every=5", "trainer.checkpoint_every=5", *more)
    assert proc.returncode == 1, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("Training stopped: train/loss=nan at step "), message
    assert "learning rate" in message and "precision fp32" in message and "Lower optimizer.lr" in message
    assert "Traceback" not in proc.stderr
    assert not (proc.run_dir / "metrics.json").exists()  # no final metrics: the run failed
    step = int(message.split(" at step ")[1].split()[0])
    latest = (proc.run_dir / "checkpoints" / "latest").read_text().strip() if step > 5 else None
    assert (f"checkpoints/{latest}" in message) if latest else "It wrote no checkpoint." in message


def test_a_diverged_run_keeps_its_last_finite_state_and_resumes_from_it_with_a_lower_lr(run_cli, tmp_path):
    diverging = ("optimizer.lr=1e3", "trainer.log_every=1")
    proc = run_cli(*diverging, "trainer.checkpoint_last_finite=true")
    assert proc.returncode == 1, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    step = int(message.split(" at step ")[1].split()[0])
    last_finite = proc.run_dir / "checkpoints" / "last_finite"
    assert f"trainer.resume={last_finite}" in message and "Traceback" not in proc.stderr
    saved = torch.load(last_finite / "custom_checkpoint_0.pt", weights_only=False)["step"]
    assert saved == step - 2  # its weights gave the finite loss of step - 1; those of step - 1 gave inf
    weights = load_file(last_finite / "model_0.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    assert not list((proc.run_dir / "checkpoints").glob("checkpoint_*"))  # none of the numbered ones

    resumed = run_cli("optimizer.lr=1e-3", "trainer.max_steps=20", f"trainer.resume={last_finite}")
    assert resumed.returncode == 0, resumed.stderr  # the lower rate of the config, not the checkpoint's
    log = (resumed.run_dir / "runner.log").read_text()
    assert f"resumed from {last_finite} at step {saved}" in log
    assert "learning rate from the config: [0.001] (the checkpoint had [1000.0])" in log
    assert all(math.isfinite(value) for value in metrics_of(resumed).values())

    plain = run_cli(*diverging, f"hydra.run.dir={tmp_path / 'plain'}")
    assert "trainer.checkpoint_last_finite=true keeps the state" in plain.stderr


def test_a_broken_data_file_is_refused_before_launch_and_its_traceback_is_in_the_log(forked_cli, tmp_path):
    """The command's side of what tests/test_config.py checks for every broken file: exit 2 and one
    paragraph, with and without plan=true; the user's code's traceback goes to the log only."""
    (tmp_path / "table.csv.gz").write_bytes(b"not gzip at all")
    for plan in ([], ["plan=true"]):  # the plan refuses it the same way
        proc = forked_cli("data=table", "data.path=table.csv.gz", "data.target=y", *plan)
        message = proc.stderr.strip()
        assert proc.returncode == 2, proc.stderr
        assert (
            message.startswith("Configuration error: ")
            and "from data.path=table.csv.gz (BadGzipFile" in message
        )
        assert "Traceback" not in proc.stderr and "starting" not in proc.stderr and "\n" not in message
    log = (tmp_path / "run" / "runner.log").read_text()
    assert "Traceback" in log and "BadGzipFile: Not a gzipped file" in log


def test_a_bad_value_in_a_sweep_list_fails_the_sweep_before_any_job(forked_cli, tmp_path):
    sweep = tmp_path / "sweep"
    overrides = ["optimizer.lr=1e-3,-1,1e-2", "model.hidden_size=8,0", "trainer.max_steps=5"]
    proc = forked_cli(*overrides, f"hydra.sweep.dir={sweep}", "-m")
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip().splitlines()
    assert message[0].startswith("Configuration error: job 1 (") and "model.hidden_size=0:" in message[0], (
        message
    )
    bad = [
        line for line in message if line.startswith("job ") or line.startswith("Configuration error: job ")
    ]
    assert len(bad) == 4  # (lr -1 or hidden 0): jobs 1, 2, 3 and 5 of the 6
    assert message[-1].endswith("No job was run.") and "Traceback" not in proc.stderr
    assert not list(sweep.glob("[0-9]*"))  # no job dir


def test_a_sweep_over_glob_runs_each_option_and_an_interval_points_to_optuna(forked_cli, tmp_path):
    """`optimizer=glob(*)` sweeps every option of the group (the check before the first job lists them as
    the sweeper does); `interval()` is for a sweeper that samples: the grid's refusal says which one, in a
    sentence of its own before "No job was run."."""
    globbed = forked_cli("optimizer=glob(*)", "plan=true", f"hydra.sweep.dir={tmp_path / 'globbed'}", "-m")
    assert globbed.returncode == 0, globbed.stderr
    launched = re.findall(r"#(\d) : .*optimizer=(\w+)", globbed.stdout)
    assert launched == [("0", "adamw"), ("1", "sgd")], globbed.stdout
    interval = forked_cli("optimizer.lr=interval(0.001,0.01)", f"hydra.sweep.dir={tmp_path / 'interval'}", "-m")
    assert interval.returncode == 2, interval.stderr
    message = interval.stderr.strip()
    assert "optimizer.lr=interval(0.001,0.01)" in message and "hydra/sweeper=optuna" in message, message
    assert message.endswith(". No job was run.") and "Traceback" not in interval.stderr


def test_two_of_hydras_modes_at_once_are_one_paragraph(forked_cli):
    """`-m --cfg job` (Hydra raises a bare ValueError): refused naming both, exit 2, no traceback."""
    proc = forked_cli("-m", "--cfg", "job", "optimizer.lr=1e-3,1e-2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("Configuration error: -m and --cfg cannot be given together"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_hydra_job_chdir_is_refused_before_a_run_or_a_sweep_starts(forked_cli, tmp_path):
    """`hydra.job.chdir=true` would make a relative data.path mean another file in the job than in the
    command's check (which refused a file that is there, "taken from the directory you run in"): it is
    refused, in one paragraph, before a run and before a sweep's first job."""
    for sweep in ([], ["trainer.max_steps=5,6", f"hydra.sweep.dir={tmp_path / 'sweep'}", "-m"]):
        proc = forked_cli("hydra.job.chdir=true", *sweep)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("Configuration error: hydra.job.chdir=true: runner runs each job in the"), (
            proc.stderr
        )
        assert "Leave hydra.job.chdir out." in proc.stderr and "Traceback" not in proc.stderr
    assert not list((tmp_path / "sweep").glob("[0-9]*"))  # no job dir


def test_a_users_config_dir_adds_options_and_its_yaml_errors_are_one_paragraph(run_cli, tmp_path):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "small.yaml").write_text("_target_: runner.models.MLP\nhidden_size: 8\n")
    (tmp_path / "conf" / "model" / "broken.yaml").write_text(
        "_target_: runner.models.MLP\nhidden_size: [8, 16\n"
    )
    search = (
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]"  # as --config-dir does, on the command line's end
    )
    ok = run_cli(search, "model=small", "trainer.max_steps=5")
    assert ok.returncode == 0, ok.stderr  # the data's sizes fill in_features and out_features it omits
    assert OmegaConf.load(ok.run_dir / "resolved_config.yaml").model.hidden_size == 8
    # --config-dir after the overrides, as users type it (Hydra's parser wants it before them).
    typed = run_cli("model=small", "--config-dir", str(tmp_path / "conf"), "trainer.max_steps=5")
    assert typed.returncode == 0, typed.stderr
    bad = run_cli(search, "model=broken")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    message = bad.stderr.strip()
    assert message.startswith(f"Configuration error: {tmp_path / 'conf' / 'model' / 'broken.yaml'}, line ")
    assert "not valid YAML" in message and "\n" not in message


def test_a_file_where_a_directory_goes_is_refused_in_one_paragraph(tmp_path):
    """The run dir, a sweep dir (given or time-stamped), a tracker's logging dir or `runner init`'s dir
    being a file."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    year = time.strftime("%Y")  # a time-stamped dir's
    train = ["trainer.max_steps=2", "trainer.progress_bar=false"]
    cases = {
        ("tracker=none", f"hydra.run.dir={blocker}", *train): f"the run's dir cannot be made at {blocker} (File exists)",
        ("tracker=none", f"hydra.run.dir={blocker / 'sub'}", *train): f"cannot be made at {blocker / 'sub'} (Not a directory)",
        ("tracker=none", f"hydra.sweep.dir={blocker}", "-m", "trainer.seed=1,2", *train): f"cannot be made at {blocker}",
        ("tracker=none", f"hydra.run.dir={blocker}/${{now:%Y}}", *train): f"cannot be made at {blocker / year}",
        ("tracker=none", f"hydra.sweep.dir={blocker}/${{now:%Y}}", "-m", "trainer.seed=1,2", *train): (
            f"cannot be made at {blocker / year}"
        ),
        ("tracker=tensorboard", f"tracker.logging_dir={blocker}", *train): f"{blocker} is a file, not a directory",
        ("init", str(blocker / "project")): f"cannot write {blocker / 'project'} (Not a directory)",
    }  # fmt: skip
    for arguments, expected in cases.items():
        proc = rank_checks.command([*rank_checks.RUNNER, *arguments], tmp_path, env=cli_env())
        message = proc.stderr.strip()
        assert proc.returncode == 2, proc.stderr
        assert message.startswith("Configuration error: ") and expected in message, message
        assert "Traceback" not in proc.stderr and "\n" not in message


def test_a_run_piped_to_a_file_says_each_thing_once_in_the_users_words(run_cli):
    """Piped (no terminal): no progress-bar frames, no MFU warning (plan=true says it), one line per
    step and eval, the user's model's name and size, fp32 named as such, under FSDP's wrapper too."""
    proc = run_cli(
        "hardware=fsdp", "hardware.num_processes=2", "model.hidden_size=16", "model.num_layers=1",
        "trainer.max_steps=20", "trainer.log_every=10", "trainer.eval_every=10", "trainer.progress_bar=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    console = proc.stderr
    assert "\r" not in console and "train:" not in console  # tqdm's frames
    assert "perf/mfu" not in console and "no peak FLOP/s" in (proc.run_dir / "runner.log").read_text()
    # one hidden layer of 16 over the regression data's 16 features: 16*16+16 + 16+1 = 289 parameters
    assert "training MLP (289 parameters) for 20 steps on cpu, 2 process(es), precision fp32" in console
    steps = [line.split(":")[0] for line in console.splitlines() if line.startswith("step ")]
    assert steps == ["step 10/20"] * 2 + ["step 20/20"] * 2  # the train line, then the eval line
    eval_lines = [line for line in console.splitlines() if line.startswith("step ") and "eval/loss" in line]
    assert all("train/loss" not in line for line in eval_lines)


def test_mode_evaluate_reports_the_eval_metrics_of_a_runs_weights_on_any_number_of_ranks(run_cli, tmp_path):
    trained = metrics_of(run_to_end(tmp_path / "trained", "trainer.max_steps=20"))
    for ranks in ([], ["hardware=ddp", "hardware.num_processes=2"]):
        run_dir = tmp_path / f"evaluated{len(ranks)}"
        evaluated = run_to_end(run_dir, "mode=evaluate", f"checkpoint={tmp_path / 'trained'}", *ranks)
        assert f"evaluating MLP (202K parameters) from {tmp_path / 'trained'}" in evaluated.stderr
        assert "evaluated: eval/loss=" in evaluated.stderr and "step 0/" not in evaluated.stderr  # no training
        metrics = metrics_of(evaluated)
        assert sorted(metrics) == ["eval/loss", "eval/mae"]  # nothing trained
        assert metrics == pytest.approx({k: trained[k] for k in metrics}, rel=1e-5)
        assert not (run_dir / "model").exists() and not (run_dir / "checkpoints").exists()
    refused = run_cli("mode=evaluate")
    assert refused.returncode == 2 and "mode=evaluate needs checkpoint=<weights>" in refused.stderr
