"""Owner assignment as a mixed-integer program: minimise the predicted makespan of the owner step.

Pure function of plain data (no torch, no process groups). The solver runs on one rank; the plan
is broadcast (megatron/ddp.py), so every rank holds the identical plan whatever the solver did.

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

When cells are fully interchangeable (TP = 1, equal base loads, no padding weight) the
configuration model replaces it: every per-cell count vector ("pattern") with load up to the warm
start's makespan is enumerated, and the optimal makespan, one of their loads, is found by binary
search with a bin-packing feasibility IP per candidate (``_pattern_search``). Its LP relaxation is
tight where the compact model's is weak (launch indicators), so it proves optimality in seconds
on the instances that matter (Qwen2.5-7B at DP=8).

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

from .owner_problem import (OwnerProblem, OwnerSolution, evaluate, greedy_cells, loads_of, lower_bound,  # noqa: F401
                            multifit_cells, shard_growth)

__all__ = ["OwnerProblem", "OwnerSolution", "evaluate", "lower_bound", "greedy_cells", "solve_owner_milp",
           "BACKENDS", "MilpFallbackWarning"]

BACKENDS = ("auto", "cbc", "highs")
LAUNCH_TIE = 1e-6  # per normalised launch: among equal makespans, prefer fewer batched calls
PAD_TIE = 1e-7  # per bucket, for a full S_max - S_min of growth: prefer less padding
OBJ_SCALE = 0.0  # pattern feasibility IPs: any packing will do (an objective makes the solver prove optimality)


class MilpFallbackWarning(RuntimeWarning):
    """The MILP planner used another backend or the greedy plan; the message says why."""


# ---------------------------------------------------------------------------------------------
# The MILP in a solver-neutral form: columns (lb, ub, integer, objective) and sparse rows.

@dataclasses.dataclass
class MilpModel:
    lb: List[float] = dataclasses.field(default_factory=list)
    ub: List[float] = dataclasses.field(default_factory=list)
    integer: List[bool] = dataclasses.field(default_factory=list)
    obj: List[float] = dataclasses.field(default_factory=list)
    rows: List[Tuple[Dict[int, float], float, float]] = dataclasses.field(default_factory=list)
    presolve: bool = True  # HiGHS: off for the pattern feasibility IPs (4x faster there, measured)

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
    """The compact assignment model: y[k, c] matrices of class k on cell c, z[g, c] launches."""

    model: MilpModel
    classes: List[List[int]]  # item indices of each class
    y: Dict[Tuple[int, int], int]
    z: Dict[Tuple[str, int], int]
    s: Dict[int, int]
    m: int
    scale: float
    symmetric: bool

    def start(self, problem: "OwnerProblem", cells: Sequence[int]) -> Dict[int, float]:
        return _start_values(problem, self, cells)

    def decode(self, problem: "OwnerProblem", values: Sequence[float]) -> List[int]:
        counts = [[int(round(values[self.y[k, c]])) for c in range(problem.cells)] for k in range(len(self.classes))]
        return spread_counts(self.classes, counts, len(problem.per_matrix))


def spread_counts(classes: List[List[int]], counts: List[List[int]], n_items: int) -> List[int]:
    """Cells per item from per-class counts per cell (items of a class are interchangeable)."""
    cells = [0] * n_items
    for items, per_cell in zip(classes, counts):
        if sum(per_cell) != len(items) or min(per_cell) < 0:
            raise RuntimeError(f"solver returned counts {per_cell} for a class of {len(items)} matrices")
        it = iter(sorted(items))
        for c, n in enumerate(per_cell):
            for _ in range(n):
                cells[next(it)] = c
    return cells


def _classes(problem: OwnerProblem) -> List[List[int]]:
    by_key: Dict[tuple, List[int]] = {}
    for i in range(len(problem.per_matrix)):
        key = (problem.group[i], problem.bucket[i], problem.per_matrix[i], problem.numel[i])
        by_key.setdefault(key, []).append(i)
    return [by_key[k] for k in sorted(by_key, key=lambda k: (k[0], k[1], -k[2], -k[3]))]


def num_variables(problem: OwnerProblem) -> int:
    groups = {g for g in problem.group if problem.launch.get(g, 0.0) > 0}
    return (len(_classes(problem)) + len(groups)) * problem.cells + problem.num_buckets + 1


def _formulate(problem: OwnerProblem, upper: float) -> _Formulation:
    """The MILP; ``upper`` = the makespan of a known plan (bounds M and how many matrices of a
    class or group one cell can take, which tightens the launch indicators' relaxation)."""
    C, T, D = problem.cells, problem.tp_size, problem.dp_size
    base = problem.base_loads()
    scale = max([p + problem.launch.get(g, 0.0) for p, g in zip(problem.per_matrix, problem.group)] + [max(base), 1e-30])
    classes = _classes(problem)
    mdl = MilpModel()
    room = upper * (1 + 1e-9) - min(base)  # the most work one cell can take in a plan no worse than `upper`

    def most(count, cost, launch, numel, bucket):  # matrices of one kind a cell can hold
        n = count
        if cost > 0 and math.isfinite(room):
            n = min(n, max(int((room - launch) // cost), 0))
        if problem.num_buckets and numel > 0:
            n = min(n, (problem.shard_max[bucket] + problem.slack) // numel)
        return max(n, 0)

    m = mdl.var(lower_bound(problem) / scale, max(upper / scale, lower_bound(problem) / scale), False, 1.0)
    # (upper = inf: no plan known yet; room and M are unbounded)
    y = {}
    for k, items in enumerate(classes):
        i = items[0]
        ub = most(len(items), problem.per_matrix[i], problem.launch.get(problem.group[i], 0.0), problem.numel[i],
                  problem.bucket[i])
        for c in range(C):
            y[k, c] = mdl.var(0, ub, True)
    group_classes: Dict[str, List[int]] = defaultdict(list)
    for k, items in enumerate(classes):
        group_classes[problem.group[items[0]]].append(k)
    launching = sorted(g for g in group_classes if problem.launch.get(g, 0.0) > 0)
    z = {(g, c): mdl.var(0, 1, True, LAUNCH_TIE * problem.launch[g] / scale) for g in launching for c in range(C)}
    s = {}
    for b, (lo, hi) in enumerate(zip(problem.shard_min, problem.shard_max)):
        span = max(hi - lo, 1)
        s[b] = mdl.var(lo, hi, False, problem.padding_weight * D / scale + PAD_TIE / span)
    for k, items in enumerate(classes):  # every matrix has one owner
        mdl.row({y[k, c]: 1.0 for c in range(C)}, len(items), len(items))
    for g in launching:  # a cell holding any matrix of group g pays its launch: sum_k y <= U_g z
        ks = group_classes[g]
        cap = most(sum(len(classes[k]) for k in ks), min(problem.per_matrix[classes[k][0]] for k in ks),
                   problem.launch[g], 0, 0)
        cap = max(min(cap, sum(mdl.ub[y[k, 0]] for k in ks)), 1)
        for c in range(C):
            coeffs = {y[k, c]: 1.0 for k in ks}
            coeffs[z[g, c]] = -float(cap)
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


def _enumerate_patterns(problem: OwnerProblem, classes: List[List[int]], upper: float,
                        limit: int) -> Optional[List[Tuple[Tuple[int, ...], float]]]:
    """Every per-cell count vector whose load stays within ``upper`` and whose owned numel fits
    every bucket's largest shard, with its load; None past ``limit`` patterns."""
    base = problem.base_loads()[0]
    room = upper * (1 + 1e-9)
    info = [(problem.per_matrix[it[0]], problem.launch.get(problem.group[it[0]], 0.0), problem.group[it[0]],
             problem.bucket[it[0]], problem.numel[it[0]], len(it)) for it in classes]
    caps = [hi + problem.slack for hi in problem.shard_max]
    out: List[Tuple[Tuple[int, ...], float]] = []
    counts = [0] * len(classes)
    used = [0] * max(problem.num_buckets, 1)

    def walk(k: int, load: float, groups: frozenset) -> bool:
        if k == len(classes):
            out.append((tuple(counts), load))
            return len(out) <= limit
        cost, launch, g, b, numel, n = info[k]
        for c in range(n + 1):
            extra = c * cost + (launch if c and g not in groups else 0.0)
            if load + extra > room or (caps and used[b] + c * numel > caps[b]):
                break
            counts[k] = c
            used[b] += c * numel
            ok = walk(k + 1, load + extra, groups | {g} if c else groups)
            used[b] -= c * numel
            counts[k] = 0
            if not ok:
                return False
        return True

    return out if walk(0, base, frozenset()) else None


def _pattern_search(problem: OwnerProblem, upper: float, limit: int, solve, deadline: float, gap: float):
    """Exact makespan for interchangeable cells (TP = 1, equal base loads, no padding weight): the
    configuration model. Patterns (count vectors per cell) are enumerated up to ``upper``; the
    optimal makespan is one of their loads, found by binary search with a bin-packing feasibility
    IP per candidate (its LP relaxation is tight, so each solve is quick). Returns (cells, status)
    or None when not applicable (then the compact model runs)."""
    if (problem.tp_size != 1 or len(set(problem.base_loads())) > 1 or not math.isfinite(upper)
            or problem.padding_weight > 0):
        return None
    classes = _classes(problem)
    found = _enumerate_patterns(problem, classes, upper, limit)
    if found is None:
        return None
    D = problem.dp_size
    base = problem.base_loads()[0]
    nonempty = [(p, load) for p, load in found if any(p)]
    lb = lower_bound(problem)
    levels = sorted({load for _, load in nonempty if load >= lb * (1 - 1e-12) and load <= upper * (1 + 1e-9)})
    launches = [load - base - sum(c * problem.per_matrix[items[0]] for c, items in zip(p, classes))
                for p, load in nonempty]

    def feasible(level):
        mdl = MilpModel(presolve=False)
        cols = [j for j, (_, load) in enumerate(nonempty) if load <= level]
        x = {j: mdl.var(0, D, True, OBJ_SCALE * launches[j]) for j in cols}
        mdl.row({x[j]: 1.0 for j in cols}, -math.inf, D)
        for k, items in enumerate(classes):
            mdl.row({x[j]: float(nonempty[j][0][k]) for j in cols if nonempty[j][0][k]}, len(items), len(items))
        checks_left = max(math.ceil(math.log2(max(hi - lo + 1, 2))), 1)  # a slice of what is left per check
        values, status = solve(mdl, {}, (deadline - time.perf_counter()) / checks_left, gap)
        order = [j for j in sorted(cols, key=lambda j: (-nonempty[j][1], j)) for _ in range(int(round(values[x[j]])))]
        order += [None] * (problem.cells - len(order))
        counts = [[nonempty[j][0][k] if j is not None else 0 for j in order] for k in range(len(classes))]
        return spread_counts(classes, counts, len(problem.per_matrix))

    lo, hi, cells, proven = 0, len(levels) - 1, None, True  # levels[hi] is feasible: the warm start
    while lo < hi:
        if time.perf_counter() >= deadline:
            proven = False
            break
        mid = (lo + hi) // 2
        try:
            cells, hi = feasible(levels[mid]), mid
        except NoSolution as exc:
            proven = proven and exc.infeasible
            lo = mid + 1
    return cells, ("optimal" if proven else "feasible")  # cells None: the warm start is the best


class NoSolution(RuntimeError):
    """The backend ran but returned no usable solution (status in the message)."""

    def __init__(self, message: str, infeasible: bool):
        super().__init__(message)
        self.infeasible = infeasible


def _solve_cbc(mdl: MilpModel, start: Dict[int, float], time_limit_s: float, gap: float):
    """python-mip's models hold reference cycles; if the garbage collector frees an old one while
    cffi holds its (non-reentrant) type lock in a new model's call, the process deadlocks (seen:
    `Model.__del__` inside `ffi.new` of `model.start`). So the collector is off while mip runs and
    every model is freed here, before anything else touches cffi."""
    import gc

    import mip  # python-mip; ImportError when it is not installed

    was_enabled = gc.isenabled()
    gc.disable()
    model = None
    try:
        model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
        return _run_cbc(mip, model, mdl, start, time_limit_s, gap)
    finally:
        del model
        gc.collect()
        if was_enabled:
            gc.enable()


def _run_cbc(mip, model, mdl: MilpModel, start: Dict[int, float], time_limit_s: float, gap: float):
    model.verbose = 0
    model.threads = 1
    model.seed = 0
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
    if start:
        model.start = [(xs[j], v) for j, v in start.items()]
    status = model.optimize(max_seconds=min(max(time_limit_s, 1e-3), 1e9))
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) or model.num_solutions == 0:
        raise NoSolution(f"CBC status {status.name}", infeasible=status == mip.OptimizationStatus.INFEASIBLE)
    return [x.x for x in xs], ("optimal" if status == mip.OptimizationStatus.OPTIMAL else "feasible")


def _solve_highs(mdl: MilpModel, start, time_limit_s: float, gap: float):
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

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
               options={"time_limit": min(max(time_limit_s, 1e-3), 1e9), "disp": False, "mip_rel_gap": gap,
                        "presolve": mdl.presolve})
    if res.x is None or res.status not in (0, 1):
        raise NoSolution(f"HiGHS status {res.status} ({res.message})", infeasible=res.status == 2)
    return list(res.x), ("optimal" if res.status == 0 else "feasible")


SOLVERS = {"cbc": _solve_cbc, "highs": _solve_highs}


def solve_owner_milp(
    problem: OwnerProblem,
    *,
    backend: str = "auto",
    time_limit_s: float = 10.0,
    max_variables: int = 50_000,
    max_patterns: int = 20_000,
    warm_starts: Sequence[Sequence[int]] = (),
    mip_gap: float = 1e-4,
) -> OwnerSolution:
    """Owner cells minimising the predicted makespan (see the module docstring).

    ``backend``: 'auto' (CBC, then HiGHS), 'cbc' or 'highs'. Interchangeable cells (TP = 1, equal
    base loads) use the configuration model when it has at most ``max_patterns`` patterns, else
    the compact model (refused past ``max_variables``). ``warm_starts``: feasible plans
    (cells per item) to start from; the batch-aware greedy is always one. The result is never worse
    than the best warm start under ``evaluate``; every fallback warns (``MilpFallbackWarning``)."""
    if backend not in BACKENDS:
        raise ValueError(f"MILP backend {backend!r} unknown; valid: {', '.join(BACKENDS)}")
    problem.check()
    t0 = time.perf_counter()
    lb = lower_bound(problem)
    starts = [list(greedy_cells(problem))] + [list(w) for w in warm_starts]
    upper = min(evaluate(problem, w)[1] for w in starts)
    packed = multifit_cells(problem, upper)
    if packed is not None:
        starts.append(packed)
    scored = [(evaluate(problem, w), n, w) for n, w in enumerate(starts)]
    (best_obj, best_ms, best_loads, best_pad), _, best = min(scored, key=lambda s: (s[0][0], s[1]))

    def fallback(reason: str) -> OwnerSolution:
        warnings.warn(f"DMuon MILP owner plan: {reason}; using the greedy plan", MilpFallbackWarning, stacklevel=3)
        return OwnerSolution(best, best_obj, best_ms, best_loads, best_pad or 0, lb, "greedy", "greedy",
                             time.perf_counter() - t0, reason)

    if not problem.per_matrix:
        return OwnerSolution([], best_obj, best_ms, best_loads, 0, lb, "greedy", "optimal", 0.0, "no matrices")
    upper = best_ms if math.isfinite(best_obj) else math.inf
    deadline = t0 + time_limit_s
    compact = None
    order = ["cbc", "highs"] if backend == "auto" else [backend]
    reasons = []
    for name in order:
        if time.perf_counter() >= deadline:
            reasons.append(f"{name}: no time left of time_limit_s={time_limit_s:g}")
            break
        try:
            solve = SOLVERS[name]
            searched = _pattern_search(problem, upper, max_patterns, solve, deadline, mip_gap)
            if searched is not None:
                cells, status = searched
                cells = best if cells is None else cells
            else:
                if compact is None:
                    n_vars = num_variables(problem)
                    if n_vars > max_variables:
                        return fallback(f"instance too large ({n_vars} variables > max_variables={max_variables})")
                    compact = _formulate(problem, upper)
                start = compact.start(problem, best) if math.isfinite(best_obj) else {}
                values, status = solve(compact.model, start, deadline - time.perf_counter(), mip_gap)
                cells = compact.decode(problem, values)
        except ImportError as exc:
            reasons.append(f"{name}: solver not importable ({exc})")
        except NoSolution as exc:
            reasons.append(f"{name}: {exc} (time limit {time_limit_s:g} s)")
            break  # a time-out: another backend would run out of time too
        except Exception as exc:  # a broken solver install must not stop training start-up
            reasons.append(f"{name}: solver failed ({type(exc).__name__}: {exc})")
        else:
            obj, ms, loads, pad = evaluate(problem, cells)
            kept_start = obj > best_obj
            if kept_start:  # within the MIP gap, or a time-limited incumbent: the warm start is better
                cells, obj, ms, loads, pad = best, best_obj, best_ms, best_loads, best_pad
            used = name
            if status != "optimal":
                used = "greedy" if kept_start or cells is best else name
                reasons.append(f"{name}: time limit of {time_limit_s:g} s reached; "
                               f"{'the greedy warm start is the best plan found' if used == 'greedy' else 'best solution found'}")
            if reasons:
                warnings.warn(f"DMuon MILP owner plan: {'; '.join(reasons)}", MilpFallbackWarning, stacklevel=2)
            return OwnerSolution(cells, obj, ms, loads, pad or 0, lb, used, status, time.perf_counter() - t0,
                                 "; ".join(reasons))
    return fallback("; ".join(reasons))
