"""save_state/load_state, ProjectConfiguration, save_model and atomic checkpoints, in one process."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, TensorDataset

from runner import Accelerator, ProjectConfiguration, load_checkpoint_in_model
from runner.build import build_optimizer, build_scheduler
from runner.checkpoint.accelerate_layout import batches_handed_out, torchdata_position
from runner.checkpoint.checkpointer import Schedule
from runner.checkpoint.files import damage, file_digest, latest_checkpoint, load_torch, read_meta
from runner.checkpoint.resume import check_checkpoint_fits, check_model_fits, resume_checkpoint
from runner.checkpoint.weights import DamagedFileError, stored_tensors
from runner.config import CONF_DIR
from runner.errors import ConfigError
from runner.hardware import FSDP
from runner.models import GPT
from runner.rng import rng_state, set_rng_state, set_seed
from runner.run_dir import CANDIDATE, LAST_FINITE

DATA = (torch.randn(40, 4, generator=torch.Generator().manual_seed(0)), torch.randn(40, 1))


def setup(project_dir: Path, seed: int = 0, precision: str = "fp16", **config):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.7)
    loader = DataLoader(TensorDataset(*DATA), batch_size=4, shuffle=True)
    project = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True, **config)
    accelerator = Accelerator(mixed_precision=precision, project_config=project)
    return accelerator, *accelerator.prepare(model, optimizer, loader, scheduler)


def run(accelerator, model, optimizer, loader, scheduler, epochs, save_at=(), start=(0, 0)):
    """Train `epochs` epochs from (epoch, batch) `start`; save a checkpoint after each (epoch, batch) in `save_at`."""
    for epoch in range(start[0], epochs):
        skip = start[1] if epoch == start[0] else 0
        for i, (x, y) in enumerate(
            accelerator.skip_first_batches(loader, skip) if skip else loader, start=skip
        ):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if (epoch, i) in save_at:
                accelerator.save_state()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_resume_mid_epoch_is_bitwise_identical(tmp_path, precision):
    reference = run(*setup(tmp_path / "a", precision=precision), epochs=3)
    saved = run(*setup(tmp_path / "b", precision=precision), epochs=3, save_at={(1, 4)})
    assert torch.equal(saved, reference)  # saving changes nothing
    accelerator, model, optimizer, loader, scheduler = setup(tmp_path / "b", seed=7, precision=precision)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # every RNG elsewhere
    accelerator.load_state()  # the latest of the project
    assert loader.resume_batches == 5 and loader.iteration == 1
    resumed = run(accelerator, model, optimizer, loader, scheduler, epochs=3, start=(1, 5))
    assert torch.equal(resumed, reference)


def test_automatic_naming_total_limit_and_latest(tmp_path):
    accelerator, *objects = setup(tmp_path, total_limit=2)
    run(accelerator, *objects, epochs=1, save_at={(0, 1), (0, 3), (0, 5)})
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_1", "checkpoint_2", "latest"]
    assert latest_checkpoint(checkpoints) == checkpoints / "checkpoint_2"
    assert accelerator.save_iteration == 3
    accelerator.project_configuration.iteration = 2
    with pytest.raises(ValueError, match="already exists"):
        accelerator.save_state()
    other, *_ = setup(tmp_path)
    other.load_state(str(checkpoints / "checkpoint_1"))
    assert other.save_iteration == 2  # the next number after the loaded one
    # The loop numbers after what the dir holds: a newer checkpoint than the one loaded (a run killed
    # before marking it latest) is not written over.
    other.project_configuration.iteration = 3
    other.load_state(str(checkpoints / "checkpoint_1"))
    assert other.save_iteration == 3
    assert read_meta(checkpoints / "checkpoint_2")["num_processes"] == 1


def test_the_checkpointer_decides_which_steps_save_by_its_schedule(tmp_path):
    """`save_if_due`: numbered checkpoints every `every` steps, by time at logging steps only, at a stop;
    the last-finite candidate at each logging step; a named save (a target dir) is not numbered."""
    accelerator, *_ = setup(tmp_path, precision="no")
    checkpointer = accelerator.checkpointer
    checkpointer.schedule = Schedule(every=3, last_finite=True)
    saved = {step: checkpointer.save_if_due(step, logging=step % 2 == 0) for step in range(1, 8)}
    assert {step: path.name for step, path in saved.items() if path} == {3: "checkpoint_0", 6: "checkpoint_1"}
    assert read_meta(tmp_path / "checkpoints" / LAST_FINITE)["step"] == 4  # promoted at step 6
    assert read_meta(tmp_path / "checkpoints" / CANDIDATE)["step"] == 6
    assert checkpointer.save_if_due(7, stop=True).name == "checkpoint_2"
    checkpointer.schedule = Schedule(every_s=1e-9)
    assert checkpointer.save_if_due(8) is None  # time is asked at logging steps only
    assert checkpointer.save_if_due(9, logging=True).name == "checkpoint_3"
    named = checkpointer.save(tmp_path / "best" / "step_9", step=9)
    assert named == tmp_path / "best" / "step_9" and read_meta(named)["step"] == 9
    assert latest_checkpoint(tmp_path / "checkpoints").name == "checkpoint_3"  # the named one is not latest


def test_register_for_checkpointing(tmp_path):
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    accelerator = Accelerator()
    with pytest.raises(ValueError, match="these have not: object"):
        accelerator.register_for_checkpointing(Counter(), object())
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    counter.n = 41
    accelerator.save_state(str(tmp_path / "ckpt"))
    counter.n = 0
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert counter.n == 41
    fresh = Accelerator()
    with pytest.raises(ConfigError, match="prepare and register the same objects"):
        fresh.load_state(str(tmp_path / "ckpt"))


def test_rng_state_round_trip():
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(load_torch_round_trip(state))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def load_torch_round_trip(obj, tmp=Path("/tmp")):
    path = tmp / f"runner-rng-{os.getpid()}.pt"
    torch.save(obj, path)
    try:
        return load_torch(path)
    finally:
        path.unlink()


def test_loading_never_unpickles_code(tmp_path):
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    accelerator.prepare(model, torch.optim.SGD(model.parameters()))
    directory = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    torch.save({"state": Path("/etc/passwd"), "param_groups": []}, directory / "optimizer_0.pt")  # any object
    meta = read_meta(directory)  # recorded as if save_state had written it: only the loader can refuse it
    meta["files"]["optimizer_0.pt"] = file_digest(directory / "optimizer_0.pt")
    (directory / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        accelerator.load_state(str(directory))


@pytest.mark.parametrize("target", ["torch.optim.RAdam", "torch.optim.NAdam", "torch.optim.Adamax"])
def test_an_optimizer_from_yaml_saves_a_state_that_loads(tmp_path, target):
    """A YAML list (`betas: [0.9, 0.999]`) reaches the optimizer and the schedule as a list: these
    optimizers (and every one on torch 2.9) keep the value they are given in their param groups, and
    omegaconf's ListConfig there is refused by the weights-only load of the resume."""
    cfg = OmegaConf.create(
        {
            "optimizer": {**OmegaConf.load(CONF_DIR / "optimizer" / "adamw.yaml"), "_target_": target},
            "scheduler": OmegaConf.load(CONF_DIR / "scheduler" / "cosine.yaml"),
        }
    )
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(cfg, model)
    accelerator = Accelerator()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_scheduler(cfg, optimizer, 10))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step(), scheduler.step()
    directory = accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.load_state(directory)
    assert optimizer.param_groups[0]["betas"] == pytest.approx([0.9, 0.999])


