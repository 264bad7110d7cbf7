"""What each of 2 real ranks (gloo) runs for tests/test_distributed.py; the results are checked there. And
`command`: `python -m runner` forked from the same forkserver, for what the command decides before it starts
anything."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import torch

# Preloaded in the forkserver with this module: each rank's first optimizer would import it (1-2 s a rank).
import torch._dynamo
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.utils.data import DataLoader, IterableDataset

import runner.cli
from runner import Accelerator
from runner.compose import compose_command, end_command
from runner.errors import ConfigError
from runner.hardware import DDP
from runner.task import model_outputs
from runner.trackers import MLflowTracker


def run_ranks(fn, *args: Any, num_processes: int = 2) -> dict[int, Any]:
    """Run `fn(*args)` in `num_processes` real ranks started by torch's elastic launcher.

    The ranks are forked from a forkserver that has imported this module (so torch and runner), never from
    this process: a fork of a process with threads (the launcher's store, earlier launches' gloo groups) can
    copy a lock some thread holds, and a rank then hangs before it joins the group. Each rank sees this
    process's environment as it is now, with the launcher's variables on top."""
    os.environ.setdefault(
        "OMP_NUM_THREADS", "1"
    )  # each rank computes on one thread, as ParallelStrategy's do
    _forkserver()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_processes,
        run_id="test",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp()),
    )
    # A rank that hangs fails its test after LAUNCH_TIMEOUT_S instead of the process group's 30 minutes:
    # SIGTERM makes the launcher stop the ranks and raise.
    watchdog = threading.Timer(LAUNCH_TIMEOUT_S, os.kill, (os.getpid(), signal.SIGTERM))
    watchdog.start()
    try:
        return elastic_launch(config, _in_environment)(_SERVER_ENVIRONMENT, dict(os.environ), fn, *args)
    finally:
        watchdog.cancel()


LAUNCH_TIMEOUT_S = 600
IMPORTED_IN = os.getpid()  # the forkserver's, where a rank forked from it has this module already


def _forkserver() -> multiprocessing.context.ForkServerContext:
    """The forkserver, preloading this module (so torch, torch._dynamo and runner), started by its first use.
    It imports what it preloads with its own sys.path (Python 3.11 hands it the parent's but never sets it),
    so it starts with this module's dir on its PYTHONPATH; without it the preload failed silently and every
    rank imported torch and runner again (2 s a process here)."""
    if not _SERVER_ENVIRONMENT:
        here = os.path.dirname(os.path.abspath(__file__))
        server = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
        }
        multiprocessing.set_forkserver_preload([__name__])
        before = dict(os.environ)
        os.environ.update(server)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(before)
        _SERVER_ENVIRONMENT.update(server)  # what the forkserver inherited
    return multiprocessing.get_context("forkserver")


RUNNER = [sys.executable, "-m", "runner"]


def command(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`argv` (`python -m runner ...`, as `runner_command` makes it) run in `cwd` as a process forked from the
    forkserver, which imported torch and runner once (a fresh interpreter imports them in 3 s here): its exit
    status and output as `subprocess.run` gives them. For what the command decides before it starts anything
    (a refusal, a plan): it composes and runs as `python -m runner` does (`runner.compose.compose_command`,
    then `runner.cli.run`), without its early SIGTERM handler or MLflow sender."""
    assert argv[:3] == RUNNER, argv
    with tempfile.TemporaryDirectory() as outputs:
        out, err = Path(outputs) / "stdout", Path(outputs) / "stderr"
        environment = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        process = _forkserver().Process(
            target=_command, args=(argv[3:], str(cwd), environment, str(out), str(err))
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(argv, process.exitcode, out.read_text(), err.read_text())


def _command(arguments: list[str], cwd: str, environment: dict[str, str], out: str, err: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["runner", *arguments]
    status = 0
    try:
        try:
            composed = compose_command(arguments)
        except ConfigError as err:
            end_command(err)
        runner.cli.run(composed)
    except SystemExit as ended:
        status = ended.code if isinstance(ended.code, int) else int(ended.code is not None)
    except BaseException:  # as the interpreter would: the traceback, status 1
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_SERVER_ENVIRONMENT: dict[str, str] = {}


def _in_environment(server: dict[str, str], environment: dict[str, str], fn, *args: Any) -> Any:
    """In a rank: `environment` with the variables the launcher set for this rank (those that differ from
    the forkserver's environment, `server`) on top, then `fn(*args)`."""
    launcher = {k: v for k, v in os.environ.items() if server.get(k) != v}
    os.environ.clear()
    os.environ.update(environment | launcher)
    return fn(*args)


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def execution_and_collectives(workdir: str) -> dict[str, Any]:
    accelerator = Accelerator(strategy=DDP(device="cpu"))
    rank = accelerator.process_index
    out: dict[str, Any] = {"rank": rank, "num_processes": accelerator.num_processes}
    out["preloaded"] = os.getpid() != IMPORTED_IN  # this module came with the fork, not imported here

    with accelerator.main_process_first():
        entered = time.time()
        if accelerator.is_main_process:
            time.sleep(0.5)  # the others must still be waiting when this ends
        out["main_first"] = (entered, time.time())
    with accelerator.local_main_process_first():
        out["local_main_first"] = (time.time(), time.time())

    # Decorators run on the chosen process only.
    out["on_main"] = accelerator.on_main_process(lambda: rank)()
    out["on_local_main"] = accelerator.on_local_main_process(lambda: rank)()
    out["on_process_1"] = accelerator.on_process(process_index=1)(lambda: rank)()
    out["on_local_process_1"] = accelerator.on_local_process(local_process_idx=1)(lambda: rank)()

    # A trigger set on rank 1 only is seen by both at the next check, then cleared.
    if rank == 1:
        accelerator.set_trigger()
    out["trigger"] = (accelerator.check_trigger(), accelerator.check_trigger())

    # Collectives over nested structures.
    nested = {"a": torch.tensor([rank, rank]), "b": (torch.tensor([[rank * 1.0]]),)}
    out["gather"] = accelerator.gather(nested)
    out["reduce_sum"] = accelerator.reduce(torch.tensor([rank + 1.0]), "sum")
    out["reduce_mean"] = accelerator.reduce({"x": torch.tensor([rank + 1.0])}, "mean")
    ragged = torch.full((rank + 1, 2), rank + 1)
    out["pad"] = accelerator.pad_across_processes(ragged, dim=0, pad_index=-1)
    out["pad_first"] = accelerator.pad_across_processes([ragged], dim=0, pad_first=True)
    out["broadcast"] = accelerator.broadcast({"t": torch.tensor([rank + 10])}, from_process=1)
    out["broadcast_object_list"] = accelerator.broadcast_object_list([f"from {rank}", {"r": rank}])
    out["gather_object"] = accelerator.gather_object([f"hello from {rank}"])
    out["gather_object_scalar"] = accelerator.gather_object(rank)

    # gather_for_metrics drops what even_batches duplicated: 101 samples, 2 ranks, batch 8.
    eval_loader = accelerator.prepare(DataLoader(torch.arange(101), batch_size=8))
    seen = [accelerator.gather_for_metrics(batch) for batch in eval_loader]
    out["eval_len"] = len(eval_loader)
    out["eval_batches"] = len(seen)
    out["eval_gathered"] = torch.cat(seen)
    words = [accelerator.gather_for_metrics([f"s{int(i)}" for i in batch]) for batch in eval_loader]
    out["eval_gathered_objects"] = [w for batch in words for w in batch]

    # A shuffled loader: ranks seeded differently still draw one permutation and split it.
    torch.manual_seed(1000 + rank)
    base_loader = DataLoader(torch.arange(64), batch_size=4, shuffle=True)
    train_loader = accelerator.prepare(base_loader)
    out["epochs"] = []
    for epoch in range(2):
        train_loader.set_epoch(epoch)
        out["epochs"].append(torch.cat(list(train_loader)).tolist())
    out["train_len"] = len(train_loader)
    state = base_loader.sampler.generator.get_state()
    skipped = accelerator.skip_first_batches(train_loader, 3)
    out["skip"] = (len(skipped), [b.tolist() for b in skipped])
    base_loader.sampler.generator.set_state(state)  # the same shuffle again, without skipping
    out["skip_reference"] = [b.tolist() for b in train_loader]
    torch.manual_seed(0)  # reset the RNG, which the epochs above advanced identically on both ranks

    # IterableDataset: contiguous slices of each round, even batches padded from the start.
    stream_loader = accelerator.prepare(DataLoader(Stream(37), batch_size=4))
    out["stream"] = torch.cat([accelerator.gather_for_metrics(b) for b in stream_loader]).tolist()

    accelerator.end_training()
    return out


def split_batches_run() -> dict[str, Any]:
    accelerator = Accelerator(strategy=DDP(device="cpu"), split_batches=True)
    loader = accelerator.prepare(DataLoader(torch.arange(32), batch_size=8))
    batches = [b.tolist() for b in loader]
    accelerator.end_training()
    return {"batches": batches, "len": len(loader)}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def rank_model(accelerator: Accelerator) -> torch.nn.Module:
    """`make_model()` on rank 0 and another initialisation on each other rank: the backend must start
    every rank from rank 0's weights."""
    return make_model(seed=123 + accelerator.process_index if accelerator.process_index else 0)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def ddp_training(accumulation: int) -> dict[str, Any]:
    """3 optimizer steps with DDP over 2 ranks; records gradients around the accumulation boundary."""
    accelerator = Accelerator(strategy=DDP(device="cpu"), gradient_accumulation_steps=accumulation)
    x, y = make_data()
    model = rank_model(accelerator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    grads_after_micro_step = []
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            grads_after_micro_step.append(next(model.parameters()).grad.clone())
            optimizer.step()
            optimizer.zero_grad()
    params = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    gathered = accelerator.gather(params[None])
    del model, optimizer, loader  # the DDP model goes before its process group (end_matrix_training)
    end_matrix_training(accelerator)
    return {"params": params, "all_params": gathered, "grads": grads_after_micro_step}


def deepspeed_training(
    zero_stage: int,
    accumulation: int,
    max_grad_norm: float | None,
    offload: bool = False,
    plugin: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`ddp_training` through a DeepSpeed engine, clipping at `max_grad_norm` as the runner's loop does,
    with a learning-rate schedule stepped by the loop. With `plugin`: the engine that Accelerate's
    `DeepSpeedPlugin(**plugin)` describes, the Accelerator left at its defaults (as a ported script)."""
    from runner.hardware import DeepSpeed
    from runner.utils import DeepSpeedPlugin

    if plugin is not None:
        accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(**plugin))
    else:
        strategy = DeepSpeed(
            device="cpu",
            zero_stage=zero_stage,
            gradient_clipping=max_grad_norm,
            offload_optimizer=offload,
            offload_params=offload and zero_stage == 3,
        )
        accelerator = Accelerator(strategy=strategy, gradient_accumulation_steps=accumulation)
    x, y = make_data()
    model = rank_model(accelerator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    norms = []
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if max_grad_norm is not None and accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    params = torch.cat([p.flatten() for p in accelerator.get_state_dict(model).values()])
    engine = {
        "stage": accelerator.strategy.engine.zero_optimization_stage(),
        "accumulation": accelerator.gradient_accumulation_steps,
        "clipping": accelerator.strategy.engine.gradient_clipping(),
        "plugin": accelerator.state.deepspeed_plugin is not None,
    }
    accelerator.end_training()
    return {"params": params, "norms": norms, "engine": engine}


def deepspeed_declared_training(checkpoint: str | None = None, resume: bool = False) -> dict[str, Any]:
    """An Accelerate script whose DeepSpeed config declares the optimizer (SGD, "auto" lr and weight decay
    from `DummyOptim`) and whose schedule is `DummyScheduler(lr_scheduler_callable=...)`: the engine builds
    and steps both. With `checkpoint`: `save_state` there after 3 steps, or (`resume`) `load_state` from it
    and train the rest of the epoch."""
    from runner.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    config = {
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.9, "weight_decay": "auto"}},
    }
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    x, y = make_data()
    model = rank_model(accelerator)
    optimizer = DummyOptim(model.parameters(), lr=0.1)
    halving = DummyScheduler(
        optimizer, lr_scheduler_callable=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    )
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, halving)
    batches = loader
    if resume:
        accelerator.load_state(checkpoint)
        batches = accelerator.skip_first_batches(loader, 3)
    lrs = []
    for step, (inputs, targets) in enumerate(batches, start=1):
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
        if checkpoint and not resume and step == 3:
            accelerator.save_state(checkpoint)
    params = torch.cat([p.flatten() for p in accelerator.get_state_dict(model).values()])
    built = type(accelerator.strategy.engine.basic_optimizer).__name__
    accelerator.end_training()
    return {
        "params": params,
        "lrs": lrs,
        "optimizer": built,
        "lr_in_config": config["optimizer"]["params"]["lr"],
    }


def torch_context_parallel_on_cpu() -> dict[str, str]:
    """What torch's context parallel does with a causal attention on CPU ranks, with the default attention
    kernel and with the math one: "ok", or the error it raises."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    weight = torch.randn(8, 8, requires_grad=True)
    outcomes = {}
    for backend in (None, SDPBackend.MATH):
        x = torch.randn(1, 2, 16, 8)  # (batch, heads, sequence, head dim), sharded along the sequence
        try:
            with (
                context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]),
                sdpa_kernel(backend or SDPBackend.FLASH_ATTENTION),
            ):
                torch.nn.functional.scaled_dot_product_attention(
                    x @ weight, x, x, is_causal=True
                ).sum().backward()
            outcomes[str(backend)] = "ok"
        except Exception as err:  # what the refusal of cp_size reports
            outcomes[str(backend)] = f"{type(err).__name__}: {err}"
    dist.destroy_process_group()
    return outcomes


def loop_loss_dtypes(hardware: str, scope: str) -> dict[str, Any]:
    """Under bf16 on `hardware` (compiled with `scope`): the dtypes a prepared model's forward returned
    (called as a script does, through `Engine.loss_of_batch`, and as a script again), those the loss saw
    in both, and the two losses."""
    from runner.config import CompileConfig
    from runner.models import GPT

    torch.manual_seed(0)
    engine = Accelerator(
        mixed_precision="bf16",
        strategy=matrix_strategy(hardware),
        compile=CompileConfig(scope=scope, backend="eager"),
    )
    model = engine.prepare(GPT(vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=2))
    seen_by_loss, returned = [], []
    model.register_forward_hook(lambda module, args, output: returned.append(str(output.dtype).split(".")[1]))

    def loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        seen_by_loss.append(str(outputs.dtype).split(".")[1])
        return torch.nn.functional.cross_entropy(outputs.flatten(0, 1), batch[1].flatten())

    tokens = torch.randint(0, 32, (2, 9))
    batch = (tokens[:, :-1], tokens[:, 1:])
    reference = loss(model(batch[0]), batch).item()  # as a ported Accelerate script computes it
    ours = engine.loss_of_batch(model, loss)(batch).item()
    model(batch[0])
    engine.end_training()
    return {"returned": returned, "seen_by_loss": seen_by_loss, "loss": ours, "reference": reference}


def deepspeed_generated_config() -> dict[str, Any]:
    """The DeepSpeed config built from a user's JSON with "auto" values and the run's settings; and what
    preparing an optimizer without its model says."""
    from runner.hardware import DeepSpeed

    user = {"gradient_accumulation_steps": "auto", "zero_optimization": {"reduce_bucket_size": 1000}}
    strategy = DeepSpeed(device="cpu", zero_stage=1, config=user)
    accelerator = Accelerator(strategy=strategy, gradient_accumulation_steps=2, mixed_precision="bf16")
    accelerator.prepare(DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 8)), batch_size=4))
    try:
        accelerator.prepare(torch.optim.SGD(make_model().parameters(), lr=0.1))
    except ValueError as err:
        alone = str(err)
    model = make_model()
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.end_training()
    return {"config": strategy.config, "user": user, "optimizer_alone": alone}


