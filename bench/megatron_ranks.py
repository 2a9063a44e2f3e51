"""Megatron-LM's own optimizers, one GPU at a time, for bench/rank_balance.py's emulation: each GPU
of Megatron-LM main's LayerWise Muon (``megatron_layerwise``) and of Megatron's DistributedOptimizer
AdamW (``megatron_adamw``), with megatron-core's own optimizer classes where they run here.

What each GPU steps is read off the same layouts as DMuon's planners (planning/planners.py); what is
timed is the inner optimizer steps, as ``runtime.ns_timing.time_owner_step`` times DMuon's."""
from __future__ import annotations

import statistics

import torch

from megatron_dmuon.planning.models import stage_params
from megatron_dmuon.planning.planners import gpu_cells
from megatron_dmuon.runtime.ns_timing import time_steps


def even_shards(sizes, cells):
    """Megatron's DistributedOptimizer: the concatenation of ``sizes`` in ``cells`` equal shards
    (ceil); per shard, the fragment sizes where params meet (its 64-element alignment and bucket
    padding left out: < 0.1% of the elements here)."""
    total = sum(sizes)
    per = -(-total // cells) if total else 0
    out = []
    for c in range(cells):
        lo, hi, frags, at = c * per, min(total, (c + 1) * per), [], 0
        for n in sizes:
            a, b = max(lo, at), min(hi, at + n)
            if b > a:
                frags.append(b - a)
            at += n
        out.append(frags)
    return out


def adamw_work(model, par):
    """Per GPU: Megatron's DistributedOptimizer AdamW, every param of each buffer sharded evenly over
    its DP group (expert buffers over expert DP)."""
    if par.tp != 1:
        raise ValueError("Megatron's AdamW step is emulated at TP = 1 only")
    cells = {"dense": par.dp_size, "expert": par.expert_dp_size}
    shards = {kind: even_shards([p.numel for p in params], cells[kind]) if params else []
              for kind, params in stage_params(model, par).items()}
    return [([], [f for kind, per in shards.items() if per for f in per[gpu_cells(par, r)[kind]]])
            for r in range(par.dp_size)]


def megatron_layerwise_work(model, par, lpt_owned):
    """Per GPU of the stage, what Megatron-LM main's LayerWise Muon steps on it: (the matrices its
    owner rule gives the GPU, its element-wise AdamW shard sizes). ``lpt_owned``: per GPU, the
    matrices of the ``megatron_lpt`` plan (Megatron-LM main's LPT on max(m, n)·min(m, n)², PR #6379,
    within its buckets). AdamW: the params LayerWise does not manage sit in their own buffers,
    which Megatron's DistributedOptimizer shards evenly over DP (expert ones over expert DP)."""
    if par.tp != 1:
        raise ValueError("Megatron's LayerWise step is emulated at TP = 1 only")
    cells = {"dense": par.dp_size, "expert": par.expert_dp_size}
    shards = {kind: even_shards([p.numel for p in params if not p.is_matrix], cells[kind])
              for kind, params in stage_params(model, par).items()}
    return [(mats, [f for kind, per in shards.items() if per for f in per[gpu_cells(par, r)[kind]]])
            for r, mats in enumerate(lpt_owned)]


def megatron_muon_kwargs(model):
    """Megatron-LM main's `--optimizer muon` defaults for TensorParallelMuon (megatron-core's
    optimizer/emerging_optimizers.py through Emerging-Optimizers): quintic, 5 steps, fp32 matmul
    precision 'medium' (bf16 products), spectral scale, QKV split into Q, K, V."""
    from types import SimpleNamespace

    from megatron.core.optimizer.emerging_optimizers import _get_qkv_split_shapes

    shape_cfg = SimpleNamespace(num_attention_heads=model.heads, num_query_groups=model.groups,
                                kv_channels=model.head_dim)
    return dict(lr=1e-4, momentum=0.9, nesterov=False, weight_decay=0.1, split_qkv=True,
                is_qkv_fn=lambda p: getattr(p, "is_qkv", False), qkv_split_shapes=_get_qkv_split_shapes(shape_cfg),
                fp32_matmul_prec="medium", coefficient_type="quintic", num_ns_steps=5, scale_mode="spectral",
                tp_mode="blockwise")


def time_megatron_rank(mats, frags, model, *, iters=5, warmup=2, device="cuda", seed=0):
    """(median ms, every timed ms) of one GPU's step under Megatron-LM's LayerWise Muon, as its
    ChainedOptimizer runs it: Megatron's TensorParallelMuon (Emerging-Optimizers' NS, one matrix at
    a time) on the fp32 masters of the matrices the GPU owns, then AdamW on its element-wise shard
    (torch's fused AdamW, standing in for Transformer Engine's FusedAdam, which Megatron picks when
    TE imports), CUDA events around both. Same scope as ``time_owner_step``: the inner steps only,
    no master/model copies, no communication."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def param(shape, is_qkv=False):
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(shape, device=device, generator=gen) * 1e-3
        p.is_qkv = is_qkv
        return p

    muon = [param(tuple(shape), "linear_qkv" in name) for name, shape, _ in mats]
    adamw = [param((int(n),)) for n in frags]
    steps = []
    if muon:
        steps.append(TensorParallelMuon(muon, **megatron_muon_kwargs(model)).step)
    if adamw:
        steps.append(torch.optim.AdamW(adamw, lr=1e-4, weight_decay=0.1, fused=device.type == "cuda").step)
    if not steps:
        return 0.0, []
    times = time_steps(lambda: [step() for step in steps], iters=iters, warmup=warmup, device=device)
    for held in (steps, muon, adamw):  # free the step's tensors before emptying the cache
        held.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), times


def time_adamw_rank(frags, *, iters=5, warmup=2, device="cuda", seed=0):
    """(median ms, every timed ms) of one GPU's AdamW step on its shard's fragments (torch's fused
    AdamW, standing in for Transformer Engine's FusedAdam)."""
    return time_megatron_rank([], frags, None, iters=iters, warmup=warmup, device=device, seed=seed)
