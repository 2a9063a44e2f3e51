# shellcheck shell=bash
# A small GPT (~125M-class: 12 layers, hidden 768, GQA, SwiGLU, RMSNorm, RoPE) for smoke runs and
# tuning. Sourced by launch/megatron_lm_common.sh; usual Megatron-LM flags, later flags override.
RECIPE_VOCAB=32000  # NullTokenizer vocabulary of --mock-data runs (no DATA_PATH)
RECIPE_ARGS=(
  --num-layers 12 --hidden-size 768 --ffn-hidden-size 2048
  --num-attention-heads 12 --group-query-attention --num-query-groups 4
  --seq-length 2048 --max-position-embeddings 2048
  --swiglu --normalization RMSNorm --position-embedding-type rope
  --disable-bias-linear --untie-embeddings-and-output-weights
  --micro-batch-size 4 --global-batch-size 256 --train-iters 20000
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500
)
