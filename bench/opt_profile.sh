#!/usr/bin/env bash
# Profile one optimizer step of the main job (bench/harness.py runs it; the Qwen2.5-7B-shaped
# 4-layer model of bench/e2e.py's qwen7b-4l preset) per optimizer setting, on one GPU:
#   bash bench/opt_profile.sh OUTDIR "adam" "dmuon --dmuon-coefficients adaptive --dmuon-ns-launch graph"
# writes OUTDIR/<n>.txt (progress lines + the kernel table of iteration 5's optimizer step) and
# OUTDIR/<n>.trace.json (Chrome trace).
set -euo pipefail
out=$1; shift
mkdir -p "$out"
n=0
for opt in "$@"; do
  n=$((n + 1))
  # shellcheck disable=SC2086
  python bench/harness.py --nproc 1 -- \
    --num-layers 4 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28 --num-query-groups 4 \
    --vocab-size 32000 --seq-length 4096 --micro-batch-size 1 --global-batch-size 4 --bf16 \
    --train-iters 6 --log-interval 1 --optimizer $opt \
    --profile-optimizer-at 5 --profile-out "$out/$n.trace.json" > "$out/$n.txt" 2>&1 || echo "run $n failed"
  echo "== $opt"; grep -E "^ iteration|Self CUDA time total" "$out/$n.txt" | tail -4
done
