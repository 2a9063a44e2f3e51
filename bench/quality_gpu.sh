#!/usr/bin/env bash
# bench/quality.py on one GPU machine (the device tool's H200): wheels, kernel warm-up, the quality
# runs and, beside them, bench/momentum_spectra.py on one run's real momenta. Results go to $OUT.
#   [RECORD=1] [GPU_TESTS="tests/..."] [ALSO="command"] bash bench/quality_gpu.sh MODEL BUDGET_S [quality.py flags...]
#   (carry .whl: the megatron-core and emerging_optimizers wheels for Python 3.12)
set -uo pipefail
MODEL="${1:?model}"; BUDGET="${2:?budget seconds}"; shift 2
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export DMUON_AUTOTUNE_CACHE=/tmp/dmuon_autotune.json PYTHONWARNINGS=ignore OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
flags=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import quality; print(' '.join(quality.MODELS['$MODEL']['flags']))")
# the kernels tune each product shape once (Triton compiles): do it before the runs share the GPU
t0=$(date +%s)
for method in auto standard gram; do
  python3 bench/harness.py --single -- --bf16 $flags --train-iters 3 --lr-warmup-iters 1 --eval-iters 0 \
    --dmuon-ns-method $method > "/tmp/warmup_$method.log" 2>&1 &
done
wait
echo "warm-up $(( $(date +%s) - t0 )) s"; grep -h "summary\|Error" /tmp/warmup_*.log | cut -c1-300
if [ "${RECORD:-0}" = 1 ]; then
  ( RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29391 \
      python3 bench/momentum_spectra.py record --out /tmp/spectra --at 50 400 --keep 1 --exact-every 25 -- \
      --bf16 $flags --train-iters "${RECORD_ITERS:-400}" --lr 3e-3 --min-lr 3e-4 --eval-iters 0 > /tmp/record.log 2>&1
    python3 bench/momentum_spectra.py evaluate /tmp/spectra/ns_inputs_it*.pt > "$OUT/momentum_spectra_$MODEL.txt" 2>&1
    cp /tmp/spectra/trace.json "$OUT/momentum_trace_$MODEL.json" ) &
fi
if [ -n "${ALSO:-}" ]; then  # another command beside the runs (e.g. a second quality.py), after the warm-up
  ( eval "$ALSO" > "$OUT/also.log" 2>&1 ) &
fi
if [ -n "${GPU_TESTS:-}" ]; then  # GPU tests beside the runs (correctness only; nothing here is timed)
  ( python3 -m pytest -q -p no:cacheprovider $GPU_TESTS > "$OUT/gpu_tests.log" 2>&1 ) &
fi
python3 bench/quality.py --model "$MODEL" --budget-s "$BUDGET" --out "$OUT/quality_$MODEL" --workdir /tmp/quality_runs \
  "$@" > "$OUT/quality_$MODEL.log" 2>&1
wait
tail -c 2000 /tmp/record.log 2>/dev/null | grep -v "^ iteration" | tail -3
grep -v "^\[" "$OUT/quality_$MODEL.log" | head -60
tail -5 "$OUT/gpu_tests.log" 2>/dev/null
