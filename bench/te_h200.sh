#!/usr/bin/env bash
# Transformer Engine measurements on one H200 (the device tool), from the repository root; each PART
# writes under $OUT and ends with one archive of its results (te_<part>.tgz). Carry .te .whl .mlm (.apex).
# MLM=DIR picks the Megatron-LM tree (default .mlm, patched; .mlm_core_v0.19.0 / .mlm_main are the unmodified
# trees: every Megatron-LM run goes through DMuon's launcher, megatron/run.py, so both serve).
#   bash bench/te_h200.sh suite+band timing  # in the order given; parts joined by '+' run at the same time
# Parts:
#   suite   the GPU suite (tests/gpu/run_h200.sh)
#   band    Megatron-LM's pretrain_gpt.py with TE layers, small model (4 x 1024), muon / muon_fp32ns / dmuon over
#           3 seeds in bf16, FP8 (hybrid, delayed) and FP8 with --fp8-param-gather (loss curves only)
#   timing_bf16, timing_fp8  the Qwen2.5-7B 4-layer shape, GBS 4: adam / muon / dmuon, one at a time
#   fp8pg   --fp8-param-gather on/off under Megatron's AdamW and DMuon (one seed); band_fp8x: FP8 band + dmuon_fp32ns
#   overlap_e2e, overlap_mlm  --dmuon-overlap-step off/sync/on beside AdamW (and Megatron's Muon) with comm overlap, Qwen 4-layer
#   e2e     bench/e2e.py (the main job, TE layers) at the Qwen 4-layer shape: adam / dmuon / megatron_layerwise
#   quality bench/quality.py small model with TE, 400 iterations, 3 seeds: AdamW, DMuon, Megatron's Muon; bf16, FP8
#   peer_metrics  peer's compare rows and metrics on/off in one compare, two seeds each (carry .whl_tb, .mlm_pr6683_overlay)
#   metrics the Qwen 4-layer comparison with DMuon's metrics (TensorBoard) on and off, 2 seeds each (carry .whl_tb)
#   gemm_probe  fp32 X X^T of a stack (bmm) against each matrix alone (mm): do they round alike?
#   rb_scale  [scale-past-matrices] every GPU under the whole and split layouts, LayerWise and AdamW, then the scale table
#   peer    [peer-best] Megatron-LM PR #6683's LayerShardedMuon beside the rest, one GPU: (a) the Qwen2.5-7B 4-layer shape,
#           GBS 4, 20 iterations, TE layers, one run at a time: adam / muon / dmuon on $MLM, muon_lsm (PR_RUNS: e.g.
#           "muon_lsm muon_lsm_syrk"; its SYRK autotunes ~1 min per shape before iteration 1) on $MLM_PR (default
#           .mlm_pr6683); (b) bench/ns_kernels_vs_eo.py: DMuon's NS paths vs Emerging-Optimizers' newton_schulz (+SYRK on
#           PEER_SYRK_SHAPES, default 12288x10240: its autotuning again) on every Muon shape of Qwen2.5-7B/32B. ~7 min on
#           an H100 with MLM=.mlm_main; carry .te .whl .mlm_main .mlm_pr6683_overlay (the PR's tree as its
#           difference from .mlm_main, rebuilt there: the two whole trees and .te pass 64 MiB) and .whl_eo040
#           (Emerging-Optimizers 0.4.0 for SYRK)
#   rb_cal, rb_startup, rb_emu  [balance-2, scale-emulation] bench/rank_balance.py: calibration grid, the start-up rank
#           profile + MILP per layout, every GPU's owner step emulated under greedy / numel LPT / Megatron's LPT / MILP,
#           and every GPU of Megatron-LM's LayerWise Muon and of its AdamW (TE not needed; carry .whl with megatron-core
#           and emerging_optimizers)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=/tmp/te_results; mkdir -p "$R"; started=$(date +%s)
source tests/gpu/setup_h200.sh > "$R/setup.log" 2>&1; tail -3 "$R/setup.log"; echo "set-up $(( $(date +%s) - started )) s"
# MAX_CONNECTIONS=N: CUDA's hardware work queues for every run (set-up's default is Megatron's 1, the overlap_* parts' 8; with one
# queue the kernels of different streams run in launch order, so no side stream overlaps the model's)
[ -n "${MAX_CONNECTIONS:-}" ] && export CUDA_DEVICE_MAX_CONNECTIONS=$MAX_CONNECTIONS && echo "CUDA_DEVICE_MAX_CONNECTIONS=$MAX_CONNECTIONS"
MLM=${MLM:-.mlm}
compare() {  # name, compare.py args...
  local name=$1; shift
  local t0=$(date +%s)
  python3 bench/megatron_lm_compare.py --megatron-lm "$MLM" --out "$R/$name" "$@" > "$R/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 )) s"; grep -v "^\\$\|^ \[\|iteration " "$R/$name.log" | grep "|\|vs\|failed" | tail -14 | cut -c1-260
}
tb_tags() {  # the dmuon/ names (and how many values each) of the TensorBoard event files dmuon_metrics runs wrote
  python3 - "${TMPDIR:-/tmp}/dmuon_metrics_tb" > "$R/metrics_tags.txt" 2>&1 <<'PY'
import glob, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
for path in sorted(glob.glob(sys.argv[1] + "/**/events.out.tfevents.*", recursive=True)):
    acc = EventAccumulator(path, size_guidance={"scalars": 0}); acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("dmuon/")]
    print(path, len(tags), "dmuon/ names:", {t: len(acc.Scalars(t)) for t in sorted(tags)})
