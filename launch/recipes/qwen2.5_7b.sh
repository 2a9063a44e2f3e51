# shellcheck shell=bash
# A Qwen2.5-7B-shaped GPT: 28 layers, hidden 3584, FFN 18944, 28 heads / 4 KV groups, QKV bias,
# SwiGLU, RMSNorm (eps 1e-6), RoPE (base 1e6), seq 4096, 152,064 embedding rows (Qwen2.5-7B's).
# Sourced by launch/megatron_lm_common.sh; usual Megatron-LM flags, later flags override (e.g.
# --tensor-model-parallel-size 2 --sequence-parallel --muon-tp-mode duplicated).
RECIPE_VOCAB=152064  # NullTokenizer vocabulary of --mock-data runs (real data: the tokenizer's, padded)
RECIPE_ARGS=(
  --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944
  --num-attention-heads 28 --group-query-attention --num-query-groups 4 --kv-channels 128
  --seq-length 4096 --max-position-embeddings 32768
  --swiglu --normalization RMSNorm --norm-epsilon 1e-6
  --position-embedding-type rope --rotary-base 1000000
  --disable-bias-linear --add-qkv-bias --untie-embeddings-and-output-weights
  --micro-batch-size 1 --global-batch-size 512 --train-iters 50000
  --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)
