#!/usr/bin/env bash
# The `hardware=xla` tests in their own environment: torch_xla 2.9 needs exactly torch 2.9 (the main
# environment has 2.13). Builds the venv once (about 4 GB from the package index, a few minutes), installs
# runner into it, and runs tests/test_tpu.py on XLA's CPU device (PJRT_DEVICE=CPU): one device, and SPMD
# over 2 (the tests set CPU_NUM_DEVICES).
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