PY
  echo "== metrics tags"; cut -c1-400 "$R/metrics_tags.txt"
}
run_part() {
  local part=$1 t0=$(date +%s)
  case $part in
    suite) bash tests/gpu/run_h200.sh > "$R/suite.log" 2>&1; echo "== suite rc=$?"; grep -E "FAILED|ERROR|passed|failed|worst|fp8 |rc " "$R/suite.log" | cut -c1-300
           cp "$OUT"/gpu_suite.* "$R/" 2>/dev/null ;;
    band)
      S="--model small --iters 30 --seeds 1234 2345 3456 --jobs ${JOBS:-6} --runs muon muon_fp32ns dmuon --timeout 400"
      compare band_bf16 $S
      compare band_fp8 $S --fp8-format hybrid --fp8-recipe delayed
      compare band_fp8pg $S --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather ;;
    fp8pg)  # --fp8-param-gather against the same run without it, under Megatron's DistributedOptimizer+AdamW and DMuon
      P="--model small --iters 30 --seeds 1234 --jobs 4 --runs adam dmuon --timeout 400 --fp8-format hybrid --fp8-recipe delayed"
      compare fp8pg_off $P
      compare fp8pg_on $P --fp8-param-gather
      grep -h "DMuon FP8 params\|fp8_param_gather \.\." "$R"/fp8pg_on/dmuon.log | head -3 ;;
    band_s3456)  # the bf16 seed whose muon run met a rebuild of Apex's extension
      compare band_bf16_s3456 --model small --iters 30 --seeds 3456 --jobs 3 --runs muon muon_fp32ns dmuon --timeout 400 ;;
    timing_bf16|timing_fp8)  # one run at a time (timed)
      T="--model qwen7b-4l --iters 20 --runs adam muon dmuon --timeout 300"
      [ "$part" = timing_fp8 ] && T="$T --fp8-format hybrid --fp8-recipe delayed"
      compare "$part" $T --extra --global-batch-size 4 ;;
    band_fp8x)  # the FP8 band again with DMuon's fp32-NS curve as a further reference pair
      compare band_fp8x --model small --iters 30 --seeds 1234 2345 3456 --jobs ${JOBS:-6} --timeout 400 \
        --runs muon muon_fp32ns dmuon dmuon_fp32ns --fp8-format hybrid --fp8-recipe delayed ;;
    overlap_*) export CUDA_DEVICE_MAX_CONNECTIONS=${MAX_CONNECTIONS:-8} ;;&  # then the part itself: 'on' needs several hardware queues, and every row of the part runs under the same
    overlap_e2e)  # --dmuon-overlap-step: the main job (TE layers) at the Qwen 4-layer shape, comm overlap on for all rows
      # OMODES: the modes (default off/sync/on eagerly launched); OEXTRA: more main-job flags; OTAG: the files' tag
      python3 bench/e2e.py --preset qwen7b-4l --iters ${OITERS:-16} --repeat ${OREPEAT:-1} --modes ${OMODES:-adam dmuon dmuon^sync dmuon^on} \
        --out "$R/overlap_e2e${OTAG:-}.json" --extra --global-batch-size 4 --overlap-grad-reduce --overlap-param-gather ${OEXTRA:-} \
        > "$R/overlap_e2e${OTAG:-}.log" 2>&1; echo "== overlap_e2e${OTAG:-} rc=$?"; grep "^|" "$R/overlap_e2e${OTAG:-}.log" ;;
    overlap_profile)  # the main job under --dmuon-overlap-step on (CUDA-graph NS), iterations 8 and 9 whole under torch.profiler
      $(python3 bench/e2e.py --preset qwen7b-4l --print-command "${OPMODE:-dmuon~graph^on}" --extra --train-iters 10 \
        --log-interval 1 --global-batch-size 4 --overlap-grad-reduce --overlap-param-gather ${OEXTRA:-} \
        --profile-optimizer-at 8 --profile-iterations 2 --profile-out "$R/overlap_profile.trace.json") \
        > "$R/overlap_profile.log" 2>&1; echo "== overlap_profile rc=$?"; grep -E "iteration +[0-9]+/|dmuon\\.|Self CUDA time" "$R/overlap_profile.log" | cut -c1-220
      gzip -f "$R/overlap_profile.trace.json" ;;
    overlap_mlm)  # the same in Megatron-LM's loop (log every 10 iterations: its timers sync the device when they log);
      # ORUNS: megatron_lm_compare.py's runs, OEXTRA_MLM: more Megatron-LM flags for every run (e.g. --clip-grad 0)
      compare overlap_mlm --model qwen7b-4l --iters ${OITERS_MLM:-40} --runs ${ORUNS:-adam_ogp muon_ogp dmuon_ogp dmuon_overlap_sync dmuon_overlap} \
        --timeout 300 --extra --global-batch-size 4 --log-interval 10 ${OEXTRA_MLM:-} ;;
    metrics)  # [metrics] the Qwen 4-layer comparison (GBS 4) with DMuon's metrics on (Megatron's TensorBoard writer,
      # carry .whl_tb: tensorboard and what its writer imports) and off, two seeds each, one run at a time; then the
      # dmuon/ names the event files hold (TensorBoard's own reader)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl_tb/*.whl \
        > "$R/tb_install.log" 2>&1; echo "== tensorboard wheels rc=$?"
      rm -rf "${TMPDIR:-/tmp}/dmuon_metrics_tb"
      compare metrics_onoff --model qwen7b-4l --iters ${MITERS:-12} --runs dmuon dmuon_metrics --seeds 1234 2345 \
        --timeout 300 --extra --global-batch-size 4
      tb_tags ;;
    peer)  # [peer-best] see the header; PEER_ITERS, PEER_SHAPES (default all), PEER_REPS; PEER_BUDGET (s, default 380):
      # the kernel table starts no shape past it (the shapes left are rows that say so: rerun them with PEER_SHAPES)
      local runs="adam muon ${PR_RUNS:-muon_lsm} dmuon" for_pr=() r pr=${MLM_PR:-.mlm_pr6683}
      if [ ! -d "$pr" ] && [ -d .mlm_pr6683_overlay ]; then  # the PR's tree as its difference from $MLM (bench/tree_overlay.py)
        python3 bench/tree_overlay.py apply --base "$MLM" --overlay .mlm_pr6683_overlay --out /tmp/mlm_pr6683 && pr=/tmp/mlm_pr6683
      fi
      for r in ${PR_RUNS:-muon_lsm}; do for_pr+=(--megatron-lm-for "$r=$pr"); done
      python3 -c "import emerging_optimizers as e; print('Emerging-Optimizers', e.__version__)" 2>/dev/null || echo "Emerging-Optimizers: not importable"
      compare peer_compare --model qwen7b-4l --iters ${PEER_ITERS:-20} --runs $runs "${for_pr[@]}" --timeout 300 \
        --extra --global-batch-size 4
      local t1=$(date +%s)
      python3 bench/ns_kernels_vs_eo.py --device cuda --shapes ${PEER_SHAPES:-all} --syrk-shapes ${PEER_SYRK_SHAPES:-12288x10240} \
        --reps ${PEER_REPS:-10} --warmup 3 --stop-after-s $(( ${PEER_BUDGET:-380} - (t1 - t0) - 40 )) \
        --out-dir "$R/peer_kernels" > "$R/peer_kernels.log" 2>&1
      echo "== peer_kernels rc=$? $(( $(date +%s) - t1 )) s"; cat "$R/peer_kernels/ns_kernels_vs_eo.md" 2>/dev/null | cut -c1-220
      grep -h "Error" "$R/peer_kernels.log" | tail -3 ;;
    peer_metrics)  # [peer-best] + [metrics] in one compare when device time is short: adam, Megatron main's Muon, PR #6683's
      # (muon_lsm), DMuon, and DMuon with its metrics on (TensorBoard), each at two seeds (the run-to-run spread)
      local pr=${MLM_PR:-.mlm_pr6683}
      if [ ! -d "$pr" ] && [ -d .mlm_pr6683_overlay ]; then
        python3 bench/tree_overlay.py apply --base "$MLM" --overlay .mlm_pr6683_overlay --out /tmp/mlm_pr6683 && pr=/tmp/mlm_pr6683
      fi
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl_tb/*.whl \
        > "$R/tb_install.log" 2>&1; echo "== tensorboard wheels rc=$?"
      rm -rf "${TMPDIR:-/tmp}/dmuon_metrics_tb"
      compare peer_metrics --model qwen7b-4l --iters ${PM_ITERS:-15} --runs adam muon muon_lsm dmuon dmuon_metrics \
        --megatron-lm-for "muon_lsm=$pr" --seeds 1234 2345 --timeout 300 --extra --global-batch-size 4
      tb_tags ;;
    e2e) python3 bench/e2e.py --preset qwen7b-4l --iters 12 --modes adam dmuon megatron_layerwise \
           --extra --global-batch-size 4 > "$R/e2e.log" 2>&1; echo "== e2e rc=$?"; grep "^|" "$R/e2e.log" ;;
    quality)  # QSEEDS (default 1 2 3), QROWS (phase-2 rows, ';' between), QRESUME=PREFIX: PREFIX_{bf16,fp8}.json's runs are reused
      local rows=${QROWS:-}; [ -n "$rows" ] || rows="Megatron's own*"; local -a rowlist; IFS=';' read -ra rowlist <<< "$rows"
      Q=(--model small --iters 400 --seeds ${QSEEDS:-1 2 3} --adam-lrs 1e-3 --dmuon-lrs 3e-3 --jobs 9 --rows "${rowlist[@]}")
      for prec in bf16 fp8; do
        F=(); [ "$prec" = fp8 ] && F=(--fp8-format hybrid)
        [ -n "${QRESUME:-}" ] && F+=(--resume "${QRESUME}_$prec.json")
        python3 bench/quality.py "${Q[@]}" "${F[@]}" --workdir /tmp/q_$prec --out "$R/quality_te_$prec" > "$R/quality_$prec.log" 2>&1
        echo "== quality $prec rc=$?"; grep "^| " "$R/quality_te_$prec.md" | head -7
      done ;;
    gemm_probe)  # does cuBLAS round a stack of small fp32 GEMMs (bmm) as it rounds each alone (mm)?
      python3 - <<'PY'
import torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
for shape in [(2, 4, 64), (8, 64, 64), (4, 160, 64)]:
    x = torch.randn(*shape, device="cuda")
    stacked = x @ x.mT
    alone = torch.stack([m @ m.T for m in x])
    print(f"gemm probe {shape}: X X^T stacked vs alone, max |diff| {float((stacked - alone).abs().max()):.3e}")
PY
      ;;
    bridge)  # Megatron-Bridge 0.6.2's own loop (bench/bridge.py): DMuon vs Bridge's Muon; carry .bridge_whl too
      # (made here by launch/bridge/h200_wheels.sh)
      # into a folder of their own, then merged: pip --target --upgrade would replace $SITE/megatron (megatron-core)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_bridge .bridge_whl/*.whl \
        > "$R/bridge_install.log" 2>&1; echo "== bridge wheels rc=$?"; tail -2 "$R/bridge_install.log"
      cp -r --update=none /tmp/site_bridge/. "$SITE/"
      # Bridge's initialize runs `make` in megatron/core/datasets, which the wheel ships prebuilt without a Makefile
      D="$SITE/megatron/core/datasets"; [ -f "$D/Makefile" ] || printf 'default:\n\t@ls helpers_cpp*.so\n' > "$D/Makefile"
      BRIDGE_LITE=1 python3 bench/bridge.py compare --out-dir "$R/bridge" --stages ${BSTAGES:-sanity resume timing band} \
        --timing-optimizers ${BTIMING:-muon dmuon adam} \
        --band-models ${BMODELS:-small small_moe} --band-iters ${BITERS:-40} --jobs ${BJOBS:-6} > "$R/bridge.log" 2>&1; echo "== bridge rc=$?"
      cat "$R/bridge/bridge.md"; grep -h "failed\|Error" "$R/bridge.log" | head -20 ;;
    rb_cal|rb_startup|rb_emu)  # [balance-2] bench/rank_balance.py: RB_LAYOUTS (default: every layout of the issue but TP),
      # RB_PLANS (emulate), RB_ROUNDS; the autotune cache is $DMUON_AUTOTUNE_CACHE (carry .rb_autotune.json to reuse one:
      # RB_AUTOTUNE=.rb_autotune.json); rb_emu plans milp on rb_startup's models ($R/rb_startup.json, or RB_START=FILE)
      L=${RB_LAYOUTS:-qwen7b-4l/dp2/buckets qwen7b-4l/dp4/buckets qwen2.5-7b/dp8/buckets qwen2.5-7b/dp8/one qwen2.5-7b/dp16/buckets qwen2.5-7b/dp16/one qwen2.5-7b/dp32/one qwen2.5-7b/dp64/buckets qwen2.5-7b/dp64/one qwen2.5-7b/dp128/one qwen2.5-7b/dp256/one qwen2.5-32b/dp64/one qwen3-moe-8l/dp8/ep4/one qwen2.5-7b/tp2/dp4/buckets}
      [ -n "${RB_AUTOTUNE:-}" ] && [ -f "$RB_AUTOTUNE" ] && cp "$RB_AUTOTUNE" "$DMUON_AUTOTUNE_CACHE"
      case $part in
        rb_cal) python3 bench/rank_balance.py calibrate --layouts $L --rounds ${RB_ROUNDS:-2} --out "$R/rb_cal" > "$R/rb_cal.log" 2>&1 ;;
        rb_startup) python3 bench/rank_balance.py startup --layouts $L --cache-dir "$R/rb_cache" --out "$R/rb_startup" > "$R/rb_startup.log" 2>&1 ;;
        rb_emu) python3 bench/rank_balance.py emulate --layouts $L --plans ${RB_PLANS:-greedy numel_lpt megatron_lpt milp megatron_layerwise megatron_adamw} \
                  --rank-profile "${RB_START:-$R/rb_startup.json}" --rounds ${RB_ROUNDS:-3} --out "$R/rb_emu${RB_TAG:-}" > "$R/rb_emu${RB_TAG:-}.log" 2>&1 ;;
      esac
      echo "== $part rc=$?"; tail -25 "$R/$part${RB_TAG:-}.md" 2>/dev/null; cp "$DMUON_AUTOTUNE_CACHE" "$R/rb_autotune.json" 2>/dev/null ;;
    rb_layouts)  # [scale-emulation] per layout, in order: the start-up profile + MILP (startup), then every GPU emulated
      # under RB_PLANS (default: DMuon's four planners and Megatron's LayerWise Muon and AdamW), each layout's files kept as
      # it ends; no new layout starts after RB_STOP seconds of the part (default 420)
      local stop=$(( $(date +%s) + ${RB_STOP:-420} )) spec name
      [ -n "${RB_AUTOTUNE:-}" ] && [ -f "$RB_AUTOTUNE" ] && cp "$RB_AUTOTUNE" "$DMUON_AUTOTUNE_CACHE"
      for spec in ${RB_LAYOUTS:-qwen2.5-7b/dp8/one qwen2.5-7b/dp64/one qwen7b-4l/dp2/buckets qwen3-moe-8l/dp8/ep4/one}; do
        [ "$(date +%s)" -ge "$stop" ] && { echo "== rb_layouts: stopped before $spec"; break; }
        name=${spec//\//_}
        python3 bench/rank_balance.py startup --layouts "$spec" --cache-dir "$R/rb_cache" --out "$R/start_$name" > "$R/start_$name.log" 2>&1
        echo "== startup $spec rc=$? $(grep -o '"profile_s": [0-9.]*, "plan_s": [0-9.]*' "$R/start_$name.log" | tail -1)"
        python3 bench/rank_balance.py emulate --layouts "$spec" --plans ${RB_PLANS:-greedy numel_lpt megatron_lpt milp megatron_layerwise megatron_adamw} \
          --rank-profile "$R/start_$name.json" --rounds ${RB_ROUNDS:-3} --iters ${RB_ITERS:-3} --warmup ${RB_WARMUP:-1} \
          --out "$R/emu_$name" > "$R/emu_$name.log" 2>&1
        echo "== emulate $spec rc=$?"; grep "^| [a-z_]* | \*\*" "$R/emu_$name.md" 2>/dev/null | cut -c1-120; grep -h "Error" "$R/emu_$name.log" | tail -2
      done
      cp "$DMUON_AUTOTUNE_CACHE" "$R/rb_autotune.json" 2>/dev/null ;;
    rb_scale)  # [scale-past-matrices] every GPU of RB_LAYOUTS emulated under the whole-matrix greedy and the split
      # layout (RB_PLANS: also Megatron's LayerWise Muon and AdamW; RB_FLAGS: the main job's dmuon flags), one layout at a time, each layout's files kept as it
      # ends, none started after RB_STOP seconds (default 480); then the scale table of what ran (bench/rank_scale.py)
      local stop=$(( $(date +%s) + ${RB_STOP:-480} )) spec name
      for spec in ${RB_LAYOUTS:-qwen2.5-7b/dp128/buckets qwen2.5-7b/dp1024/buckets qwen2.5-32b/dp1024/buckets}; do
        [ "$(date +%s)" -ge "$stop" ] && { echo "== rb_scale: stopped before $spec"; break; }
        name=${spec//\//_}
        python3 bench/rank_balance.py emulate --layouts "$spec" --plans ${RB_PLANS:-greedy split megatron_layerwise megatron_adamw} \
          ${RB_FLAGS:+--flags="$RB_FLAGS"} --rounds ${RB_ROUNDS:-2} --iters ${RB_ITERS:-3} --warmup ${RB_WARMUP:-1} --out "$R/emu_$name" > "$R/emu_$name.log" 2>&1
        echo "== emulate $spec rc=$? $(( $(date +%s) - t0 )) s"; grep "^| [a-z_]* | \*\*" "$R/emu_$name.md" 2>/dev/null | cut -c1-140
        grep -h "Error" "$R/emu_$name.log" | tail -2
      done
      ls "$R"/emu_*.json >/dev/null 2>&1 && python3 bench/rank_balance.py scale --emulation "$R"/emu_*.json \
        ${RB_FLAGS:+--flags="$RB_FLAGS"} --out "$R/scale_h200_links" > "$R/scale.log" 2>&1; echo "== scale rc=$?"
      cat "$R/scale_h200_links.md" 2>/dev/null
      cp "$DMUON_AUTOTUNE_CACHE" "$R/rb_autotune.json" 2>/dev/null ;;
    *) echo "unknown part $part" ;;
  esac
  echo "== part $part: $(( $(date +%s) - t0 )) s"
}
# DEADLINE=S (seconds from the start, set-up included): parts still running then are stopped, and what they
# wrote is archived
export -f run_part compare tb_tags; export R OUT MLM
end=$(( started + ${DEADLINE:-100000} ))
for group in "$@"; do
  pids=()
  for part in ${group//+/ }; do setsid bash -c "run_part $part" > "$R/part_$part.out" 2>&1 & pids+=($!); done
  alive() { for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }
  while alive && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && { echo "== stopped at the deadline: pid $pid"; kill -- -"$pid"; }; done
  wait
  for part in ${group//+/ }; do cat "$R/part_$part.out"; done
  tar -czf "$OUT/te_${group//+/_}.tgz" --exclude=./bridge/ckpt -C "$R" . 2>/dev/null  # (not Bridge's checkpoints: GBs)
done
