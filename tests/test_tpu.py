"""`hardware=xla` (torch_xla) with `PJRT_DEVICE=CPU`: one device, and SPMD data parallel over 2 devices
(`CPU_NUM_DEVICES=2`), each matching plain PyTorch's fp32 loss curve on the same batches within 1e-5, with a
save_state/load_state round trip. torch_xla needs its own environment (torch 2.9): `.ci/tpu.sh` builds it and
runs this file there; elsewhere these tests skip, except the one that checks the message without it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import probes
import pytest
from conftest import cli_env, metrics_of

pytestmark = [pytest.mark.slow, pytest.mark.tpu]

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
needs_xla = pytest.mark.skipif(
    not HAS_XLA, reason="torch_xla is not installed here: `bash .ci/tpu.sh` runs these"
)

# Trains the tiny GPT for 12 steps on the same global batches twice: plain PyTorch on the CPU, then the
# Accelerator on hardware=xla; then a checkpoint round trip. Prints the losses as JSON.
SCRIPT = r"""
import json, sys, torch
from torch.utils.data import DataLoader
from runner import Accelerator
from runner.hardware.xla import XLA
from runner.models import GPT

steps, seq = 12, 16
starts = torch.randint(0, 32, (steps * 8 + 8, 1), generator=torch.Generator().manual_seed(1))
tokens = (starts + torch.arange(seq + 1)) % 32

def make():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, max_seq_len=seq, d_model=32, n_layers=2, n_heads=2)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

def loss_of(model, batch):
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), batch[:, 1:].reshape(-1))

spmd = json.loads(sys.argv[2])  # hardware.spmd: null (when several devices), true or false
accelerator = Accelerator(strategy=XLA(spmd=spmd))  # first: the XLA device must exist before any backward runs
model, optimizer = make()
reference = []
for batch in DataLoader(tokens, batch_size=8):
    loss = loss_of(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    reference.append(loss.item())

model, optimizer = make()
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(tokens, batch_size=8))
losses = []
for batch in loader:
    loss = loss_of(model, batch)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
batch = next(iter(loader))
accelerator.save_state(sys.argv[1])
def step():
    loss = loss_of(model, batch)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()
continued = step(), step()
accelerator.load_state(sys.argv[1])
after_load = step(), step()
print(json.dumps({"reference": reference, "losses": losses, "continued": continued, "after_load": after_load,
                  "device": str(accelerator.device), "spmd": accelerator.strategy.mesh is not None}))
"""


@needs_xla
@pytest.mark.parametrize(
    ("devices", "spmd", "sharded"), [(1, None, False), (2, None, True), (2, False, False)]
)
def test_xla_matches_plain_pytorch_and_round_trips_a_checkpoint(tmp_path, devices, spmd, sharded):
    env = cli_env() | {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "state"), json.dumps(spmd)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["device"].startswith("xla") and result["spmd"] == sharded
    assert result["losses"][-1] < result["losses"][0]
    for step, (ours, theirs) in enumerate(zip(result["losses"], result["reference"], strict=True)):
        assert abs(ours - theirs) <= 1e-5, (step, ours, theirs)
    assert result["after_load"] == result["continued"]


@needs_xla
def test_runner_trains_on_tpu_from_the_command_line(run_cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    record = tmp_path / "probe"
    probe = ["task._target_=probes.RecordingRegression", f"+task.record={record}"]
    proc = run_cli(
        "hardware=xla",
        "precision=bf16",
        *probe,
        "trainer.max_steps=20",
        "trainer.eval_every=0",
        "tracker=none",
        pythonpath=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stderr
    assert "on xla" in proc.stderr and metrics_of(proc)["eval/loss"] < 1.0
    assert set(probes.read(record, "task")) == {"bfloat16"}  # XLA's autocast
    refused = run_cli("hardware=xla", "precision=fp16")
    assert refused.returncode == 2 and "precision=fp16 with hardware=xla" in refused.stderr
    refused = run_cli(
        "hardware=xla", "trainer.compile.scope=model", "trainer.activation_checkpointing.mode=full"
    )
    assert refused.returncode == 2, refused.stderr
    assert (
        "trainer.compile.scope=model and trainer.activation_checkpointing.mode=full with hardware=xla"
        in refused.stderr
    )


@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed here")
def test_without_torch_xla_hardware_tpu_says_how_to_get_it(run_cli):
    proc = run_cli("hardware=xla")
    assert proc.returncode == 2, proc.stderr
    assert "hardware=xla needs torch_xla, which is not installed here" in proc.stderr
    assert "torch_xla 2.9 needs torch 2.9" in proc.stderr
