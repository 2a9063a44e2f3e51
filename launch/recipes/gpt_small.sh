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
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
  --micro-batch-size 4 --global-batch-size 256 --train-iters 20000
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 500
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  --muon-momentum 0.95 --muon-nesterov --muon-scale-mode spectral --muon-extra-scale-factor 0.2
  --bf16 --log-interval 10 --eval-interval 1000 --eval-iters 10
)
