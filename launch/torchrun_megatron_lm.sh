#!/usr/bin/env bash
# One node: Megatron-LM's pretrain_gpt.py with --optimizer dmuon under torchrun, one rank per GPU.
#
#   MEGATRON_LM=/path/to/Megatron-LM launch/torchrun_megatron_lm.sh RECIPE [Megatron-LM flags...]
#
# RECIPE: gpt_small | qwen2.5_7b (launch/recipes/). Extra flags are appended (later ones win), e.g.
# --tensor-model-parallel-size 2 --sequence-parallel --muon-tp-mode duplicated, --save DIR, --dmuon-*.
# GPUS_PER_NODE (a positive integer) defaults to every GPU nvidia-smi lists; see launch/megatron_lm_common.sh for DATA_PATH, NO_TE,
# DMUON_PATCH (the checkout's pretrain_gpt.py stays unmodified unless DMUON_PATCH=1).
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
RECIPE="$1"
shift
# GPUS_PER_NODE first, before the common part runs anything (DMUON_PATCH=1 patches the checkout)
gpus_error() { echo "launch: $*" >&2; exit 2; }
visible=""
if command -v nvidia-smi >/dev/null; then
  visible="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
fi
if [ -z "${GPUS_PER_NODE:-}" ]; then  # every GPU nvidia-smi lists
  [ -n "$visible" ] || gpus_error "nvidia-smi not found, so the GPUs cannot be counted: set GPUS_PER_NODE to the GPUs to use"
  [ "$visible" -ge 1 ] || gpus_error "nvidia-smi -L lists no GPU here: run on a GPU node, or set GPUS_PER_NODE"
  GPUS_PER_NODE="$visible"
fi
[[ "$GPUS_PER_NODE" =~ ^[0-9]+$ ]] && [ "$((10#$GPUS_PER_NODE))" -ge 1 ] \
  || gpus_error "GPUS_PER_NODE=$GPUS_PER_NODE must be a positive integer (the GPUs, one rank each, to use on this node)"
if [ -n "$visible" ] && [ "$((10#$GPUS_PER_NODE))" -gt "$visible" ]; then
  gpus_error "GPUS_PER_NODE=$GPUS_PER_NODE is more than the $visible GPUs nvidia-smi lists here"
fi
source "$(dirname "${BASH_SOURCE[0]}")/megatron_lm_common.sh"
exec torchrun --standalone --nnodes=1 --nproc-per-node="$GPUS_PER_NODE" \
  "${ENTRY[@]}" "${MEGATRON_ARGS[@]}" "$@"