@pytest.mark.parametrize("safe", [True, False])
def test_save_model_shards_and_loads_back(tmp_path, safe):
    torch.manual_seed(0)
    model = GPT(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)  # tied embeddings
    accelerator = Accelerator()
    accelerator.save_model(model, str(tmp_path / "sharded"), max_shard_size="20KB", safe_serialization=safe)
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    suffix = "safetensors" if safe else "bin"
    assert len([f for f in files if f.endswith(suffix)]) > 1 and any(f.endswith(".index.json") for f in files)
    accelerator.save_model(model, str(tmp_path / "single"), safe_serialization=safe)
    for checkpoint in (tmp_path / "sharded", tmp_path / "single", next((tmp_path / "single").iterdir())):
        torch.manual_seed(1)
        fresh = GPT(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
        load_checkpoint_in_model(fresh, checkpoint)
        assert fresh.lm_head.weight is fresh.tok_emb.weight  # still tied
        for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
    wider = GPT(vocab_size=50, d_model=64, n_layers=2, n_heads=2, max_seq_len=16)
    with pytest.raises(
        ValueError, match=r"with another shape: tok_emb.weight \(50, 32\) \(the model has \(50, 64\)\)"
    ):
        load_checkpoint_in_model(wider, tmp_path / "single")


def test_resume_argument_checks(tmp_path):
    assert resume_checkpoint(None, tmp_path) is None
    assert resume_checkpoint("auto", tmp_path) is None  # nothing saved yet: start fresh
    with pytest.raises(ConfigError, match="no such directory"):
        resume_checkpoint(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a checkpoint"):
        resume_checkpoint(str(tmp_path / "empty"), tmp_path)
    accelerator = Accelerator(project_dir=str(tmp_path))
    accelerator.project_configuration.automatic_checkpoint_naming = True
    saved = Path(accelerator.save_state())
    assert resume_checkpoint("auto", tmp_path) == saved
    check_checkpoint_fits(saved, 1, "full")
    with pytest.raises(ConfigError, match="written by 1 process"):
        check_checkpoint_fits(saved, 2, "full")
    with pytest.raises(
        ConfigError, match="holds 'full' model state and this run's hardware reads 'deepspeed'"
    ):
        check_checkpoint_fits(saved, 1, "deepspeed")


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_a_checkpoint_of_another_model_is_refused_from_its_headers(tmp_path, checkpoint_format):
    """Before launch, from the files' headers: the sharded (DCP) format would fail only inside the ranks."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    if checkpoint_format == "full":
        save_file(model.state_dict(), tmp_path / "model_0.safetensors")
    else:
        dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "model_0", no_dist=True)
    with torch.device("meta"):
        same = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
        other = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 8)), torch.nn.Linear(8, 2))
    check_model_fits(tmp_path, checkpoint_format, same)
    with pytest.raises(ConfigError, match=r"another shape: 0.weight \(8, 4\) there, \(16, 4\) here; 0.bias"):
        check_model_fits(tmp_path, checkpoint_format, wider)
    with pytest.raises(ConfigError, match="none of its tensor names is the model's"):
        check_model_fits(tmp_path, checkpoint_format, torch.nn.Linear(1, 1, device="meta"))
    check_model_fits(tmp_path, checkpoint_format, other)  # some names in common, none of another shape


def _save_forever(project_dir: str, ready) -> None:
    """A child that saves checkpoints back to back (each ~8 MB), announcing each save before it starts."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    optimizer = torch.optim.Adam(model.parameters())
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=2
        )
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    while True:
        with torch.no_grad():
            model.weight.fill_(accelerator.save_iteration)  # a checkpoint's weights say which one it is
        ready.set()
        accelerator.save_state()


TRIALS = 8  # half killed while a save's files are written, half at a random moment (seeded) of one


@pytest.mark.slow
def test_kill_9_at_any_moment_of_a_save_leaves_a_loadable_latest_checkpoint(tmp_path):
    # Children fork from a fresh server process: forking this one, whose OpenMP threads already ran, could hang.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "runner", "test_checkpoint"])
    rng = random.Random(0)
    interrupted_saves = 0
    for trial in range(TRIALS):
        project = tmp_path / str(trial)
        ready = context.Event()
        child = context.Process(target=_save_forever, args=(str(project), ready))
        child.start()
        assert ready.wait(60)
        ready.clear()
        assert ready.wait(60)  # the second save has started: there is a previous one to protect
        if trial % 2:  # while a save's files are being written (its staging dir exists)
            deadline = time.monotonic() + 10
            while not any((project / "checkpoints").glob(".*.partial")) and time.monotonic() < deadline:
                time.sleep(0.0005)
        else:  # at any moment: somewhere inside a save (one takes ~20-80 ms here), in any of its phases
            time.sleep(rng.uniform(0, 0.08))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        interrupted_saves += any((project / "checkpoints").glob(".*.partial"))
        latest = latest_checkpoint(project / "checkpoints")
        assert latest is not None and latest.is_dir(), trial
        accelerator = Accelerator()
        model = torch.nn.Linear(1024, 1024)
        model, _ = accelerator.prepare(model, torch.optim.Adam(model.parameters()))
        accelerator.load_state(str(latest))
        number = int(latest.name.removeprefix("checkpoint_"))
        assert torch.all(model.weight == number), trial  # complete, and the one `latest` names
    assert (
        interrupted_saves >= TRIALS // 2
    )  # kills did land inside a save's writing (its staging dir was left)


def test_set_seed_has_accelerates_signature(monkeypatch):
    set_seed(5, True)  # the second argument is device_specific, as in Accelerate: not deterministic
    assert torch.initial_seed() == 5 and not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    set_seed(5, device_specific=True)
    assert torch.initial_seed() == 6  # the rank is added
    set_seed(5)
    assert torch.initial_seed() == 5


def test_each_file_is_recorded_and_a_damaged_one_is_refused_by_name(tmp_path):
    accelerator, *parts = setup(tmp_path, precision="no")
    run(accelerator, *parts, epochs=1, save_at=[(0, 3)])
    checkpoint = latest_checkpoint(tmp_path / "checkpoints")
    meta = read_meta(checkpoint)
    on_disk = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.name != "meta.json")
    aliases = meta["accelerate_names"]  # Accelerate's names for the same files, hard links
    assert aliases == {
        "model.safetensors": "model_0.safetensors",
        "optimizer.bin": "optimizer_0.pt",
        "scheduler.bin": "scheduler_0.pt",
    }
    assert (checkpoint / "model.safetensors").stat().st_ino == (
        checkpoint / "model_0.safetensors"
    ).stat().st_ino
    assert sorted(meta["files"]) == sorted(set(on_disk) - set(aliases)) and damage(checkpoint, meta) == []
    weights = checkpoint / "model_0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert damage(checkpoint, meta) == [
        "model_0.safetensors does not have the content that was written (its CRC-32 differs)"
    ]
    assert damage(checkpoint, meta, contents=False) == []  # same size: only the contents tell
    with pytest.raises(ConfigError, match=r"model_0\.safetensors does not have the content"):
        resume_checkpoint(str(checkpoint), tmp_path, verify=True)
    os.truncate(checkpoint / "optimizer_0.pt", 10)
    with pytest.raises(ConfigError, match=r"optimizer_0\.pt has 10 bytes"):
        accelerator.load_state(str(checkpoint))


