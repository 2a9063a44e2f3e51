"""Timing of the owner step on this device: ``time_owner_step`` runs one synthetic rank's whole owner
step (its matrices' NS and its AdamW fragments) and returns the median ms; the start-up rank profile
(rank_profile.py) and bench/rank_balance.py time with it. ``profile_meta`` names the device,
software and NS settings a measurement belongs to (the cache key).
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from .owner_step import MuonSettings

__all__ = ["profile_meta", "device_name", "time_steps", "time_owner_step"]


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
                    tp_shards: Sequence[int] = (), team_blocks: Sequence[tuple] = ()):
    """(median ms, every timed ms) of one rank's owner step, as the job runs it: one
    ``OwnerMuonAdamW`` holding ``matrices`` (``(name, full shape, split rule or None)``, owned
    whole, TP = 1) and AdamW params of the sizes in ``fragments`` (its shards' element-wise
    pieces), timed with CUDA events around ``step()`` (``warmup`` untimed steps first: autotune,
    graph capture). Off CUDA it runs and times on the host (a smoke run; no timing claims).
    ``tp_shards``: element counts of a TP cell's shards of the matrices its DP row owns and
    another TP rank orthogonalizes; their momentum and apply run here too, inside the same
    events (``muon_momentum_`` then ``muon_apply_`` per shard, fp32, the direction standing in
    for the one the TP owner returns). ``team_blocks``: (rows, cols, first, end) of the team blocks
    homed here (planning/split_layout.py): each one's distributed Gram NS as one home computes it
    (``dp_exchange.team_orthogonalize``; the team's reductions are modelled, not timed). The start-up
    rank profile and bench/rank_balance.py's per-rank emulation time this."""
    from ..algorithms.muon import muon_apply_, muon_momentum_
    from .team_ns import team_orthogonalize
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
    resolver = settings.ns_resolver(device)
    blocks = [(torch.randn((min(r, c), (e - f)), device=device, generator=gen) * 1e-3,
               resolver.choice(r, c, 1, requested="gram")) for r, c, f, e in team_blocks]
    beta, nesterov = settings.momentum, settings.nesterov

    @torch.no_grad()
    def shard_passes():
        for p, momentum in shards:
            muon_apply_(p, muon_momentum_(momentum, p.grad, beta, nesterov), 1e-4, 0.1, 1.0)

    groups = ([{"params": muon, "use_muon": True}] if muon else []) + ([{"params": adamw, "use_muon": False}]
                                                                       if adamw else [])
    if not groups and not shards and not blocks:
        return 0.0, []
    opt = OwnerMuonAdamW(groups, lr=1e-4, weight_decay=0.1, muon=settings) if groups else None
    infos = [MatrixInfo(name, tuple(shape), rule) for name, shape, rule in matrices]
    for p, info in zip(muon, with_ns_choices(infos, settings, device) if infos else ()):
        opt.register_matrix(p, info)

    def step():
        if opt is not None:
            opt.step()
        shard_passes()
        for block, choice in blocks:
            team_orthogonalize(block, lambda t, op="sum": t, choice)
    times = time_steps(step, iters=iters, warmup=warmup, device=device)
    opt = None  # free the step's tensors before emptying the cache
    for held in (muon, adamw, shards, blocks):
        held.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), times