def reference_training(
    accumulation: int, num_processes: int = 2, max_grad_norm: float | None = None, schedule: bool = False
) -> dict[str, Any]:
    """One process, the same optimizer steps, each on the concatenated global batch."""
    x, y = make_data()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # The prepared scheduler advances once per process at each step (Accelerate's convention).
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2 // num_processes, gamma=0.5)
    global_batch = 8 * num_processes * accumulation
    norms = []
    for start in range(0, len(x), global_batch):
        loss = torch.nn.functional.mse_loss(
            model(x[start : start + global_batch]), y[start : start + global_batch]
        )
        loss.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item())
        optimizer.step()
        if schedule:
            scheduler.step()
        optimizer.zero_grad()
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]), "norms": norms}


# --- the correctness matrix: one tiny GPT, every hardware group, same global batches -------------------------
MATRIX_STEPS, MATRIX_BATCH, MATRIX_SEQ = 20, 8, 16


def matrix_strategy(hardware: str):
    from runner.hardware import FSDP, DeepSpeed, SingleDevice
    from runner.hardware.tensor_parallel import TensorParallel

    strategies = {
        "megatron_tp2": lambda: TensorParallel(device="cpu", tp_size=2),
        "megatron_tp2_sp": lambda: TensorParallel(device="cpu", tp_size=2, sequence_parallel=True),
        "megatron_tp2_dp2": lambda: TensorParallel(device="cpu", tp_size=2, shard_modules=["Block"]),
        **{
            f"megatron_pp2_{schedule}": lambda schedule=schedule: TensorParallel(
                device="cpu", tp_size=1, pp_size=2, pp_schedule=schedule, microbatches=4
            )
            for schedule in ("gpipe", "1f1b")
        },
        "megatron_pp2_interleaved_1f1b": lambda: TensorParallel(
            device="cpu",
            tp_size=1,
            pp_size=2,
            pp_schedule="interleaved_1f1b",
            virtual_stages=2,
            microbatches=4,
        ),
        "megatron_pp2_dp2": lambda: TensorParallel(
            device="cpu", tp_size=1, pp_size=2, microbatches=2, shard_modules=["Block"]
        ),
        "megatron_tp2_pp2": lambda: TensorParallel(device="cpu", tp_size=2, pp_size=2, microbatches=4),
        "megatron_tp2_hsdp2x1": lambda: TensorParallel(
            device="cpu", tp_size=2, dp_replicate=2, shard_modules=["Block"]
        ),
        "fsdp_hsdp2x1": lambda: FSDP(device="cpu", shard_modules=["Block"], dp_replicate=2, dp_shard=1),
        "fsdp_cp2": lambda: FSDP(device="cpu", shard_modules=["Block"], cp_size=2),
        "fsdp_cp2_declared_units": lambda: FSDP(device="cpu", cp_size=2),  # the model's _no_split_modules
        "megatron_tp2_cp2": lambda: TensorParallel(device="cpu", tp_size=2, cp_size=2),
        "fsdp_hsdp2_cp2": lambda: FSDP(device="cpu", shard_modules=["Block"], dp_replicate=2, cp_size=2),
        "cpu": lambda: SingleDevice("cpu"),
        # A forked process computes on one thread (its parent's OpenMP threads do not survive the fork).
        "cpu_forked": lambda: SingleDevice("cpu", num_threads=1),
        "multi_gpu": lambda: DDP(device="cpu"),
        "fsdp": lambda: FSDP(device="cpu", shard_modules=["Block"]),
        "fsdp_hsdp2x2": lambda: FSDP(device="cpu", shard_modules=["Block"], dp_replicate=2),
        "deepspeed_zero1": lambda: DeepSpeed(device="cpu", zero_stage=1),
        "deepspeed_zero2": lambda: DeepSpeed(device="cpu", zero_stage=2),
        "deepspeed_zero3": lambda: DeepSpeed(device="cpu", zero_stage=3),
    }
    return strategies[hardware]()


