# shellcheck shell=bash
# Sourced by launch/torchrun_megatron_lm.sh and the Slurm scripts: everything a Megatron-LM
# `pretrain_gpt.py --optimizer dmuon` launch shares. Needs RECIPE (a file of launch/recipes/) and
# MEGATRON_LM (a Megatron-LM checkout, tag core_v0.19.0). Optional: DATA_PATH (+ TOKENIZER_MODEL,
# TOKENIZER_TYPE) for real data instead of --mock-data; NO_TE=1 for a machine without Transformer
# Engine (local layers, fusions off); with TE, Megatron-LM's --gradient-accumulation-fusion stays on where
# Apex's fused_weight_gradient_mlp_cuda imports (GRAD_ACCUM_FUSION=1: always, 0: never). Defines MEGATRON_ARGS (shared training flags, recipe, data,
# optimizer flags) and ENTRY (the script torchrun runs).
DMUON_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# every variable this file (and its callers) read is checked before anything runs: one line naming it, exit 2
launch_error() { echo "launch: $*" >&2; exit 2; }
need_positive_int() {  # NAME VALUE WHAT
  [[ "$2" =~ ^[0-9]+$ ]] && [ "$((10#$2))" -ge 1 ] \
    || launch_error "$1=$2 must be a positive integer ($3)"
}
need_choice() {  # NAME VALUE CHOICES...
  local name="$1" value="$2"; shift 2
  local c; for c in "$@"; do [ "$value" = "$c" ] && return 0; done
  launch_error "$name=$value must be one of: $*"
}
need_choice NO_TE "${NO_TE:-0}" 0 1
need_choice DMUON_PATCH "${DMUON_PATCH:-0}" 0 1
need_choice GRAD_ACCUM_FUSION "${GRAD_ACCUM_FUSION:-auto}" auto 0 1
[ -z "${CUDA_DEVICE_MAX_CONNECTIONS:-}" ] \
  || need_positive_int CUDA_DEVICE_MAX_CONNECTIONS "$CUDA_DEVICE_MAX_CONNECTIONS" "hardware queues per GPU; 1 is Megatron-LM's"
[ -z "${TORCH_NCCL_ASYNC_ERROR_HANDLING:-}" ] || need_choice TORCH_NCCL_ASYNC_ERROR_HANDLING \
  "$TORCH_NCCL_ASYNC_ERROR_HANDLING" 0 1 2 3
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (git clone NVIDIA/Megatron-LM; git checkout core_v0.19.0)}"
: "${RECIPE:?set RECIPE to one of: $(cd "$DMUON_REPO/launch/recipes" && ls ./*.sh | sed 's#^\./##; s/\.sh$//' | tr '\n' ' ')}"
recipe_file="$DMUON_REPO/launch/recipes/$RECIPE.sh"
{ [[ "$RECIPE" =~ ^[A-Za-z0-9_.-]+$ ]] && [[ "$RECIPE" != *..* ]] && [ -f "$recipe_file" ]; } \
  || { echo "unknown RECIPE '$RECIPE' (no $recipe_file)" >&2; exit 1; }
if [ -n "${DATA_PATH:-}" ]; then
  { [ -f "$DATA_PATH.bin" ] && [ -f "$DATA_PATH.idx" ]; } \
    || launch_error "DATA_PATH=$DATA_PATH: no $DATA_PATH.bin and .idx (give a Megatron indexed dataset's path prefix)"
fi
# shellcheck disable=SC1090
source "$recipe_file"

# ENTRY: what torchrun runs. By default the unmodified pretrain_gpt.py through the launcher that installs
# the hook first (megatron_dmuon/megatron/run.py); DMUON_PATCH=1 patches the checkout instead (idempotent).
if [ "${DMUON_PATCH:-0}" = 1 ]; then
  bash "$DMUON_REPO/patches/apply.sh" "$MEGATRON_LM" >&2
  ENTRY=("$MEGATRON_LM/pretrain_gpt.py")
else
  [ -f "$MEGATRON_LM/pretrain_gpt.py" ] || { echo "MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py" >&2; exit 1; }
  [ -d "$MEGATRON_LM/megatron/training" ] \
    || { echo "MEGATRON_LM=$MEGATRON_LM has no megatron/training/: give a Megatron-LM checkout" >&2; exit 1; }
  ENTRY=(-m megatron_dmuon.megatron.run "$MEGATRON_LM/pretrain_gpt.py")
fi
export PYTHONPATH="$DMUON_REPO:$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"
# Megatron-LM's convention (TP/CP communication overlap on Hopper needs one hardware queue); export 8
# before launching with --dmuon-overlap-step on, which needs the queues (it is refused under 1)
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# NCCL: keep NVLink multicast (NVLS) off; the rest are the usual Megatron settings, override per site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"

if [ -n "${DATA_PATH:-}" ]; then
  DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0
             --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}"
             --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL (e.g. Qwen/Qwen2.5-7B) with DATA_PATH}")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$RECIPE_VOCAB")
fi
LOCAL_ARGS=()
if [ "${NO_TE:-0}" = 1 ]; then
  LOCAL_ARGS=(--transformer-impl local --attention-backend unfused --no-rope-fusion --no-bias-swiglu-fusion
              --no-bias-dropout-fusion --no-persist-layer-norm --no-gradient-accumulation-fusion
              --no-masked-softmax-fusion)
elif [ "${GRAD_ACCUM_FUSION:-auto}" = auto ] && ! python3 -c "import torch, fused_weight_gradient_mlp_cuda" >/dev/null 2>&1; then
  # Megatron-LM's default --gradient-accumulation-fusion needs Apex's extension for its non-TE output layer
  echo "launch: Apex's fused_weight_gradient_mlp_cuda does not import here: --no-gradient-accumulation-fusion" \
       "(build it with launch/build_apex_wgrad.sh, or set GRAD_ACCUM_FUSION=1 to keep Megatron-LM's default)" >&2
  LOCAL_ARGS=(--no-gradient-accumulation-fusion)
elif [ "${GRAD_ACCUM_FUSION:-auto}" = 0 ]; then
  LOCAL_ARGS=(--no-gradient-accumulation-fusion)
fi
# shared by the recipes (which may override any of it): bf16, no dropout, AdamW hyperparameters, and
# Muon with --muon-scale-mode spectral x --muon-extra-scale-factor 0.2, which gives Muon updates the
# RMS of AdamW's (Moonlight), so one learning rate serves both
TRAINING_ARGS=(--bf16 --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
               --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
               --muon-momentum 0.95 --muon-nesterov --muon-scale-mode spectral --muon-extra-scale-factor 0.2
               --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 10)
OPTIMIZER_ARGS=(--optimizer dmuon --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
MEGATRON_ARGS=("${TRAINING_ARGS[@]}" "${RECIPE_ARGS[@]}" "${DATA_ARGS[@]}" "${LOCAL_ARGS[@]}" "${OPTIMIZER_ARGS[@]}")
