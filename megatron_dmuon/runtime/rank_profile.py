"""The start-up rank profile: the measurements the rank cost model (planning/rank_cost.py) is fitted
on, taken by timing the owner step itself (``ns_timing.time_owner_step``) on synthetic ranks, within
the start-up budget, cached on disk.

Balance 'milp' (``LayoutOptions.profile``) runs it on rank 0 of each pipeline stage (megatron/ddp.py). The points,
cheapest and most informative first (each new (shape, count) costs a kernel autotune, ~2 s on the
H200):

1. every piece shape the plan holds, one matrix (``ns|MxN|1``);
2. AdamW alone, one fragment of 10 M and of 100 M elements, and 100 M in 100 fragments (``adamw|...``);
3. every shape at an even share of its matrices over the owners (``ns|MxN|E``);
4. every shape together at that share, and each shape left out of it in turn (``multi|MxN:E|...``):
   the parts of each shape's stack that a step of several shapes does not pay again
   (planning/rank_cost.py). One pair of shapes, the format-1 profile, measured a constant that missed
   the H100's slowest 4-shape GPUs by -13%..-32% (a small stack is covered almost whole beside a
   large one, two large ones share ~1 ms); together at one matrix each too, where that differs;
5. the largest shape beside 100 M AdamW elements (``mix|...``: how much AdamW hides beside the NS);
6. every shape at the most matrices one rank is profiled at (``profile_counts``: ``ns|MxN|K``; at
   most ``MAX_ELEMENTS`` matrix elements in one step), then at half that.

A job whose budget runs out keeps what it measured; the MILP does not plan on a model missing a
shape or AdamW (planning/rank_milp.py keeps the greedy plan then, with a warning). The same points, named the same way, come from ``bench/rank_balance.py
calibrate``, whose denser grid checks the model (docs/load_balancing.md).
"""
from __future__ import annotations

import json
import math
import time
import warnings
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..planning.caches import ProfileCache, default_profile_cache_path
from ..planning.cost_model import device_spec_for, load_config, shape_key
from ..planning.rank_cost import RankCostModel, multi_name
from .muon_settings import MuonSettings
from .ns_timing import device_name, profile_meta, time_owner_step

__all__ = ["profile_counts", "profile_jobs", "measure_rank_jobs", "profiled_rank_model", "rank_profile_meta"]

Key = Tuple[int, int]
ADAMW_POINTS = ((10_000_000, 1), (100_000_000, 1), (100_000_000, 100))
MIX_ADAMW = 100_000_000
# the most matrix elements one profiled step holds (~9 GB of params, grads, momenta and stacks,
# taken while the model already sits on the GPU); past its last point a curve is extrapolated
MAX_ELEMENTS = 512 * 2**20


def _matrices(shape: Key, k: int) -> List[tuple]:
    return [(f"profile.{shape[0]}x{shape[1]}.{i}", shape, None) for i in range(k)]


def _fragments(elements: int, count: int) -> List[int]:
    small = 4096
    return [elements - (count - 1) * small] + [small] * (count - 1)