def matrix_run(
    hardware: str,
    precision: str,
    checkpoint_dir: str,
    compile: str = "none",
    checkpointing: str = "none",
    end: bool = True,
) -> dict[str, Any]:
    """Train the tiny GPT for MATRIX_STEPS steps; each rank takes its slice of the same global batches.
    Then save a checkpoint, take one more step, load the checkpoint and take that step again. `compile`
    (a `trainer.compile.scope`) and `checkpointing` (`full`, or `selective` every 2nd block with its
    matmuls kept) are the compute options."""
    accelerator, step = matrix_training(hardware, precision, compile, checkpointing)
    losses = [step(k) for k in range(MATRIX_STEPS)]
    accelerator.save_state(checkpoint_dir)
    continued = step(MATRIX_STEPS)
    accelerator.load_state(checkpoint_dir)
    after_load = step(MATRIX_STEPS)
    del step  # it holds the prepared model
    if end:
        end_matrix_training(accelerator)
    else:  # another run follows in this process group
        accelerator.free_memory()
    return {"losses": losses, "continued": continued, "after_load": after_load}


def matrix_runs(
    hardware: str, precisions: list[str], checkpoint_dir: str, stored: str | None = None
) -> dict[str, Any]:
    """`matrix_run` in each precision in turn, in the same ranks and process group (one launch); each
    result says where its checkpoint is. With `stored` (a checkpoint an earlier commit wrote), then
    `matrix_resumed` from it, under "stored"."""
    results: dict[str, Any] = {}
    for precision in precisions:
        checkpoint = os.path.join(checkpoint_dir, precision)
        last = precision == precisions[-1] and stored is None
        run = matrix_run(hardware, precision, checkpoint, end=last)
        results[precision] = run | {"checkpoint": checkpoint}
    if stored is not None:
        results["stored"] = matrix_resumed(hardware, stored)
    return results


