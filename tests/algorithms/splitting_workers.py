"""Rank function for tests/algorithms/test_splitting.py: real megatron-core layers on gloo TP ranks.

Each layer's linear weights come from Megatron's own CPU initialisation: the master weight is
filled with a known ``arange`` pattern and split over TP ranks with the layer's
``partition_stride``. The function reports what every rank holds and what Megatron computes
from it, so the parent test can check our split functions against Megatron's real layout.
"""
from __future__ import annotations

import torch


def arange_init(weight: torch.Tensor) -> None:
    """Known master values: entry (r, c) = r * cols + c (exact in float32 for small shapes)."""
    with torch.no_grad():
        weight.copy_(torch.arange(weight.numel(), dtype=weight.dtype).reshape(weight.shape))


def _config(tp, hidden, heads, groups, ffn, gated_attention):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, gated_linear_unit=True, activation_func=F.silu,
        attention_output_gate=gated_attention, normalization="RMSNorm", add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, init_method=arange_init, output_layer_init_method=arange_init,
    )


def layer_layouts(rank, world_size, hidden=32, heads=8, groups=2, ffn=24):
    """For gated_attention in (False, True): this TP rank's linear_qkv / linear_fc1 weights,
    their partition strides, Megatron's q, k, v (, gate) for an identity input (so
    q[s, 0, h, d] = W_q[h*hd + d, s]) and our split rule's piece shapes for the real config."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from megatron_dmuon.algorithms.splitting import rule_for_megatron_param

    parallel_state.initialize_model_parallel(world_size, 1)
    model_parallel_cuda_manual_seed(1234)
    out = {}
    for gated in (False, True):
        config = _config(world_size, hidden, heads, groups, ffn, gated)
        layer = build_module(get_gpt_layer_local_spec(normalization="RMSNorm"), config=config, layer_number=1)
        attn = layer.self_attention
        identity = torch.eye(hidden).unsqueeze(1)  # [sq=hidden, b=1, hidden]
        with torch.no_grad():
            tensors = attn.get_query_key_value_tensors(identity, None, output_gate=gated)
        names = ["q", "k", "v", "gate"] if gated else ["q", "k", "v"]
        qkv_rows = (heads + 2 * groups + (heads if gated else 0)) * (hidden // heads)
        rule = rule_for_megatron_param(
            "decoder.layers.0.self_attention.linear_qkv.weight", (qkv_rows, hidden), config,
            split_qkv=True, qkv_per_head=True)
        out[gated] = {
            "qkv_weight": attn.linear_qkv.weight.detach().clone(),
            "qkv_stride": int(getattr(attn.linear_qkv.weight, "partition_stride", 1)),
            "qkv_out": {n: t.detach().clone() for n, t in zip(names, tensors)},
            "fc1_weight": layer.mlp.linear_fc1.weight.detach().clone(),
            "fc1_stride": int(getattr(layer.mlp.linear_fc1.weight, "partition_stride", 1)),
            "rule_piece_shapes": rule.piece_shapes((qkv_rows, hidden)),
        }
    return out
