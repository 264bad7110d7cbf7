#!/usr/bin/env bash
# The GPU checks in one call, for a lent machine with one CUDA GPU and the packages that torch's CUDA image
# holds: the CUDA tests (tests/gpu), then the compiled throughput rows of benchmarks/gpu_throughput.py.
# Each part has a time limit, so that one lease gives both; logs go to $OUT (else ./gpu-out).
# Packages the image lacks travel as wheels in .whl/ (ignored by git), made on the development machine:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl hydra-core==1.3.2 \
#       omegaconf==2.3.0 pydantic==2.13.4 pydantic_core==2.46.4 typing-inspection==0.4.2 \
#       annotated-types==0.7.0 hjson==3.1.0 torchao==0.18.0
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
#   DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
#
#   bash .ci/gpu.sh [TEST_SECONDS] [BENCHMARK_SECONDS] [BENCHMARK_MODES] [ROUNDS] [BATCH]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, torchao, deepspeed; print('torch', torch.__version__, 'torchao', torchao.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee -a "$out/device.txt"
start=$(date +%s)
timeout "${1:-200}" python3 -m pytest -m cuda tests/gpu -n 4 --dist load -p no:cacheprovider -q 2>&1 | tee "$out/tests.log" | tail -40
echo "tests/gpu took $(( $(date +%s) - start )) s"
modes=${3:-plain-compiled,plain-compiled-aa,runner-compiled,cli-compiled,cli-reduce-overhead,cli-regional,cli-fp8}
start=$(date +%s)
timeout "${2:-300}" python3 benchmarks/gpu_throughput.py --modes "$modes" --rounds "${4:-2}" --batch "${5:-8}" --steps 100 --warmup 20 \
    2>&1 | tee "$out/throughput.log"
echo "gpu_throughput took $(( $(date +%s) - start )) s"