def matrix_resumed(
    hardware: str, checkpoint_dir: str, compile: str = "none", save_dir: str | None = None, end: bool = True
) -> float:
    """The loss of the step after a `matrix_run` checkpoint, taken by a fresh run (fp32) that loads it
    (and, with `save_dir`, saves what it loaded there first)."""
    accelerator, step = matrix_training(hardware, "no", compile, "none")
    accelerator.load_state(checkpoint_dir)
    if save_dir is not None:
        accelerator.save_state(save_dir)
    loss = step(MATRIX_STEPS)
    del step  # it holds the prepared model
    if end:
        end_matrix_training(accelerator)
    else:  # another run follows in this process group
        accelerator.free_memory()
    return loss


def compiled_round_trip(hardware: str, scope: str, root: str) -> dict[str, Any]:
    """In the same ranks: a `matrix_run` compiled with `scope`; an eager run that resumes its checkpoint
    and saves what it loaded; a compiled run that resumes that."""
    compiled = matrix_run(hardware, "no", os.path.join(root, "compiled"), scope, end=False)
    eager = matrix_resumed(
        hardware, os.path.join(root, "compiled"), "none", os.path.join(root, "eager"), end=False
    )
    back = matrix_resumed(hardware, os.path.join(root, "eager"), scope)
    return {"compiled": compiled, "eager": eager, "back": back}


