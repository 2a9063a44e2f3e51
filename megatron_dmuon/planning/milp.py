"""Owner assignment as a mixed-integer program: minimise the predicted makespan of the owner step.

Pure function of plain data (no torch, no process groups). The solver runs on one rank; the plan
is broadcast (megatron/layout.py), so every rank holds the identical plan whatever the solver did.

Model (``OwnerProblem``; costs in any unit, e.g. ms from planning/cost_model.py):

* cells c = (dp, tp) = the DP x TP owners; item i is a Muon matrix with a per-matrix cost p_i,
  numel n_i, batch group g(i) (same shape: one batched NS call per group per cell, fixed cost a_g
  paid once per cell holding the group) and bucket b(i);
* interchangeable matrices (same group, bucket, cost and numel) form a class k of N_k items;
  y[k,c] in {0..N_k} counts class k on cell c, z[g,c] in {0,1} says cell c launches group g;
* load L_c = base_c + sum_k p_k y[k,c] + sum_g a_g z[g,c] <= M (makespan);
* owner-aligned layout: per bucket b and DP rank d the owned numel sum_{k in b, t} n_k y[k,(d,t)]
  <= S_b + slack, where the shard size S_b may grow from S_min_b (what the greedy uses) up to
  S_max_b; padding costs ``padding_weight`` per element of every DP rank's shard (bytes on the
  wire);
* minimise M + padding_weight * D * sum_b (S_b - S_min_b) (+ tiny tie-breaks: fewer launches,
  less padding).

Symmetric cells are ordered (loads descending inside a DP rank, DP ranks by their heaviest cell)
when every cell starts from the same base load, which removes the D!·T! equivalent optima.

``solve_owner_milp`` tries python-mip (CBC), then scipy.optimize.milp (HiGHS), each warm-started
or checked against greedy plans, and falls back to the best greedy plan (with a warning that says
why) when the instance is too large, no solver imports, or the time limit leaves nothing better.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["OwnerProblem", "OwnerSolution", "evaluate", "lower_bound", "greedy_cells", "solve_owner_milp",
           "BACKENDS", "MilpFallbackWarning"]

BACKENDS = ("auto", "cbc", "highs")
LAUNCH_TIE = 1e-6  # per normalised launch: among equal makespans, prefer fewer batched calls
PAD_TIE = 1e-7  # per bucket, for a full S_max - S_min of growth: prefer less padding


class MilpFallbackWarning(UserWarning):
    """The MILP planner used another backend or the greedy plan; the message says why."""


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

        fits = [c for c in range(problem.cells) if used[b, c // problem.tp_size] + n <= cap]
        c = (min(fits, key=lambda c: (after(c), used[b, c // problem.tp_size], c)) if fits
             else min(range(problem.cells), key=lambda c: (used[b, c // problem.tp_size], after(c), c)))
        loads[c] = after(c)
        present.add((g, c))
        used[b, c // problem.tp_size] += n
        cells[i] = c
    return cells


# ---------------------------------------------------------------------------------------------
# The MILP in a solver-neutral form: columns (lb, ub, integer, objective) and sparse rows.

@dataclasses.dataclass
class _Model:
    lb: List[float] = dataclasses.field(default_factory=list)
    ub: List[float] = dataclasses.field(default_factory=list)
    integer: List[bool] = dataclasses.field(default_factory=list)
    obj: List[float] = dataclasses.field(default_factory=list)
    rows: List[Tuple[Dict[int, float], float, float]] = dataclasses.field(default_factory=list)

    def var(self, lb, ub, integer, obj=0.0) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.obj.append(obj)
        return len(self.lb) - 1

    def row(self, coeffs: Dict[int, float], lb: float, ub: float) -> None:
        self.rows.append((coeffs, lb, ub))


@dataclasses.dataclass
class _Formulation:
    model: _Model
    classes: List[List[int]]  # item indices of each class
    y: Dict[Tuple[int, int], int]
    z: Dict[Tuple[str, int], int]
    s: Dict[int, int]
    m: int
    scale: float
    symmetric: bool


def _classes(problem: OwnerProblem) -> List[List[int]]:
    by_key: Dict[tuple, List[int]] = {}
    for i in range(len(problem.per_matrix)):
        key = (problem.group[i], problem.bucket[i], problem.per_matrix[i], problem.numel[i])
        by_key.setdefault(key, []).append(i)
    return [by_key[k] for k in sorted(by_key, key=lambda k: (k[0], k[1], -k[2], -k[3]))]


def num_variables(problem: OwnerProblem) -> int:
    groups = {g for g in problem.group if problem.launch.get(g, 0.0) > 0}
    return (len(_classes(problem)) + len(groups)) * problem.cells + problem.num_buckets + 1


def _formulate(problem: OwnerProblem) -> _Formulation:
    C, T, D = problem.cells, problem.tp_size, problem.dp_size
    base = problem.base_loads()
    scale = max([p + problem.launch.get(g, 0.0) for p, g in zip(problem.per_matrix, problem.group)] + [max(base), 1e-30])
    classes = _classes(problem)
    mdl = _Model()
    lb = lower_bound(problem) / scale
    m = mdl.var(lb, math.inf, False, 1.0)
    y = {(k, c): mdl.var(0, len(items), True) for k, items in enumerate(classes) for c in range(C)}
    group_items: Dict[str, int] = defaultdict(int)
    for items in classes:
        group_items[problem.group[items[0]]] += len(items)
    launching = sorted(g for g in group_items if problem.launch.get(g, 0.0) > 0)
    z = {(g, c): mdl.var(0, 1, True, LAUNCH_TIE * problem.launch[g] / scale) for g in launching for c in range(C)}
    s = {}
    for b, (lo, hi) in enumerate(zip(problem.shard_min, problem.shard_max)):
        span = max(hi - lo, 1)
        s[b] = mdl.var(lo, hi, False, problem.padding_weight * D / scale + PAD_TIE / span)
    for k, items in enumerate(classes):  # every matrix has one owner
        mdl.row({y[k, c]: 1.0 for c in range(C)}, len(items), len(items))
    for g in launching:  # a cell holding any matrix of group g pays its launch
        for c in range(C):
            coeffs = {y[k, c]: 1.0 for k, items in enumerate(classes) if problem.group[items[0]] == g}
            coeffs[z[g, c]] = -float(group_items[g])
            mdl.row(coeffs, -math.inf, 0.0)

    def load_coeffs(c):
        coeffs = {y[k, c]: problem.per_matrix[items[0]] / scale for k, items in enumerate(classes)}
        coeffs.update({z[g, c]: problem.launch[g] / scale for g in launching})
        return coeffs

    for c in range(C):  # L_c <= M
        coeffs = load_coeffs(c)
        coeffs[m] = -1.0
        mdl.row(coeffs, -math.inf, -base[c] / scale)
    for b in s:  # owner-aligned layout: each DP rank's owned numel fits its shard
        for d in range(D):
            coeffs = {y[k, d * T + t]: float(problem.numel[items[0]])
                      for k, items in enumerate(classes) if problem.bucket[items[0]] == b for t in range(T)}
            if coeffs:
                coeffs[s[b]] = -1.0
                mdl.row(coeffs, -math.inf, float(problem.slack))
    symmetric = len(set(base)) <= 1
    if symmetric:  # order equivalent cells: L(d,t) >= L(d,t+1), L(d,0) >= L(d+1,0)
        pairs = [(d * T + t, d * T + t + 1) for d in range(D) for t in range(T - 1)]
        pairs += [(d * T, (d + 1) * T) for d in range(D - 1)]
        for hi_c, lo_c in pairs:
            coeffs = dict(load_coeffs(hi_c))
            for v, a in load_coeffs(lo_c).items():
                coeffs[v] = coeffs.get(v, 0.0) - a
            mdl.row(coeffs, 0.0, math.inf)
    return _Formulation(mdl, classes, y, z, s, m, scale, symmetric)


def _canonical(problem: OwnerProblem, cells: Sequence[int]) -> List[int]:
    """The same plan with cells renamed to satisfy the symmetry ordering (when it is imposed)."""
    T, D = problem.tp_size, problem.dp_size
    loads = loads_of(problem, cells)
    inner = {d: sorted(range(T), key=lambda t: (-loads[d * T + t], t)) for d in range(D)}
    ranks = sorted(range(D), key=lambda d: (-loads[d * T + inner[d][0]], d))
    rename = {}
    for new_d, d in enumerate(ranks):
        for new_t, t in enumerate(inner[d]):
            rename[d * T + t] = new_d * T + new_t
    return [rename[c] for c in cells]


def _start_values(problem: OwnerProblem, f: _Formulation, cells: Sequence[int]) -> Dict[int, float]:
    if f.symmetric:
        cells = _canonical(problem, cells)
    vals = {v: 0.0 for v in f.y.values()}
    vals.update({v: 0.0 for v in f.z.values()})
    for k, items in enumerate(f.classes):
        for i in items:
            vals[f.y[k, cells[i]]] += 1
            g = problem.group[i]
            if (g, cells[i]) in f.z:
                vals[f.z[g, cells[i]]] = 1.0
    growth = shard_growth(problem, cells) or [0] * problem.num_buckets
    for b, v in f.s.items():
        vals[v] = problem.shard_min[b] + growth[b]
    vals[f.m] = max(max(loads_of(problem, cells)) / f.scale, f.model.lb[f.m])
    return vals


def _cells_from(problem: OwnerProblem, f: _Formulation, values: Sequence[float]) -> List[int]:
    cells = [0] * len(problem.per_matrix)
    for k, items in enumerate(f.classes):
        counts = [int(round(values[f.y[k, c]])) for c in range(problem.cells)]
        if sum(counts) != len(items) or min(counts) < 0:
            raise RuntimeError(f"solver returned counts {counts} for a class of {len(items)} matrices")
        it = iter(sorted(items))
        for c, n in enumerate(counts):
            for _ in range(n):
                cells[next(it)] = c
    return cells


class _NoSolution(RuntimeError):
    """The backend ran but returned no usable solution (status in the message)."""


def _solve_cbc(f: _Formulation, start: Dict[int, float], time_limit_s: float, gap: float):
    import mip  # python-mip; ImportError when it is not installed

    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose = 0
    model.threads = 1
    model.seed = 0
    mdl = f.model
    xs = [model.add_var(lb=mdl.lb[j], ub=mdl.ub[j] if math.isfinite(mdl.ub[j]) else mip.INF,
                        var_type=mip.INTEGER if mdl.integer[j] else mip.CONTINUOUS, obj=mdl.obj[j])
          for j in range(len(mdl.lb))]
    for coeffs, lo, hi in mdl.rows:
        expr = mip.xsum(a * xs[j] for j, a in coeffs.items())
        if lo == hi:
            model.add_constr(expr == lo)
        else:
            if math.isfinite(lo):
                model.add_constr(expr >= lo)
            if math.isfinite(hi):
                model.add_constr(expr <= hi)
    model.max_mip_gap = gap
    model.max_mip_gap_abs = 1e-9
    model.start = [(xs[j], v) for j, v in start.items()]
    status = model.optimize(max_seconds=max(time_limit_s, 1e-3))
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) or model.num_solutions == 0:
        raise _NoSolution(f"CBC status {status.name}")
    return [x.x for x in xs], ("optimal" if status == mip.OptimizationStatus.OPTIMAL else "feasible")


def _solve_highs(f: _Formulation, start, time_limit_s: float, gap: float):
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    mdl = f.model
    rows, cols, vals, lo, hi = [], [], [], [], []
    for r, (coeffs, a, b) in enumerate(mdl.rows):
        for j, v in coeffs.items():
            rows.append(r)
            cols.append(j)
            vals.append(v)
        lo.append(a)
        hi.append(b)
    A = coo_matrix((vals, (rows, cols)), shape=(len(mdl.rows), len(mdl.lb))).tocsr()
    res = milp(c=np.array(mdl.obj), integrality=np.array(mdl.integer, dtype=int),
               bounds=Bounds(np.array(mdl.lb, dtype=float), np.array(mdl.ub, dtype=float)),
               constraints=LinearConstraint(A, np.array(lo), np.array(hi)),
               options={"time_limit": max(time_limit_s, 1e-3), "disp": False, "mip_rel_gap": gap})
    if res.x is None or res.status not in (0, 1):
        raise _NoSolution(f"HiGHS status {res.status} ({res.message})")
    return list(res.x), ("optimal" if res.status == 0 else "feasible")


_SOLVERS = {"cbc": _solve_cbc, "highs": _solve_highs}


def solve_owner_milp(
    problem: OwnerProblem,
    *,
    backend: str = "auto",
    time_limit_s: float = 10.0,
    max_variables: int = 50_000,
    warm_starts: Sequence[Sequence[int]] = (),
    mip_gap: float = 1e-4,
) -> OwnerSolution:
    """Owner cells minimising the predicted makespan (see the module docstring).

    ``backend``: 'auto' (CBC, then HiGHS), 'cbc' or 'highs'. ``warm_starts``: feasible plans
    (cells per item) to start from; the batch-aware greedy is always one. The result is never worse
    than the best warm start under ``evaluate``; every fallback warns (``MilpFallbackWarning``)."""
    if backend not in BACKENDS:
        raise ValueError(f"MILP backend {backend!r} unknown; valid: {', '.join(BACKENDS)}")
    problem.check()
    t0 = time.perf_counter()
    lb = lower_bound(problem)
    starts = [list(greedy_cells(problem))] + [list(w) for w in warm_starts]
    scored = [(evaluate(problem, w), n, w) for n, w in enumerate(starts)]
    (best_obj, best_ms, best_loads, best_pad), _, best = min(scored, key=lambda s: (s[0][0], s[1]))

    def fallback(reason: str) -> OwnerSolution:
        warnings.warn(f"DMuon MILP owner plan: {reason}; using the greedy plan", MilpFallbackWarning, stacklevel=3)
        return OwnerSolution(best, best_obj, best_ms, best_loads, best_pad or 0, lb, "greedy", "greedy",
                             time.perf_counter() - t0, reason)

    if not problem.per_matrix:
        return OwnerSolution([], best_obj, best_ms, best_loads, 0, lb, "greedy", "optimal", 0.0, "no matrices")
    n_vars = num_variables(problem)
    if n_vars > max_variables:
        return fallback(f"instance too large ({n_vars} variables > max_variables={max_variables})")
    f = _formulate(problem)
    start = _start_values(problem, f, best) if math.isfinite(best_obj) else {}
    order = ["cbc", "highs"] if backend == "auto" else [backend]
    reasons = []
    for name in order:
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0:
            reasons.append(f"{name}: no time left of time_limit_s={time_limit_s}")
            break
        try:
            values, status = _SOLVERS[name](f, start, left, mip_gap)
            cells = _cells_from(problem, f, values)
        except ImportError as exc:
            reasons.append(f"{name}: solver not importable ({exc})")
        except _NoSolution as exc:
            reasons.append(f"{name}: {exc} within the time limit of {time_limit_s:g} s")
            break  # a time-out: another backend would run out of time too
        except Exception as exc:  # a broken solver install must not stop training start-up
            reasons.append(f"{name}: solver failed ({type(exc).__name__}: {exc})")
        else:
            obj, ms, loads, pad = evaluate(problem, cells)
            kept_start = obj > best_obj + 1e-9 * max(1.0, abs(best_obj))
            if kept_start:  # within the MIP gap, or a time-limited incumbent: the warm start is better
                cells, obj, ms, loads, pad = best, best_obj, best_ms, best_loads, best_pad
            used = name
            if status != "optimal":
                used = "greedy" if kept_start else name
                reasons.append(f"{name}: time limit of {time_limit_s:g} s reached; "
                               f"{'the greedy warm start is the best plan found' if kept_start else 'best solution found'}")
            if reasons:
                warnings.warn(f"DMuon MILP owner plan: {'; '.join(reasons)}", MilpFallbackWarning, stacklevel=2)
            return OwnerSolution(cells, obj, ms, loads, pad or 0, lb, used, status, time.perf_counter() - t0,
                                 "; ".join(reasons))
    return fallback("; ".join(reasons))
