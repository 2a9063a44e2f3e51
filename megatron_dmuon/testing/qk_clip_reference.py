"""The single-process reference's own QK-clip (MuonClip) and the max logits the tests plant.

`reference_qk_clip_` rescales a full (TP = 1) `linear_qkv` weight by its own reading of MuonClip
on Megatron's fused layout, written here from the definition and sharing no code with Megatron's
`Attention.clip_qk` or with `megatron/qk_clip.py`: per query group g, with m_g the largest max
logit of the group's heads, eta_g = min(1, threshold / m_g); the rows of g's query heads are
scaled by eta_g^alpha and the rows of its key head by eta_g^(1 - alpha), its value rows are left
alone. Megatron's fused weight lists, group after group, the group's query heads, then its key
head, then its value head (head_dim rows each).
"""
from __future__ import annotations

import torch

QKV = "self_attention.linear_qkv.weight"


def planted_max_logits(step: int, layer: int, dp_rank: int, heads: int, threshold: float) -> torch.Tensor:
    """float64 [heads] (every head of the model) for one (step, 0-based global layer, DP rank):
    between 0.1x and 1.25x the threshold (a query group of 2 heads over 2 ranks is clipped in
    about half the steps). float64, not TE's float32: Megatron computes the clip factors in the
    logits' dtype, and float32 powers differ in the last bit between its vectorized torch.pow
    and a scalar one, which Newton-Schulz amplifies past 1e-6 within a few steps; float64 factors
    agree to ~1e-16 and round to the same fp32 weights."""
    g = torch.Generator().manual_seed(7919 * step + 104729 * layer + 15485863 * dp_rank + 1)
    return threshold * (0.1 + 1.15 * torch.rand(heads, generator=g, dtype=torch.float64))


def reduced_max_logits(step: int, layer: int, dp: int, heads: int, threshold: float) -> torch.Tensor:
    """The max logits every rank holds after the MAX over the DP ranks."""
    return torch.stack([planted_max_logits(step, layer, r, heads, threshold) for r in range(dp)]).amax(0)


def qk_row_factors(max_logits: torch.Tensor, heads: int, groups: int, head_dim: int, threshold: float,
                   alpha: float) -> torch.Tensor:
    """float64 [(heads + 2 groups) x head_dim]: the factor of each row of a fused QKV weight."""
    per_group = heads // groups
    factors = []
    for g in range(groups):
        largest = max(float(x) for x in max_logits[g * per_group:(g + 1) * per_group])
        eta = min(1.0, threshold / largest)
        query, key, value = eta ** alpha, eta ** (1.0 - alpha), 1.0
        factors += [query] * (per_group * head_dim) + [key] * head_dim + [value] * head_dim
    return torch.tensor(factors, dtype=torch.float64)


def reference_qk_clip_(weight: torch.Tensor, max_logits, heads, groups, threshold, alpha) -> None:
    """Rescale the rows of a full fused QKV ``weight`` in place (see the module docstring)."""
    head_dim = weight.shape[0] // (heads + 2 * groups)
    factors = qk_row_factors(max_logits, heads, groups, head_dim, threshold, alpha)
    weight.mul_(factors.view(-1, 1))  # in float64, rounded to the weight's dtype (as Megatron's)


def reference_qk_clip_step(model_config, dp: int, threshold: float, alpha: float):
    """``after_step(step, params by name)`` of the reference: every layer's QKV weight clipped with
    the max logits a run of ``dp`` DP ranks reduces."""
    heads, groups = model_config.num_attention_heads, model_config.num_query_groups

    def after_step(step, params):
        for layer in range(model_config.num_layers):
            logits = reduced_max_logits(step, layer, dp, heads, threshold)
            reference_qk_clip_(params[f"decoder.layers.{layer}.{QKV}"], logits, heads, groups, threshold, alpha)

    return after_step
