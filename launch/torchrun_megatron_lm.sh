#!/usr/bin/env bash
# One node: Megatron-LM's pretrain_gpt.py with --optimizer dmuon under torchrun, one rank per GPU.
#
#   MEGATRON_LM=/path/to/Megatron-LM launch/torchrun_megatron_lm.sh RECIPE [Megatron-LM flags...]
#
# RECIPE: gpt_small | qwen2.5_7b (launch/recipes/). Extra flags are appended (later ones win), e.g.
# --tensor-model-parallel-size 2 --sequence-parallel --muon-tp-mode duplicated, --save DIR, --dmuon-*.
# GPUS_PER_NODE defaults to every visible GPU; see launch/megatron_lm_common.sh for DATA_PATH, NO_TE,
# DMUON_PATCH (the checkout's pretrain_gpt.py stays unmodified unless DMUON_PATCH=1).
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,9p' "$0" >&2; exit 2; }
RECIPE="$1"
shift
source "$(dirname "${BASH_SOURCE[0]}")/megatron_lm_common.sh"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}"
exec torchrun --standalone --nnodes=1 --nproc-per-node="$GPUS_PER_NODE" \
  "${ENTRY[@]}" "${MEGATRON_ARGS[@]}" "$@"