def test_a_cut_weights_file_is_refused_by_name_not_read_as_whole(tmp_path):
    model = torch.nn.Linear(64, 64)
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path))
    stored = stored_tensors(path)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(DamagedFileError, match="ended after"):  # cut after its header was read
        stored["weight"].read()
    with pytest.raises(DamagedFileError, match=f"{path} is not a whole safetensors file"):
        stored_tensors(path)
    path.write_bytes(b"\xff" * 8 + b"{}")  # a header length beyond the file
    with pytest.raises(DamagedFileError, match="its header claims"):
        stored_tensors(path)


def test_torchdatas_loader_positions_read_in_each_format_and_write_in_the_one_accelerate_resumes():
    single = {"_num_yielded": 6, "_sampler_iter_yielded": 6, "_iterator_finished": False}
    workers = {"_snapshot": {"_snapshot_step": 3, "_main_snapshot": {}}, "_steps_since_snapshot": 2}
    assert batches_handed_out(single) == 6 and batches_handed_out(workers) == 5
    assert batches_handed_out({**single, "_iterator_finished": True}) == 0  # the next pass starts afresh
    assert batches_handed_out(torchdata_position(4)) == 4
    with pytest.raises(ValueError, match="not a torchdata StatefulDataLoader state"):
        batches_handed_out({"iteration": 1})


