#!/usr/bin/env bash
# The GPU suite, one command (on the device tool's H200, from the repository root):
#   bash tests/gpu/run_h200.sh [pytest args]       # carry .te .whl .apex; results under $OUT (or /tmp/out)
# Runs tests/gpu (Transformer Engine layers, FP8, fused wgrad) and the kernel tests
# (tests/kernels/test_gpu.py) with -v; writes gpu_suite.log and gpu_suite.xml.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
source tests/gpu/setup_h200.sh
echo "setup $(( $(date +%s) - t0 )) s"
# TP = 1 throughout, so Megatron's single queue is not needed: several, so that side streams (the overlapped
# step's Newton-Schulz) really run beside the model's stream and a missing wait shows
export CUDA_DEVICE_MAX_CONNECTIONS=${MAX_CONNECTIONS:-8}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformer_engine as te, megatron.core as mc; print('torch', torch.__version__, '| TE', te.__version__, '| megatron-core', mc.__version__)"
python3 -m pytest -v -s -p no:cacheprovider -o addopts="" --junitxml="$OUT/gpu_suite.xml" tests/gpu tests/kernels/test_gpu.py tests/runtime/test_narrow_directions.py "$@" \
  2>&1 | tee "$OUT/gpu_suite.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E |worst|fp8 " | cut -c1-400
rc=${PIPESTATUS[0]}
echo "gpu suite rc $rc in $(( $(date +%s) - t0 )) s"
exit "$rc"
