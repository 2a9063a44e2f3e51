"""The owner-assignment problem the MILP solves, and what needs no solver: a plan's loads and
objective, the lower bound, the batch-aware greedy and MULTIFIT plans (its warm starts).

Pure data and arithmetic; the model is described in planning/milp.py."""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

from .placement import least_loaded_cell


@dataclasses.dataclass(frozen=True)
class OwnerProblem:
    per_matrix: Sequence[float]
    numel: Sequence[int]  # elements counted against the owner's shard (aligned by the caller)
    group: Sequence[str]
    bucket: Sequence[int]
    launch: Dict[str, float]  # fixed cost per group per cell holding it (missing: 0)
    dp_size: int
    tp_size: int = 1
    shard_min: Sequence[int] = ()  # per bucket; empty: no capacity constraint
    shard_max: Sequence[int] = ()
    slack: int = 0
    base: Optional[Sequence[float]] = None  # load already on each cell
    padding_weight: float = 0.0  # cost per element of shard growth on each DP rank

    @property
    def cells(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def num_buckets(self) -> int:
        return len(self.shard_min)

    def base_loads(self) -> List[float]:
        return list(self.base) if self.base is not None else [0.0] * self.cells

    def check(self) -> None:
        n = len(self.per_matrix)
        if not (len(self.numel) == len(self.group) == len(self.bucket) == n):
            raise ValueError("per_matrix, numel, group and bucket must have one entry per item")
        if self.dp_size < 1 or self.tp_size < 1:
            raise ValueError(f"dp_size and tp_size must be >= 1, got {self.dp_size}, {self.tp_size}")
        if len(self.shard_max) != len(self.shard_min):
            raise ValueError("shard_min and shard_max need one entry per bucket")
        if self.shard_min and any(not 0 <= b < len(self.shard_min) for b in self.bucket):
            raise ValueError("an item's bucket is out of range")
        if any(lo > hi for lo, hi in zip(self.shard_min, self.shard_max)):
            raise ValueError("shard_min must not exceed shard_max")
        if self.base is not None and len(self.base) != self.cells:
            raise ValueError(f"base has {len(self.base)} entries, expected dp_size x tp_size = {self.cells}")
        if any(c < 0 for c in self.per_matrix) or any(a < 0 for a in self.launch.values()):
            raise ValueError("costs must be >= 0")


@dataclasses.dataclass
class OwnerSolution:
    cells: List[int]  # cell (dp * tp_size + tp) of each item
    objective: float
    makespan: float
    loads: List[float]
    padding: int  # elements of shard growth summed over buckets and DP ranks
    lower_bound: float
    backend: str  # 'cbc' | 'highs' | 'greedy'
    status: str  # 'optimal' | 'feasible' (time limit) | 'greedy'
    seconds: float
    note: str = ""


def loads_of(problem: OwnerProblem, cells: Sequence[int]) -> List[float]:
    """Per-cell load: base + per-matrix costs + one launch per group present."""
    loads = problem.base_loads()
    seen = set()
    for i, c in enumerate(cells):
        loads[c] += problem.per_matrix[i]
        g = problem.group[i]
        if (g, c) not in seen:
            seen.add((g, c))
            loads[c] += problem.launch.get(g, 0.0)
    return loads


def shard_growth(problem: OwnerProblem, cells: Sequence[int]) -> Optional[List[int]]:
    """Per bucket: how far the shard must grow past S_min for this assignment; None if past S_max."""
    if not problem.num_buckets:
        return []
    used = defaultdict(int)
    for i, c in enumerate(cells):
        used[problem.bucket[i], c // problem.tp_size] += problem.numel[i]
    growth = []
    for b, (lo, hi) in enumerate(zip(problem.shard_min, problem.shard_max)):
        need = max([used[b, d] - problem.slack for d in range(problem.dp_size)] + [lo])
        if need > hi:
            return None
        growth.append(need - lo)
    return growth


def evaluate(problem: OwnerProblem, cells: Sequence[int]) -> Tuple[float, float, List[float], Optional[int]]:
    """(objective, makespan, loads, padding elements); objective inf if a shard would pass S_max."""
    loads = loads_of(problem, cells)
    makespan = max(loads) if loads else 0.0
    growth = shard_growth(problem, cells)
    if growth is None:
        return math.inf, makespan, loads, None
    padding = problem.dp_size * sum(growth)
    return makespan + problem.padding_weight * padding, makespan, loads, padding


def lower_bound(problem: OwnerProblem) -> float:
    """max(heaviest single matrix with its launch on the least-loaded cell, total work / cells),
    where total work counts each group's launch once (it must run somewhere)."""
    base = problem.base_loads()
    if not problem.per_matrix:
        return max(base, default=0.0)
    groups = set(problem.group)
    total = sum(base) + sum(problem.per_matrix) + sum(problem.launch.get(g, 0.0) for g in groups)
    largest = max(p + problem.launch.get(g, 0.0) for p, g in zip(problem.per_matrix, problem.group))
    return max(min(base) + largest, total / problem.cells, max(base))


def greedy_cells(problem: OwnerProblem) -> List[int]:
    """Batch-aware LPT: heaviest matrix first, to the cell whose load grows least (a launch counts
    only for a group new on that cell) among those whose DP shard still has room at S_max; if none
    has room, to the DP rank with the most room."""
    loads = problem.base_loads()
    used = defaultdict(int)
    present = set()
    cells = [0] * len(problem.per_matrix)
    order = sorted(range(len(cells)), key=lambda i: (-problem.per_matrix[i], -problem.numel[i], i))
    for i in order:
        g, b, n = problem.group[i], problem.bucket[i], problem.numel[i]
        cap = problem.shard_max[b] + problem.slack if problem.num_buckets else math.inf

        def after(c):
            return loads[c] + problem.per_matrix[i] + (0.0 if (g, c) in present else problem.launch.get(g, 0.0))

        c = least_loaded_cell(range(problem.cells), problem.tp_size, lambda d: used[b, d] + n <= cap, after,
                              lambda d: used[b, d])
        loads[c] = after(c)
        present.add((g, c))
        used[b, c // problem.tp_size] += n
        cells[i] = c
    return cells


def _fit_decreasing(problem: OwnerProblem, limit: float, best_fit: bool) -> Optional[List[int]]:
    """First- (or best-) fit decreasing into cells of load ``limit``; None if something does not fit."""
    loads = problem.base_loads()
    used = defaultdict(int)
    present = set()
    cells = [0] * len(problem.per_matrix)
    T = problem.tp_size
    for i in sorted(range(len(cells)), key=lambda i: (-problem.per_matrix[i], problem.group[i], -problem.numel[i], i)):
        g, b, n = problem.group[i], problem.bucket[i], problem.numel[i]
        cap = problem.shard_max[b] + problem.slack if problem.num_buckets else math.inf
        best = None
        for c in range(problem.cells):
            after = loads[c] + problem.per_matrix[i] + (0.0 if (g, c) in present else problem.launch.get(g, 0.0))
            if after <= limit and used[b, c // T] + n <= cap:
                if not best_fit:
                    best = (after, c)
                    break
                if best is None or after > best[0]:
                    best = (after, c)
        if best is None:
            return None
        after, c = best
        loads[c] = after
        present.add((g, c))
        used[b, c // T] += n
        cells[i] = c
    return cells


def multifit_cells(problem: OwnerProblem, upper: float, rounds: int = 24) -> Optional[List[int]]:
    """MULTIFIT (Coffman, Garey, Johnson 1978) with batched launches and shard capacities: binary
    search for the smallest cell load at which first-/best-fit decreasing places every matrix."""
    lo, hi = lower_bound(problem), upper
    found = None
    for _ in range(rounds):
        if hi - lo <= 1e-6 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        cells = _fit_decreasing(problem, mid, False) or _fit_decreasing(problem, mid, True)
        if cells is None:
            lo = mid
        else:
            found, hi = cells, mid
    return found
