"""MuonClip (`--qk-clip`) under DMuon on gloo ranks, and the reference's own QK-clip.

Without Transformer Engine nothing records attention logits, so each step every layer is given
planted per-head max logits (`planted_max_logits`: some heads above the threshold, some below,
different per step, layer and DP rank, so Megatron's MAX all-reduce over DP matters), then the
run's QK-clip runs after the optimizer step, where Megatron-LM's training loop runs it.

`reference_qk_clip_` rescales a full (TP = 1) `linear_qkv` weight by its own reading of
MuonClip on Megatron's fused layout, written here from the definition and sharing no code with
Megatron's `Attention.clip_qk` or with `megatron/qk_clip.py`: per query group g, with m_g the
largest max logit of the group's heads, eta_g = min(1, threshold / m_g); the rows of g's query
heads are scaled by eta_g^alpha and the rows of its key head by eta_g^(1 - alpha), its value rows
are left alone. Megatron's fused weight lists, group after group, the group's query heads, then its
key head, then its value head (head_dim rows each).
"""
from __future__ import annotations

import types

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


def _layers(chunk):
    return chunk.module.decoder.layers


def plant_max_logits(chunks, step: int, threshold: float) -> None:
    """What TE's attention records in a forward: this TP rank's heads' max logits, every layer."""
    from megatron.core import parallel_state as ps

    dp_rank, tp_rank = ps.get_data_parallel_rank(), ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        heads = chunk.config.num_attention_heads
        for layer in _layers(chunk):
            attention = layer.self_attention
            local = attention.num_attention_heads_per_partition
            full = planted_max_logits(step, layer.layer_number - 1, dp_rank, heads, threshold)
            attention.core_attention.current_max_attn_logits = full[tp_rank * local:(tp_rank + 1) * local].clone()


def _megatron_path(chunks):
    """The chunks as Megatron's clip_qk walks them (chunk.module.module.decoder: DDP, Float16Module,
    model); this harness has no Float16Module."""
    return [types.SimpleNamespace(module=types.SimpleNamespace(module=chunk.module)) for chunk in chunks]


def _qk_clip_config(threshold, alpha):
    return dict(qk_clip=True, qk_clip_threshold=threshold, qk_clip_alpha=alpha)


def _train_with_qk_clip(rank, threshold, alpha, **kw):
    """One DMuon run with MuonClip after every step (megatron/qk_clip.clip_qk): the usual report
    and the max logit clip_qk returned per step."""
    from megatron_dmuon.megatron.qk_clip import clip_qk
    from megatron_dmuon.testing.workers import _build, _finish_overlap, _report, _train

    run = _build(config_kw=_qk_clip_config(threshold, alpha), **kw)
    max_logits = []

    def after_step(step):
        plant_max_logits(run.chunks, step, threshold)
        max_logits.append(clip_qk(run.chunks))

    trained = _train(run, range(run.o["steps"]), after_step=after_step)
    _finish_overlap(run)
    return {**_report(run, rank, trained, []), "max_logits": max_logits}


def qk_clip_world(rank, world_size, threshold=1.0, alpha=0.5, runs=None, bf16=None):
    """Every DP-only QK-clip case in one gloo world: ``runs`` {name: workers._build kwargs} trained
    with MuonClip (fp32), ``bf16`` (kwargs of `bf16_masters`) the bf16 master check."""
    from megatron_dmuon.testing.workers import init_parallel

    init_parallel()
    out = {name: _train_with_qk_clip(rank, threshold, alpha, **kw) for name, kw in (runs or {}).items()}
    if bf16 is not None:
        out["bf16"] = bf16_masters(threshold=threshold, alpha=alpha, **bf16)
    return out


def _qkv_weights(run):
    return [(layer.layer_number - 1, layer.self_attention.linear_qkv.weight) for layer in _layers(run.chunks[0])]


def bf16_masters(threshold=1.0, alpha=0.5, steps=2, **kw):
    """bf16 params, DP only: after ``steps`` steps, one QK-clip through megatron/qk_clip.clip_qk, then
    one through Megatron's own clip_qk on a fresh set of logits. Reports, per layer, whether this
    rank owns the QKV master and how the master and the weight changed against the reference's
    factors; and what Megatron's own clip_qk raised."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.qk_clip import clip_qk as megatron_clip_qk

    from megatron_dmuon.megatron.qk_clip import clip_qk
    from megatron_dmuon.testing.workers import _build, _finish_overlap, _train

    run = _build(shape_kw=dict(bf16=True), config_kw=_qk_clip_config(threshold, alpha), steps=steps, **kw)
    _train(run, range(steps))
    _finish_overlap(run)
    config, dp = run.chunks[0].config, ps.get_data_parallel_world_size()
    heads, groups = config.num_attention_heads, config.num_query_groups
    before = {layer: (w.main_param, None if w.main_param is None else w.main_param.detach().clone(),
                      w.detach().clone()) for layer, w in _qkv_weights(run)}
    plant_max_logits(run.chunks, steps, threshold)
    clip_qk(run.chunks)
    out = {"layers": {}}
    for layer, w in _qkv_weights(run):
        master_obj, master, weight = before[layer]
        logits = reduced_max_logits(steps, layer, dp, heads, threshold)
        expected_weight = weight.clone()
        reference_qk_clip_(expected_weight, logits, heads, groups, threshold, alpha)
        entry = {"owner": master is not None, "main_param_restored": w.main_param is master_obj,
                 "weight_exact": torch.equal(w.detach(), expected_weight),
                 "clipped_rows": int((qk_row_factors(logits, heads, groups, w.shape[0] // (heads + 2 * groups),
                                                     threshold, alpha) < 1).sum())}
        if master is not None:
            expected = master.view(w.shape).clone()
            reference_qk_clip_(expected, logits, heads, groups, threshold, alpha)
            got = w.main_param.detach().view(w.shape)
            entry["master_rel_err"] = float((got - expected).norm() / expected.norm())
            entry["master_changed"] = float((got - master.view(w.shape)).norm() / master.norm())
        out["layers"][layer] = entry
    # Megatron's own clip_qk on DMuon's bf16 weights (what --qk-clip did before megatron/qk_clip.py)
    plant_max_logits(run.chunks, steps + 1, threshold)
    try:
        megatron_clip_qk(_megatron_path(run.chunks))
        out["megatron_error"] = None
    except Exception as e:  # noqa: BLE001 (the test reads which error each rank met)
        out["megatron_error"] = f"{type(e).__name__}: {e}"
    return out