def test_a_checkpoint_in_accelerates_layout_is_refused_where_it_does_not_fit(tmp_path, caplog):
    """Accelerate's files alone (what its save_state writes: the names a runner checkpoint also has)
    load as Accelerate's checkpoint (a stateful dataloader's position left alone by a loader that is not
    stateful, as under Accelerate); into other objects, or into sharded models, they are refused."""
    accelerator, *parts = setup(tmp_path / "run", precision="no")
    run(accelerator, *parts, epochs=1, save_at=[(0, 3)])
    checkpoint = latest_checkpoint(tmp_path / "run" / "checkpoints")
    theirs = tmp_path / "accelerate"
    theirs.mkdir()
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        (theirs / name).write_bytes((checkpoint / name).read_bytes())
    torch.save({"_num_yielded": 3}, theirs / "dl_state_dict.bin")  # a torchdata StatefulDataLoader's
    model = parts[0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with caplog.at_level("WARNING", logger="runner.checkpoint.checkpointer"):
        accelerator.load_state(str(theirs))
    assert not caplog.text
    saved = load_file(str(theirs / "model.safetensors"))
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())
    accelerator.register_for_checkpointing(torch.nn.Linear(1, 1))
    with pytest.raises(
        ConfigError, match=r"written by Accelerate.*'custom_checkpoint': 0.*'custom_checkpoint': 1"
    ):
        accelerator.load_state(str(theirs))
    sharded = Accelerator(strategy=FSDP(device="cpu", num_processes=1))
    sharded.prepare(torch.nn.Linear(4, 8))
    with pytest.raises(ConfigError, match="holds whole models, which runner loads where every process holds"):
        sharded.load_state(str(theirs))
    sharded.end_training()