def end_matrix_training(accelerator: Any) -> None:
    """Free the prepared model (the caller dropped its own references) while the process group lives,
    then leave the group: a DDP reducer collected after the group was destroyed joins its gloo threads
    forever, hanging the rank at exit."""
    accelerator.free_memory()
    accelerator.end_training()


def matrix_training(hardware: str, precision: str, compile: str, checkpointing: str) -> tuple[Any, Any]:
    """The prepared Accelerator of a matrix run and its step function (batch index -> mean loss)."""
    from runner.config import ActivationCheckpointingConfig, CompileConfig
    from runner.models import GPT

    accelerator = Accelerator(
        strategy=matrix_strategy(hardware),
        mixed_precision=precision,
        compile=CompileConfig(scope=compile),
        activation_checkpointing=ActivationCheckpointingConfig(
            mode=checkpointing,
            every_n_blocks=2 if checkpointing == "selective" else 1,
            save_matmuls=checkpointing == "selective",
        ),
    )
    torch.manual_seed(0)
    model = GPT(vocab_size=32, max_seq_len=MATRIX_SEQ, d_model=32, n_layers=4, n_heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Learnable sequences: each row counts up (mod 32) from a random start.
    starts = torch.randint(
        0, 32, (MATRIX_STEPS + 1, MATRIX_BATCH, 1), generator=torch.Generator().manual_seed(1)
    )
    tokens = (starts + torch.arange(MATRIX_SEQ + 1)) % 32
    # Ranks that split the model (tensor parallel) read the same rows: slice by the data-parallel rank.
    readers, reader = accelerator.state.data_parallel_size, accelerator.state.data_parallel_index
    share = MATRIX_BATCH // readers
    mine = slice(reader * share, (reader + 1) * share)

    def next_token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), batch["targets"].reshape(-1))

    def step(k: int) -> float:
        rows = tokens[k, mine]
        # The model's outputs and this loss; a pipeline computes it per microbatch on its last stage.
        batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
        loss = accelerator.training_loss(model, batch, next_token_loss)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return accelerator.reduce(loss.detach().float(), "mean").item()

    return accelerator, step


