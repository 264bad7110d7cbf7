"""The correctness matrix: one tiny GPT trained by every hardware group matches one process.

fp32 loss curves agree within 1e-5 and bf16 within 2e-2 of the single-process (`cpu`) run on the same
global batches; for each group a save_state/load_state round trip continues with the same next loss.
Later hardware groups add their entries to HARDWARE.
"""

from __future__ import annotations

import pytest
import rank_checks

pytestmark = pytest.mark.slow

HARDWARE = [
    "multi_gpu",
    "fsdp",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero3",
    "megatron_tp2",
    "megatron_tp2_sp",
]
PROCESSES = {"megatron_tp2_dp2": 4}
TOLERANCE = {"no": 1e-5, "bf16": 2e-2}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference, in this process (a process forked from this one, whose OpenMP threads already ran,
    would hang at its first parallel op)."""
    return {
        precision: rank_checks.matrix_run("cpu", precision, str(tmp_path_factory.mktemp(f"cpu-{precision}")))
        for precision in TOLERANCE
    }


@pytest.mark.parametrize("precision", list(TOLERANCE))
@pytest.mark.parametrize("hardware", [*HARDWARE, *PROCESSES])
def test_several_ranks_match_one_process(single_process, tmp_path, hardware, precision):
    result = rank_checks.run_ranks(
        rank_checks.matrix_run,
        hardware,
        precision,
        str(tmp_path / "ckpt"),
        num_processes=PROCESSES.get(hardware, 2),
    )[0]
    reference = single_process[precision]
    assert result["losses"][-1] < result["losses"][0]  # it learns
    for step, (ours, theirs) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert abs(ours - theirs) <= TOLERANCE[precision], (step, ours, theirs)
    assert result["after_load"] == result["continued"]  # the checkpoint restores the exact state


@pytest.mark.parametrize("precision", list(TOLERANCE))
def test_single_process_checkpoint_round_trip(single_process, precision):
    assert single_process[precision]["after_load"] == single_process[precision]["continued"]