def profile_counts(counts, cells: int) -> Dict[Key, Tuple[int, int]]:
    """Per piece shape, (an even share over the ``cells`` owners, the most matrices the rank
    profile times on one rank). The most: twice the even share (greedy plans emulated on the H200
    gave one rank up to 1.7x it), or as many as cost the NS work of one matrix of the costliest
    shape, where more (a cost-balanced plan piles small matrices onto one rank: at DP 64 the H100's
    greedy gave one rank 8 of 56 512x3584 pieces, whose curve measured at 1 and 2 and extrapolated
    was 1.8x off); at most all of them."""
    def work(shape):  # NS work of an m x n piece, m <= n, grows as m^2 n
        m, n = shape_key(shape)
        return m * m * n

    costliest = max((work(s) for s in counts), default=1)
    out = {}
    for shape, n in counts.items():
        even = -(-n // max(1, cells))
        out[shape_key(shape)] = (min(n, even), min(n, max(2 * even, -(-costliest // work(shape)))))
    return out


def _multi_jobs(counts: Mapping[Key, int]) -> Dict[str, Tuple[List[tuple], List[int]]]:
    """Every shape together at ``counts`` and, past two shapes, each one left out in turn (with two,
    the one-shape steps are the stack points themselves)."""
    shapes = sorted(counts)
    if len(shapes) < 2:
        return {}
    sets = [shapes] + ([[s for s in shapes if s != out] for out in shapes] if len(shapes) > 2 else [])
    return {multi_name({s: counts[s] for s in group}): ([m for s in group for m in _matrices(s, counts[s])], [])
            for group in sets}


def profile_jobs(shape_counts: Mapping[Sequence[int], object]) -> Dict[str, Tuple[List[tuple], List[int]]]:
    """The start-up points, in measuring order: {name: (matrices, AdamW fragment sizes)}.
    ``shape_counts``: per shape (even share, most) as ``profile_counts`` gives, or the most alone
    (the even share is then half of it)."""
    counts, even = {}, {}
    for s, value in shape_counts.items():
        key = shape_key(s)
        share, most = value if isinstance(value, tuple) else (max(1, int(value) // 2), int(value))
        counts[key] = max(1, min(most, MAX_ELEMENTS // (key[0] * key[1])))
        even[key] = max(1, min(share, counts[key]))
    # the step of every shape holds one rank's share of each, scaled down to MAX_ELEMENTS together
    total = sum(k * s[0] * s[1] for s, k in even.items())
    if total > MAX_ELEMENTS:
        even = {s: max(1, k * MAX_ELEMENTS // total) for s, k in even.items()}
    by_size = sorted(counts, key=lambda s: -s[0] * s[0] * s[1])
    jobs: Dict[str, Tuple[List[tuple], List[int]]] = {}
    for s in sorted(counts):
        jobs[f"ns|{s[0]}x{s[1]}|1"] = (_matrices(s, 1), [])
    for elements, count in ADAMW_POINTS:
        jobs[f"adamw|{elements // 10**6}M|{count}"] = ([], _fragments(elements, count))
    for s in sorted(counts):
        jobs.setdefault(f"ns|{s[0]}x{s[1]}|{even[s]}", (_matrices(s, even[s]), []))
    jobs.update(_multi_jobs(even))
    if len(counts) > 1:  # and every shape at one matrix: the step of the most owners
        ones = {s: 1 for s in counts}
        jobs.setdefault(multi_name(ones), ([m for s in sorted(ones) for m in _matrices(s, 1)], []))
    if by_size:
        s = by_size[0]
        jobs[f"mix|{s[0]}x{s[1]}|1|{MIX_ADAMW // 10**6}M"] = (_matrices(s, 1), [MIX_ADAMW])
    for s in by_size:
        if counts[s] > 1:
            jobs.setdefault(f"ns|{s[0]}x{s[1]}|{counts[s]}", (_matrices(s, counts[s]), []))
    for s in by_size:
        half = counts[s] // 2
        if half > 1:
            jobs.setdefault(f"ns|{s[0]}x{s[1]}|{half}", (_matrices(s, half), []))
    return jobs


def measure_rank_jobs(jobs, time_fn: Callable[[List[tuple], List[int]], float], *, known: Optional[dict] = None,
                      budget_s: Optional[float] = None, clock: Callable[[], float] = time.perf_counter) -> dict:
    """{name: {"ms", "adamw_elements", "fragments"}} of ``jobs``: ``known`` ones as they are, the rest
    measured with ``time_fn(matrices, fragments) -> ms`` in order until ``budget_s`` is spent (the
    rest left out, with a warning)."""
    out = {name: dict(entry) for name, entry in (known or {}).items() if name in jobs}
    start = clock()
    todo = [name for name in jobs if name not in out]
    for n, name in enumerate(todo):
        if budget_s is not None and clock() - start > budget_s:
            warnings.warn(f"rank profile stopped after its {budget_s:g} s budget; {len(todo) - n} points left out "
                          "(the plan budget; a model missing a shape or AdamW plans greedily)", RuntimeWarning)
            break
        matrices, fragments = jobs[name]
        out[name] = {"ms": float(time_fn(matrices, fragments)), "adamw_elements": sum(fragments),
                     "fragments": len(fragments)}
    return out


def rank_profile_meta(settings: MuonSettings, device) -> dict:
    meta = profile_meta(settings, device)
    meta.update(kind="rank_profile", ns_launch=settings.ns_launch, momentum_dtype=str(settings.momentum_dtype))
    return meta


def profiled_rank_model(
    shape_counts: Mapping[Sequence[int], int],
    settings: Optional[MuonSettings] = None,
    device=None,
    *,
    cache_path=None,
    budget_s: float = 20.0,
    config_path=None,
    time_fn: Optional[Callable[[List[tuple], List[int]], float]] = None,
) -> RankCostModel:
    """The rank cost model of this GPU for a plan holding at most ``shape_counts[s]`` matrices of
    each piece shape on one rank: measured (or read from the cache) on CUDA, analytic elsewhere."""
    settings = settings or MuonSettings()
    config = load_config(config_path)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = device_spec_for(device_name(device), config, warn=device.type == "cuda")
    if device.type != "cuda" and time_fn is None:
        return RankCostModel.analytic(spec, settings.ns_steps, settings.ns_method, config)
    if time_fn is None:
        cold = [True]

        def time_fn(matrices, fragments):
            if cold[0]:  # the GPU's first steps ran ~30% slow (clocks, handles): one untimed run first
                cold[0] = False
                time_owner_step(matrices, fragments, settings, device=device, iters=1, warmup=1)
            return time_owner_step(matrices, fragments, settings, device=device)[0]
    meta = rank_profile_meta(settings, device)
    key = "|".join(f"{k}={meta[k]}" for k in sorted(meta))
    cache = ProfileCache(cache_path or default_profile_cache_path())
    known = cached_points(cache.get(key), meta, cache.path)
    jobs = profile_jobs(shape_counts)
    measured = measure_rank_jobs(jobs, time_fn, known=known, budget_s=budget_s)
    if set(measured) - set(known):
        cache.put(key, {"meta": meta, "jobs": {**known, **measured}})
    return RankCostModel.from_calibration({"jobs": measured, "device": meta["device"]}, device=spec)


def _valid_point(point) -> bool:
    return (isinstance(point, dict) and isinstance(point.get("ms"), (int, float)) and math.isfinite(point["ms"])
            and point["ms"] > 0 and all(isinstance(point.get(k), int) and point[k] >= 0
                                        for k in ("adamw_elements", "fragments")))


def cached_points(entry, meta: dict, path) -> dict:
    """The measured points of a cached rank profile; an entry damaged, or recorded under other
    settings than ``meta``, is measured again (with a warning) instead of planning on it."""
    if entry is None:
        return {}
    jobs = entry.get("jobs") if isinstance(entry, dict) else None
    if (isinstance(jobs, dict) and entry.get("meta") == json.loads(json.dumps(meta))
            and all(_valid_point(p) for p in jobs.values())):
        return jobs
    warnings.warn(f"the rank profile cached in {path} for {meta['device']} is damaged or was recorded under other "
                  "settings; measuring it again", RuntimeWarning)
    return {}
