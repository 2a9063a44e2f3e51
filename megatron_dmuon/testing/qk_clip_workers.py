"""MuonClip (`--qk-clip`) under DMuon on gloo ranks (tests/megatron/test_qk_clip.py).

Without Transformer Engine nothing records attention logits, so each step every layer is given
planted per-head max logits (`qk_clip_reference.planted_max_logits`: some heads above the
threshold, some below, different per step, layer and DP rank, so Megatron's MAX all-reduce over
DP matters), then the run's QK-clip runs after the optimizer step, where Megatron-LM's training
loop runs it. The reference's own QK-clip is in testing/qk_clip_reference.py.
"""
from __future__ import annotations

import types

import torch

from .qk_clip_reference import planted_max_logits, qk_row_factors, reduced_max_logits, reference_qk_clip_


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


def qk_clip_world(rank, world_size, threshold=1.0, alpha=0.5, runs=None, bf16=None, recorder=False):
    """Every DP-only QK-clip case in one gloo world: ``runs`` {name: workers._build kwargs} trained
    with MuonClip (fp32), ``bf16`` (kwargs of `bf16_masters`) the bf16 master check, ``recorder``
    the check of the local attention's max-logit recorder (last: it patches megatron-core)."""
    from megatron_dmuon.testing.workers import init_parallel

    init_parallel()
    out = {name: _train_with_qk_clip(rank, threshold, alpha, **kw) for name, kw in (runs or {}).items()}
    if bf16 is not None:
        out["bf16"] = bf16_masters(threshold=threshold, alpha=alpha, **bf16)
    if recorder:
        out["recorder"] = recorded_max_logits(seed=rank)
    return out


def recorded_max_logits(seed=0, heads=4, groups=2, head_dim=16, sq=8, batch=3):
    """testing/local_max_logits on megatron-core's local DotProductAttention: what it records per
    head against logits computed here from q and k, over two forwards (a running max) with the
    causal mask built by the softmax, then one with a given mask; and whether the attention's
    output is the unrecorded attention's."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from . import local_max_logits

    local_max_logits.install()
    kw = dict(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, num_query_groups=groups,
              kv_channels=head_dim, attention_dropout=0.0, masked_softmax_fusion=False)
    recorded = DotProductAttention(TransformerConfig(**kw, qk_clip=True), 1, AttnMaskType.causal, "self")
    plain = DotProductAttention(TransformerConfig(**kw), 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(sq, sq, dtype=torch.bool).triu(1)
    given = causal | (torch.rand(batch, 1, sq, sq, generator=g) < 0.3)  # some more positions masked
    given[..., 0] = False  # every query keeps a key
    expected, errors, outputs_equal = None, [], []
    for step, mask in enumerate([None, None, given]):
        q = torch.randn(sq, batch, heads, head_dim, generator=g) * (3.0 if step == 1 else 1.0)
        k, v = (torch.randn(sq, batch, groups, head_dim, generator=g) for _ in range(2))
        out = recorded(q, k, v, mask)
        outputs_equal.append(torch.equal(out, plain(q, k, v, mask)))
        logits = torch.einsum("sbhd,tbhd->bhst", q, k.repeat_interleave(heads // groups, dim=2)) / head_dim ** 0.5
        logits = logits.masked_fill(causal if mask is None else mask, float("-inf")).amax(dim=(0, 2, 3))
        expected = logits if expected is None else torch.maximum(expected, logits)
        errors.append(float((recorded.current_max_attn_logits - expected).abs().max()))
    return {"errors": errors, "outputs_equal": outputs_equal, "unrecorded": getattr(plain, "current_max_attn_logits", None),
            "shape": list(recorded.current_max_attn_logits.shape)}


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
