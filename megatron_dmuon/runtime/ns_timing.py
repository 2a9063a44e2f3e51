"""Start-up NS profile on the real GPU: the owner step's own orthogonalizer, timed per shape and
batch size, cached on disk (planning/caches.py), turned into the planner's ``CostModel``.

Run on the one rank that plans (megatron/layout.py plans on rank 0 of the stage and broadcasts).
"""
from __future__ import annotations

import statistics
import time
from typing import Iterable, Optional, Sequence

import torch

from ..planning.caches import ProfileCache, default_profile_cache_path
from ..planning.cost_model import CostModel, device_spec_for, load_config
from ..planning.startup_profile import measure_profile
from .owner_step import MuonSettings, default_orthogonalizer

__all__ = ["profile_meta", "cuda_ns_timer", "profiled_cost_model", "device_name", "time_owner_step"]


def device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def profile_meta(settings: MuonSettings, device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": device_name(device), "dtype": str(settings.ns_dtype).replace("torch.", ""),
            "torch": torch.__version__, "triton": triton_version, "steps": settings.ns_steps,
            "coefficients": settings.coefficients, "ns_method": settings.ns_method}


def cuda_ns_timer(settings: MuonSettings, device, input_dtype: torch.dtype = torch.float32):
    """``time_fn(shape, batch, repeats) -> ms`` of one batched call of the owner step's NS."""
    from ..kernels.autotune import time_cuda_ms

    orth = default_orthogonalizer(settings)
    gen = torch.Generator(device=device).manual_seed(0)

    def time_fn(shape, batch, repeats):
        x = torch.randn(batch, *shape, device=device, dtype=input_dtype, generator=gen)
        ms = time_cuda_ms(lambda: orth(x), target_ms=0.0, min_reps=repeats, max_reps=repeats)
        del x
        return ms

    return time_fn


def profiled_cost_model(
    shapes: Iterable[Sequence[int]],
    max_batch: int,
    settings: Optional[MuonSettings] = None,
    device=None,
    *,
    cache_path=None,
    repeats: int = 3,
    budget_s: float = 20.0,
    config_path=None,
) -> CostModel:
    """Profile (or load from the cache) every shape at batch sizes 1..``max_batch`` on ``device``
    and return the cost model built on it. On CPU, or without CUDA, the analytic model."""
    settings = settings or MuonSettings()
    config = load_config(config_path)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    name = device_name(device)
    spec = device_spec_for(name, config, warn=device.type == "cuda")
    if device.type != "cuda":
        return CostModel(spec, None, settings.ns_steps, settings.ns_method)
    cache = ProfileCache(cache_path or default_profile_cache_path())
    table = measure_profile(shapes, max_batch, cuda_ns_timer(settings, device), profile_meta(settings, device),
                            repeats=repeats, cache=cache, budget_s=budget_s)
    return CostModel(spec, table, settings.ns_steps, settings.ns_method)


def time_steps(step, *, iters: int, warmup: int, device) -> list:
    """ms of each of ``iters`` calls of ``step()`` after ``warmup`` untimed ones: CUDA events around
    each call on CUDA (synchronised before and after), the host clock elsewhere."""
    device = torch.device(device)
    times = []
    for it in range(warmup + iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            begin.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            ms = begin.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            step()
            ms = (time.perf_counter() - t0) * 1e3
        if it >= warmup:
            times.append(ms)
    return times


def time_owner_step(matrices: Sequence[tuple], fragments: Sequence[int], settings: MuonSettings, *,
                    iters: int = 5, warmup: int = 2, device="cuda", seed: int = 0,
                    tp_shards: Sequence[int] = ()):
    """(median ms, every timed ms) of one rank's owner step, as the job runs it: one
    ``OwnerMuonAdamW`` holding ``matrices`` (``(name, full shape, split rule or None)``, owned
    whole, TP = 1) and AdamW params of the sizes in ``fragments`` (its shards' element-wise
    pieces), timed with CUDA events around ``step()`` (``warmup`` untimed steps first: autotune,
    graph capture). Off CUDA it runs and times on the host (a smoke run; no timing claims).
    ``tp_shards``: element counts of a TP cell's shards of the matrices its DP row owns and
    another TP rank orthogonalizes; their momentum and apply run here too, inside the same
    events (``muon_momentum_`` then ``muon_apply_`` per shard, fp32, the direction standing in
    for the one the TP owner returns). The start-up rank profile and bench/rank_balance.py's
    per-rank emulation time this."""
    from ..algorithms.muon import muon_apply_, muon_momentum_
    from .owner_step import MatrixInfo, OwnerMuonAdamW, with_ns_choices

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def param(shape):
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(shape, device=device, generator=gen) * 1e-3
        return p

    muon = [param(tuple(shape)) for _, shape, _ in matrices]
    adamw = [param((int(n),)) for n in fragments]
    shards = [(param((int(n),)), torch.zeros(int(n), device=device)) for n in tp_shards]
    beta, nesterov = settings.momentum, settings.nesterov

    @torch.no_grad()
    def shard_passes():
        for p, momentum in shards:
            muon_apply_(p, muon_momentum_(momentum, p.grad, beta, nesterov), 1e-4, 0.1, 1.0)

    groups = ([{"params": muon, "use_muon": True}] if muon else []) + ([{"params": adamw, "use_muon": False}]
                                                                       if adamw else [])
    if not groups and not shards:
        return 0.0, []
    opt = OwnerMuonAdamW(groups, lr=1e-4, weight_decay=0.1, muon=settings) if groups else None
    infos = [MatrixInfo(name, tuple(shape), rule) for name, shape, rule in matrices]
    for p, info in zip(muon, with_ns_choices(infos, settings, device) if infos else ()):
        opt.register_matrix(p, info)

    def step():
        if opt is not None:
            opt.step()
        shard_passes()
    times = time_steps(step, iters=iters, warmup=warmup, device=device)
    opt = None  # free the step's tensors before emptying the cache
    for held in (muon, adamw, shards):
        held.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), times