# --- tracking: only the main process talks to the tracker ---------------------------------------------------
def tracking_from_two_ranks(project_dir: str) -> dict[str, Any]:
    """Both ranks call the tracking API; rank 0's run is the only one."""
    tracker = MLflowTracker(detach=False)  # end_training waits for the records to be sent
    accelerator = Accelerator(strategy=DDP(device="cpu"), log_with=tracker, project_dir=project_dir)
    accelerator.init_trackers("two-ranks", config={"lr": 0.1, "model": {"width": 8}})
    for step in range(3):
        accelerator.log({"loss": 1.0 / (step + 1), "rank": float(accelerator.process_index)}, step=step)
    tracker = accelerator.get_tracker("mlflow")
    accelerator.end_training()
    return {"run_id": getattr(tracker, "run_id", None), "tracker": type(tracker).__name__}


# --- runner.logging: the multi-process logger ------------------------------------------------------------------
def multiprocess_logging(shared_log: str) -> dict[str, Any]:
    """Every rank logs through `get_logger` into one shared file: once main-process-only, once from every
    process, once in rank order (rank 1 sleeps first: only the barriers keep it second)."""
    import logging

    from runner.logging import get_logger

    accelerator = Accelerator(strategy=DDP(device="cpu"))
    handler = logging.FileHandler(shared_log)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = get_logger(f"shared.{accelerator.process_index}", log_level="INFO")
    logger.logger.addHandler(handler)
    logger.info("main only %d", accelerator.process_index)
    logger.info("every %d", accelerator.process_index, main_process_only=False)
    if accelerator.process_index == 1:
        time.sleep(0.5)
    logger.info("in order %d", accelerator.process_index, in_order=True)
    handler.close()
    accelerator.end_training()
    return {}


