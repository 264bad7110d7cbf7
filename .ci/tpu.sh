#!/usr/bin/env bash
# The `hardware=xla` tests in their own environment: torch_xla 2.9 needs exactly torch 2.9 (the main
# environment has 2.13). Builds the venv once (about 4 GB from the package index, a few minutes), installs
# runner into it, and runs tests/test_tpu.py on XLA's CPU device (PJRT_DEVICE=CPU): one device, and SPMD
# over 2 (the tests set CPU_NUM_DEVICES). torch 2.9 is also the oldest torch pyproject.toml admits: the
# smoke subset below (the private names' checks, the default run, 2-rank DDP and FSDP, stop signals and
# resume, a restart in the job, a Ctrl-C) runs on it too, about 2 minutes.
#
#   bash .ci/tpu.sh            # venv at $RUNNER_TPU_ENV (default /tmp/runner-tpu-env)
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=${RUNNER_TPU_ENV:-/tmp/runner-tpu-env}
if [ ! -x "$env_dir/bin/python" ] || ! "$env_dir/bin/python" -c "import torch_xla" 2>/dev/null; then
    echo "tpu.sh: building $env_dir (torch 2.9.0 + torch_xla 2.9.0)"
    python -m venv "$env_dir"
    "$env_dir/bin/pip" install -q torch==2.9.0 torch_xla==2.9.0
fi
"$env_dir/bin/pip" uninstall -q -y runner 2>/dev/null || true  # the distribution's name before runner-ml
"$env_dir/bin/pip" install -q -e ".[test,tpu]"
PJRT_DEVICE=CPU "$env_dir/bin/python" -m pytest tests/test_tpu.py -p no:cacheprovider
"$env_dir/bin/python" -m pytest -p no:cacheprovider -q \
    tests/test_torch_internals.py \
    tests/test_checkpoint.py::test_an_optimizer_from_yaml_saves_a_state_that_loads \
    tests/test_cli.py::test_default_experiment_trains_and_leaves_config_and_log \
    tests/test_launch.py::test_two_ranks_write_one_job_dir \
    tests/test_launch.py::test_fsdp_shards_gpt_blocks_in_bf16_and_saves_full_weights \
    tests/test_launch.py::test_collective_timeout_and_the_shutdown_grace_are_configurable \
    tests/test_launch.py::test_restarts_are_not_spent_on_a_failure_that_a_restart_would_repeat \
    tests/test_resume.py::test_a_stop_signal_checkpoints_exits_75_and_a_rerun_finishes_identically \
    tests/test_resume.py::test_a_ctrl_c_in_a_terminal_counts_once_in_every_rank \
    tests/test_resume.py::test_a_rank_killed_mid_run_is_restarted_in_the_job_and_finishes_identically \
    tests/test_context_parallel.py::test_context_parallel_from_the_command_line_trains_as_one_process
