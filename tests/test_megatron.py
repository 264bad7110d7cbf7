"""`hardware=tensor_parallel` from the command line: tensor parallel (and tensor x data parallel) training that
matches one process, DCP checkpoints and resume, full weights at the end, and what is refused before launch.
The loss-curve matrix against one process (tp 2, tp 2 x dp 2) is in test_matrix.py."""

from __future__ import annotations

import pytest
from conftest import metrics_of
from omegaconf import OmegaConf

from runner import load_checkpoint_in_model
from runner.checkpoint.weights import read_weights
from runner.models import GPT

pytestmark = pytest.mark.slow

TRAIN = ("experiment=gpt_sonnets", "trainer.max_steps=20", "trainer.eval_every=10", "tracker=none")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_trains_exactly_as_one_process_on_the_same_batches(run_cli, sequence_parallel):
    single = run_cli(*TRAIN, "hardware.num_threads=1")
    assert single.returncode == 0, single.stderr
    tp = run_cli(
        *TRAIN,
        "hardware=tensor_parallel",
        "hardware.num_processes=2",
        f"hardware.sequence_parallel={sequence_parallel}",
    )
    assert tp.returncode == 0, tp.stderr
    assert "2 process(es)" in tp.stderr
    for name, value in metrics_of(single).items():
        assert metrics_of(tp)[name] == pytest.approx(value, abs=1e-5), name


def test_tp_by_dp_checkpoints_with_dcp_resumes_and_saves_full_weights(run_cli):
    hardware = (
        "hardware=tensor_parallel",
        "hardware.num_processes=4",
        "hardware.oversubscribe=true",  # on a 2-core machine
        "hardware.tp_size=2",
        "hardware.shard_modules=[Block]",
    )
    first = run_cli(*hardware, *TRAIN, "trainer.max_steps=10", "trainer.checkpoint_every=5")
    assert first.returncode == 0, first.stderr
    assert (
        first.run_dir / "checkpoints" / "checkpoint_1" / "model_0" / ".metadata"
    ).exists()  # sharded (DCP)
    resumed = run_cli(*hardware, *TRAIN, "trainer.max_steps=12")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in (resumed.run_dir / "runner.log").read_text()
    settings = OmegaConf.load(resumed.run_dir / "resolved_config.yaml").model
    vocab_size = read_weights(resumed.run_dir / "model")["tok_emb.weight"].shape[0]
    model = GPT(**{k: v for k, v in settings.items() if k != "_target_"} | {"vocab_size": vocab_size})
    load_checkpoint_in_model(model, resumed.run_dir / "model")  # full, unsharded weights of every layer


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["experiment=gpt_sonnets", "hardware.num_processes=3", "hardware.oversubscribe=true"],
            "hardware.tp_size=2: the parallel degrees (pp_size x dp_replicate x dp_shard x tp_size = 2 (dp_shard takes the "
            "rest of the ranks)) must multiply to the world size, 3 ranks",
        ),
        (
            [
                "experiment=gpt_sonnets",
                "hardware.num_processes=3",
                "hardware.oversubscribe=true",
                "hardware.tp_size=3",
            ],
            "tp_size=3 does not divide model.n_heads=4",
        ),
        ([], "MLP declares no tensor-parallel plan"),  # the default experiment's model
        (["experiment=gpt_sonnets", "precision=fp16"], "precision=fp16 with hardware=tensor_parallel"),
        (["experiment=gpt_sonnets", "hardware.tp_size=0"], "hardware.tp_size=0: must be >= 1"),
    ],
)
def test_what_tensor_parallel_cannot_do_is_refused_before_launch(forked_cli, overrides, message):
    proc = forked_cli("hardware=tensor_parallel", *overrides)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "starting" not in proc.stderr  # no rank was started