def hsdp_layout() -> dict[str, Any]:
    """How `FSDP(dp_replicate=2)` lays a tiny GPT out over 4 ranks: the placements and mesh of a block's
    weight, and the share of it this rank holds."""
    from runner.hardware import FSDP
    from runner.models import GPT

    accelerator = Accelerator(strategy=FSDP(device="cpu", shard_modules=["Block"], dp_replicate=2))
    model = accelerator.prepare(GPT(vocab_size=32, max_seq_len=8, d_model=32, n_layers=2, n_heads=2))
    weight = model.blocks[0].mlp.fc_in.weight
    layout = {
        "placements": [str(p) for p in weight.placements],
        "mesh": list(weight.device_mesh.mesh.shape),
        "mesh_dims": list(weight.device_mesh.mesh_dim_names),
        "local_fraction": weight.to_local().numel() / weight.numel(),
    }
    accelerator.free_memory()
    accelerator.end_training()
    return layout


def pipeline_order(schedule: str, microbatches: int, virtual_stages: int) -> dict[str, Any]:
    """Over 2 pipeline ranks: the blocks each of this rank's stages holds, and the order in which they ran
    forward (F<stage>) and backward (B<stage>) in a training step (the second: the first also sizes the
    stages' buffers)."""
    from runner.hardware.tensor_parallel import TensorParallel
    from runner.models import GPT

    strategy = TensorParallel(
        device="cpu",
        tp_size=1,
        pp_size=2,
        pp_schedule=schedule,
        microbatches=microbatches,
        virtual_stages=virtual_stages,
    )
    accelerator = Accelerator(strategy=strategy)
    torch.manual_seed(0)
    model = accelerator.prepare(GPT(vocab_size=32, max_seq_len=8, d_model=16, n_layers=4, n_heads=2))
    events: list[str] = []

    def record(index: int):
        def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
            events.append(f"F{index}")
            if output.requires_grad:
                output.register_hook(lambda grad: events.append(f"B{index}"))

        return hook

    for index, stage in model.stage_modules.items():
        stage.register_forward_hook(record(index))
    tokens = torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss_fn(logits: torch.Tensor, part: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), part["targets"].reshape(-1))

    for _ in range(2):
        events.clear()
        loss = accelerator.training_loss(model, batch, loss_fn)
    blocks = {index: list(stage.blocks) for index, stage in model.stage_modules.items()}
    accelerator.free_memory()
    accelerator.end_training()
    return {"events": events, "blocks": blocks, "loss": loss.item()}


