#!/usr/bin/env bash
# GPU checks for TP (run on the device from the repo root, 2 GPUs): NCCL verify at TP=2 (bf16 and
# fp32 with distributed Gram), DP=2 regression, the kernels' GPU tests. Results land in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
run_verify() {  # name, args...
  local name=$1; shift
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m megatron_dmuon.testing.verify_cli --json "$@" \
    > "$OUT/verify_$name.json" 2> "$OUT/verify_$name.err"
  echo "verify $name rc=$? $(python3 -c "import json,sys; d=json.loads([l for l in open('$OUT/verify_$name.json') if l.startswith('{')][-1]); print({k: d[k] for k in ('dp','tp','precision','max_rel_diff','tolerance','ok','each_matrix_once')})" 2>&1 | tail -1)"
}
run_verify tp2_bf16 --tp 2 --bf16
run_verify tp2_bf16_overlap --tp 2 --bf16 --overlap
run_verify tp2_fp32_dgram --tp 2 --precision fp32 --ns-method gram --tp-method distributed_gram
run_verify dp2_bf16 --dp 2 --bf16
timeout 150 python3 -m pytest -q tests/kernels/test_gpu.py 2>&1 | tail -3
