"""Start-up profile of the owner step's NS calls (a measured ``CostTable``), and the start-up budget
that profiling and the owner MILP share.

``measure_profile`` times each distinct matrix shape at batch sizes 1..B with a timer it is given
(the real one, runtime/ns_timing.py, runs the owner step's own orthogonalizer on the GPU; tests
pass a fake), a few repeats each, within a time budget, and returns a ``CostTable``. Profiles are
cached per (device, dtype, torch/triton versions, NS settings): the next start measures nothing.
A corrupt cache file, or one written by another format version, is ignored with a warning and
rebuilt; a cached profile whose settings differ from the key it is stored under, or that lacks a
requested (shape, batch), is measured again with a warning.

The caches themselves (``ProfileCache``, and ``PlanCache`` for finished owner plans) are
planning/caches.py's.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .caches import ProfileCache
from .cost_model import CostTable, shape_key

__all__ = ["profile_key", "profile_batches", "measure_profile", "STARTUP_BUDGET_S", "profile_budget",
           "milp_time_limit"]

META_KEYS = ("device", "dtype", "torch", "triton", "steps", "coefficients", "ns_method")


def profile_key(meta: Dict[str, object]) -> str:
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"profile meta lacks {', '.join(missing)}")
    return "|".join(f"{k}={meta[k]}" for k in META_KEYS)


def profile_batches(max_batch: int) -> List[int]:
    """1 and ``max_batch``: the cost model is linear in the batch (launch + per matrix), and each
    new (shape, batch) costs a kernel autotune (~2 s on the H200), so two points per shape keep the
    first start inside its budget (H200: the line through 1 and 8 predicts 2, 3, 4 within 11%)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return sorted({1, max_batch})


STARTUP_BUDGET_S = 30.0  # profiling + MILP at start-up, rank 0 of each pipeline stage
PROFILE_SHARE = 2.0 / 3.0  # of that budget; the MILP gets what profiling left (>= MIN_MILP_S)
MIN_MILP_S = 1.0


def profile_budget(startup_budget_s: float = STARTUP_BUDGET_S) -> float:
    return startup_budget_s * PROFILE_SHARE


def milp_time_limit(startup_budget_s: float, spent_s: float, requested_s: Optional[float] = None) -> float:
    """The MILP's time limit: what the start-up budget has left after profiling (never above a
    requested limit, never below MIN_MILP_S; the MILP keeps its greedy start when time runs out)."""
    left = max(MIN_MILP_S, startup_budget_s - spent_s)
    return left if requested_s is None else min(requested_s, left)


def _covers(table: CostTable, shapes, batches) -> List[Tuple[Tuple[int, int], int]]:
    """The (shape, batch) pairs the table lacks."""
    have = {(key, k) for key, pts in table.points.items() for k, _ in pts}
    return [(s, b) for s in shapes for b in batches if (s, b) not in have]


def measure_profile(
    shapes: Iterable[Sequence[int]],
    max_batch: int,
    time_fn: Callable[[Tuple[int, int], int, int], float],
    meta: Dict[str, object],
    *,
    repeats: int = 3,
    cache: Optional[ProfileCache] = None,
    budget_s: Optional[float] = None,
    clock: Callable[[], float] = time.perf_counter,
) -> CostTable:
    """A profile of every shape at ``profile_batches(max_batch)``: from ``cache`` when it holds
    them, else measured with ``time_fn(shape, batch, repeats) -> ms`` (shape as (m, n), m <= n)
    and stored. Stops measuring (with a warning) once ``budget_s`` is spent: the shapes left out
    are then predicted by the analytic model."""
    shapes = sorted({shape_key(s) for s in shapes})
    batches = profile_batches(max_batch)
    key = profile_key(meta)
    meta = {k: meta[k] for k in META_KEYS}
    table = None
    if cache is not None:
        entry = cache.get(key)
        if entry is not None:
            try:
                table = CostTable.from_json(entry)
                if {k: table.meta.get(k) for k in META_KEYS} != meta:
                    warnings.warn(f"{cache.label} {cache.path}: the profile stored under {key} was measured with "
                                  f"{table.meta}; measuring again", RuntimeWarning)
                    table = None
            except (KeyError, TypeError, ValueError) as exc:
                warnings.warn(f"{cache.label} {cache.path}: the profile stored under {key} is corrupt ({exc}); "
                              "measuring again", RuntimeWarning)
                table = None
    if table is None:
        table = CostTable(meta=dict(meta, source="profile"), points={})
    todo = _covers(table, shapes, batches)
    if table.points and todo:
        warnings.warn(f"NS profile {key} lacks {len(todo)} (shape, batch) points; measuring them", RuntimeWarning)
    start = clock()
    measured = 0
    for shape, batch in todo:
        if budget_s is not None and clock() - start > budget_s:
            warnings.warn(f"NS profiling stopped after its {budget_s:g} s budget; {len(todo) - measured} "
                          "(shape, batch) points left to the analytic cost model", RuntimeWarning)
            break
        ms = float(time_fn(shape, batch, repeats))
        table.add(shape, batch, ms)
        measured += 1
    if cache is not None and measured:
        cache.put(key, table.to_json())
    return table