def async_checkpoint_round_trip(hardware: str, workdir: str) -> dict[str, float]:
    """Save the same state blocking and in the background, train on while the background write runs,
    then load each: the next loss after each load, and the one the run took first."""
    accelerator, step = matrix_training(hardware, "no", "none", "none")
    for k in range(3):
        step(k)
    accelerator.save_state(f"{workdir}/blocking")
    accelerator.save_state(f"{workdir}/background", blocking=False)
    first = step(3)  # changes the weights while the copy is written
    step(4)
    accelerator.wait_for_checkpoint()
    accelerator.load_state(f"{workdir}/background")
    from_background = step(3)
    accelerator.load_state(f"{workdir}/blocking")
    from_blocking = step(3)
    del step
    end_matrix_training(accelerator)
    return {"first": first, "background": from_background, "blocking": from_blocking}


# --- context parallel: what each rank of a cp group computes ----------------------------------------------------
def context_parallel_shares(hardware: str, model_type: str = "gpt") -> dict[str, Any]:
    """A tiny GPT (or transformers Llama, `model_type="llama"`) prepared by `hardware` (cp_size 2) takes
    one training loss and one eval forward of the same 16-token rows: the positions and sequence lengths
    its embeddings saw in each, the loss, and the loss of one unsharded copy of the model on the whole
    rows."""
    from runner.models import GPT

    def build() -> torch.nn.Module:
        if model_type == "gpt":
            return GPT(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=2)
        from runner.models.hf import causal_lm

        sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
        heads = {"num_attention_heads": 4, "num_key_value_heads": 2}  # grouped-query attention
        return causal_lm(vocab_size=32, config={"model_type": "llama", **sizes, **heads})

    torch.manual_seed(0)
    model, whole = build(), build()
    whole.load_state_dict(model.state_dict())
    accelerator = Accelerator(strategy=matrix_strategy(hardware))
    model = accelerator.prepare(model)
    # The token embedding runs first; then GPT's position embedding, or Llama's rotary embedding.
    embedding, positions = (
        (model.tok_emb, model.pos_emb) if model_type == "gpt" else (model.model.embed_tokens, model.model.rotary_emb)
    )
    seen: list[dict[str, Any]] = []
    embedding.register_forward_hook(lambda module, args, output: seen.append({"length": args[0].shape[1]}))
    positions.register_forward_hook(
        lambda module, args, kwargs, output: seen.append(
            {"positions": (args[1] if len(args) > 1 else kwargs.get("position_ids", args[0])).flatten().tolist()}
        ),
        with_kwargs=True,
    )
    tokens = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(1))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def next_token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), batch["targets"].reshape(-1))

    loss = accelerator.training_loss(model, batch, next_token_loss)
    accelerator.backward(loss)
    train = {"length": seen[0]["length"], "positions": seen[1]["positions"]}
    seen.clear()
    model.eval()
    with torch.no_grad():
        eval_logits = model_outputs(model, batch)
    evaluation = {"length": seen[0]["length"], "positions": seen[1]["positions"]}
    with torch.no_grad():
        reference = next_token_loss(model_outputs(whole, batch), batch).item()
        eval_difference = (eval_logits - model_outputs(whole, batch)).abs().max().item()
    model.train()
    try:  # whole sequences in training mode, not through training_loss
        with torch.no_grad():
            model_outputs(model, batch)
        uncut = "no error"
    except RuntimeError as err:
        uncut = str(err)
    accelerator.free_memory()
    accelerator.end_training()
    return {
        "train": train,
        "eval": evaluation,
        "loss": loss.item(),
        "reference": reference,
        "eval_difference": eval_difference,
        "uncut": uncut,
    }
