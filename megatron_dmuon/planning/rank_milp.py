"""Owner assignment that minimises the slowest rank's predicted owner step under the rank cost
model (planning/rank_cost.py): the *rank MILP* of balance 'milp' (planning/balance.py).

Every plan here is scored the same way, exactly: its owner-aligned layout is built (placement
included, so each rank's AdamW fragments are the ones it will step), each cell's ``RankWork`` is
read off that layout, and ``RankCostModel.rank_ms`` predicts it. The warm starts are the greedy
planners (ours, ``cost``, with the model's per-matrix and element-wise costs; Megatron-LM's
layer-sharded LPT; numel LPT). The MILP solves a linear view of the same model:

* items are the buffer's Muon matrices, in classes of interchangeable ones (bucket, NS pieces,
  numel); y[k, c] counts class k on cell c;
* a cell's NS: per piece shape s, ``launch_s x z[s, c] + per_s x (matrices of s on c)``, the affine
  fit of the measured stack curve (z[s, c] = 1 when c holds any matrix of shape s);
* its AdamW: every matrix element a DP row owns in bucket b displaces phi_b AdamW elements (phi_b:
  the AdamW share of the bucket's free shard space), at the model's AdamW ms per element less the
  part hidden beside the NS;
* each DP row's owned numel per bucket fits its shard (as large as the warm start needed, or the
  bucket padding allowed); minimise the slowest cell, M.

The MILP's plan is then scored exactly like the warm starts, and the best of all is returned: the
result is never predicted slower than any warm start (ties keep the warm start). A solver that is
missing, fails or runs out of time falls back to that best warm start with a warning that says why.
A plan that beats the greedy (``cost``, what balance 'cost' runs) by less than the model's
own error (``min_gain``, default: its worst miss on the profile's steps of several shapes, in sample
``meta['multi_error']`` or on each step left out of the fit ``meta['multi_holdout_error']``, and at
least ``MIN_GAIN``) is not taken: on the H100 a plan predicted 2.3% faster than the greedy emulated
21% slower (a model whose shared part was 2.4x too large), and after that was fixed a plan predicted
0.2% faster emulated 1.7% slower (Qwen2.5-7B at DP 64: five steps fitted five parts exactly, an
in-sample error of 0); the greedy is kept then.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

from .milp import BACKENDS, LAUNCH_TIE, MilpFallbackWarning, MilpModel, NoSolution, SOLVERS, spread_counts
from .layout_stats import fragments_by_rank
from .owner_layout import (PARAM_ALIGN, align_up, assemble_layout, check_plan_inputs, min_shard, own_bucket_items,
                           plan_layout_once, split_buckets)
from .rank_cost import RankCostModel, RankWork, piece_counts

# the least predicted gain over the greedy a rank-model plan must show: the same plan's slowest GPU
# varied by 1-7% between rounds of one H100 emulation (docs/results/load_balancing/
# scale_emulation_h100_2026-12-06/call4_emu_*.md), so a smaller gain cannot be told from noise
MIN_GAIN = 0.02

__all__ = ["CANDIDATES", "item_pieces", "layout_work", "layout_loads", "plan_rank_owner_layout", "rank_milp_layout"]

# the warm starts, in the order that breaks ties: the greedy as balance 'cost' plans (the
# caller's costs and element-wise rates), the greedy on the model's ms, Megatron-LM's
# layer-sharded LPT, numel LPT
CANDIDATES = ("cost", "cost_ms", "megatron_lpt", "numel_lpt")


def item_pieces(item) -> Tuple[Tuple[int, ...], ...]:
    """The NS pieces of a matrix item: its recorded pieces, else the whole matrix (shape_key)."""
    if item.pieces:
        return tuple(tuple(p) for p in item.pieces)
    return (tuple(int(v) for v in item.shape_key.split("x")),)


def layout_work(items, layout) -> List[RankWork]:
    """Per DP x TP cell of one buffer's layout: the NS pieces it orthogonalizes and the AdamW
    fragments inside its DP row's shards (every TP rank of the row steps its own shard of them)."""
    T = layout.tp_size
    work = [RankWork() for _ in range(layout.world_size * T)]
    for it in items:
        if it.is_matrix:
            work[layout.owners[it.name] * T + layout.tp_owners.get(it.name, 0)].pieces.update(_counts(item_pieces(it)))
    for r, sizes in enumerate(fragments_by_rank(layout, items)):
        for t in range(T):
            work[r * T + t].add_fragments(sizes)
    return work


@functools.lru_cache(maxsize=None)
def _counts(pieces) -> Counter:
    """``piece_counts`` of a matrix's pieces, once per distinct pieces (the local search scores
    thousands of layouts of the same matrices)."""
    return piece_counts(pieces)


def layout_loads(items, layout, model: RankCostModel, base: Sequence[float]) -> List[float]:
    """Each cell's predicted owner step (ms): ``base`` (earlier buffers) + the model's rank_ms."""
    return [b + model.rank_ms(w) for b, w in zip(base, layout_work(items, layout))]


def _score(loads: Sequence[float]) -> Tuple[float, float]:
    return (max(loads), sum(loads)) if loads else (0.0, 0.0)


def plan_rank_owner_layout(items, world_size: int, bucket_size: Optional[int] = None, max_bucket_padding: float = 0.02,
                           rank_cost: Optional[List[float]] = None, tp_size: int = 1,
                           milp_options: Optional[dict] = None, info: Optional[dict] = None, elementwise=None, *,
                           model: RankCostModel):
    """The rank MILP (balance 'milp' on a rank cost model): the owner layout of one buffer
    that minimises its slowest cell's predicted owner step (module docstring). `rank_cost` (per
    cell, ms of earlier buffers) becomes the chosen plan's predicted loads; `elementwise` is the
    greedy warm start's, as balance 'cost' plans; `milp_options`: backend, time_limit_s
    (everything included), max_variables, polish_share, min_gain (module docstring)."""
    rank_cost = check_plan_inputs(items, world_size, tp_size, rank_cost, elementwise)
    items = own_bucket_items(items, world_size, bucket_size, max_bucket_padding, tp_size, rank_cost, elementwise)
    buckets_members = split_buckets(items, bucket_size, world_size, max_bucket_padding)
    return rank_milp_layout(items, buckets_members, rank_cost, info, world_size, bucket_size, max_bucket_padding,
                            tp_size, milp_options, model, elementwise)


def rank_milp_layout(items, buckets_members, rank_cost: List[float], info: Optional[dict], world_size: int,
                     bucket_size, max_bucket_padding: float, tp_size: int, milp_options: Optional[dict],
                     model: RankCostModel, elementwise=None):
    """The owner layout of one buffer minimising the slowest cell under ``model`` (module
    docstring); ``rank_cost`` (per cell, ms of earlier buffers) becomes the chosen plan's loads."""
    options = dict(milp_options or {})
    backend = options.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"MILP backend {backend!r} unknown; valid: {', '.join(BACKENDS)}")
    time_limit = float(options.get("time_limit_s", 10.0))  # all of it: warm starts, MILP, local search
    polish_share = float(options.get("polish_share", 0.25))  # of the time limit, kept for the local search
    max_variables = int(options.get("max_variables", 50_000))
    min_gain = float(options.get("min_gain", max(MIN_GAIN, model.meta.get("multi_error", 0.0),
                                                 model.meta.get("multi_holdout_error", 0.0))))
    t0 = time.perf_counter()
    base = list(rank_cost)
    adamw_ms, muon_ms = model.elementwise_ms()
    ms_items = [dataclasses.replace(it, cost=_matrix_ms(model, it)) if it.is_matrix else it for it in items]
    layouts, loads = {}, {}
    for name in CANDIDATES:
        greedy_items, rule, rates = {"cost": (items, "cost", elementwise),
                                     "cost_ms": (ms_items, "cost", (adamw_ms, muon_ms))}.get(name, (items, name, None))
        layouts[name] = plan_layout_once(greedy_items, list(base), None, world_size, bucket_size, max_bucket_padding, tp_size,
                                         rule, None, rates)
        loads[name] = layout_loads(items, layouts[name], model, base)
    gaps = model.unmeasured({s for it in items if it.is_matrix for s in piece_counts(item_pieces(it))},
                            adamw=any(not it.is_matrix for it in items))
    if gaps:  # a cut start-up profile: unmeasured shapes predicted at the small ones' rate were 2.7x off (measured)
        note = (f"the rank cost model measured nothing for {', '.join(gaps)} (the start-up profile ran out of "
                "`layout.plan_budget_s`); kept the greedy plan (`layout.balance=cost`)")
        warnings.warn(f"DMuon owner MILP: {note}", MilpFallbackWarning)
        layout = layouts["cost"]
        rank_cost[:] = loads["cost"]
        layout.rank_cost = list(loads["cost"])
        if info is not None:
            info.update(backend="greedy", status="unmeasured", makespan=max(loads["cost"], default=0.0),
                        chosen="cost", candidates={n: max(v) if v else 0.0 for n, v in loads.items()},
                        polish_moves=0, seconds=time.perf_counter() - t0, note=note,
                        model=str(model.meta.get("source")))
        return layout
    start = min(CANDIDATES, key=lambda n: _score(loads[n]))
    status, used, note = "greedy", "greedy", ""
    mats = [(i, b) for b, members in enumerate(buckets_members) for i in members if items[i].is_matrix]
    if mats:
        try:
            owners, tp_owners, status, used = _solve(items, buckets_members, mats, base, world_size, tp_size,
                                                     max_bucket_padding, model, layouts[start], backend,
                                                     t0 + (1.0 - polish_share) * time_limit, max_variables)
            layouts["milp"] = assemble_layout(items, buckets_members, owners, tp_owners, world_size, tp_size, base)
            loads["milp"] = layout_loads(items, layouts["milp"], model, base)
        except (ImportError, NoSolution, _TooLarge) as exc:
            note = f"MILP unavailable ({exc}); kept the best greedy plan ({start})"
            warnings.warn(f"DMuon owner MILP: {note}", MilpFallbackWarning)
    chosen = min(layouts, key=lambda n: (_score(loads[n]), n == "milp"))
    layout, final, moves = _polish(items, buckets_members, layouts[chosen], loads[chosen], model, base,
                                   t0 + time_limit)
    greedy = max(loads["cost"], default=0.0)
    if chosen != "cost" or moves:
        if max(final, default=0.0) > (1.0 - min_gain) * greedy:
            note = (f"{note + '; ' if note else ''}kept the greedy plan: the best one found is predicted "
                    f"{100 * (1 - max(final, default=0.0) / greedy) if greedy else 0.0:.1f}% faster, within the "
                    f"{100 * min_gain:.1f}% the model cannot resolve (its own error, at least the GPU's "
                    "round-to-round noise)")
            chosen, moves = "cost", 0
            layout, final = layouts["cost"], list(loads["cost"])
    rank_cost[:] = final
    layout.rank_cost = list(final)
    if info is not None:
        info.update(backend=used, status=status, makespan=max(final) if final else 0.0,
                    chosen=chosen, candidates={n: max(v) if v else 0.0 for n, v in loads.items()}, polish_moves=moves,
                    seconds=time.perf_counter() - t0, note=note, model=str(model.meta.get("source")))
    return layout


def _polish(items, buckets_members, layout, loads, model, base, deadline):
    """Local search on the exact prediction: move one matrix off the slowest cell, or swap it with
    one of another kind on another cell, while that lowers (slowest cell, total) and pads nothing
    more; until no move helps or ``deadline``. Matrices of one kind (bucket, pieces, numel) are
    interchangeable, so one of each kind per cell is tried. Returns (layout, loads, moves made)."""
    D, T = layout.world_size, layout.tp_size
    owners, tp_owners = dict(layout.owners), dict(layout.tp_owners)
    matrices = [it for it in items if it.is_matrix]
    bucket_of = {it.name: layout.param_ranges[it.name][2] for it in matrices}
    kind_of = {it.name: (bucket_of[it.name], item_pieces(it), it.numel) for it in matrices}
    best, moves = _score(loads), 0

    def trial(new_owners, new_tp):
        candidate = assemble_layout(items, buckets_members, new_owners, new_tp, D, T, base, validate=False)
        if candidate.numel > layout.numel:  # padding grew
            return None
        return candidate, layout_loads(items, candidate, model, base)

    def one_per_kind(cell):
        seen = {}
        for it in matrices:
            if owners[it.name] * T + tp_owners.get(it.name, 0) == cell:
                seen.setdefault(kind_of[it.name], it.name)
        return list(seen.values())

    while time.perf_counter() < deadline:
        slowest = max(range(len(loads)), key=loads.__getitem__)
        mine = one_per_kind(slowest)
        theirs = {c: one_per_kind(c) for c in range(D * T) if c != slowest}
        found = None
        for kind in ("move", "swap"):
            for name in mine:
                for c in theirs:
                    if time.perf_counter() >= deadline:
                        break
                    others = [None] if kind == "move" else [
                        n for n in theirs[c] if bucket_of[n] == bucket_of[name] and kind_of[n] != kind_of[name]]
                    for other in others:
                        new_owners, new_tp = dict(owners), dict(tp_owners)
                        new_owners[name], new_tp[name] = divmod(c, T)
                        if other is not None:
                            new_owners[other], new_tp[other] = divmod(slowest, T)
                        result = trial(new_owners, new_tp)
                        if result is not None and _score(result[1]) < best:
                            best, found = _score(result[1]), (new_owners, new_tp, *result)
            if found:
                break
        if not found:
            break
        owners, tp_owners, layout, loads = found
        moves += 1
    if moves:
        layout.validate(items)
    return layout, list(loads), moves


def _matrix_ms(model: RankCostModel, item) -> float:
    """A matrix's per-matrix ms under the model: the sum over its pieces (the greedy's cost)."""
    return sum(n * model.per_matrix_ms(s) for s, n in piece_counts(item_pieces(item)).items())


class _TooLarge(RuntimeError):
    pass


def _bucket_terms(items, buckets_members, world_size, tp_size, start_layout, max_bucket_padding):
    """Per bucket: (phi, shard, shard_max): phi the AdamW share of the free space of the warm
    start's shards (a bucket of matrices and norms, whose shards grew to fit the largest owned
    block, is mostly padding: owning more there displaces little AdamW), shard the warm start's
    shard size, shard_max what the bucket padding allows, or what the warm start needed."""
    used = defaultdict(int)
    for i, it in enumerate(items):
        if it.is_matrix:
            used[start_layout.param_ranges[it.name][2], start_layout.owners[it.name]] += align_up(it.numel)
    out = []
    for b, members in enumerate(buckets_members):
        lo = min_shard(items, members, world_size)
        shard = start_layout.buckets[b].shard_size
        total = sum(items[i].numel for i in members)
        matrices = sum(items[i].numel for i in members if items[i].is_matrix)
        free = world_size * shard - matrices
        phi = min(1.0, (total - matrices) / free) if free > 0 else 1.0
        need = max(used[b, d] for d in range(world_size))
        out.append((phi, shard, max(int(lo * (1.0 + max_bucket_padding)), need - PARAM_ALIGN, lo)))
    return out


def _solve(items, buckets_members, mats, base, D, T, max_bucket_padding, model, start_layout, backend, deadline,
           max_variables):
    cells = D * T
    terms = _bucket_terms(items, buckets_members, D, T, start_layout, max_bucket_padding)
    pieces = {i: piece_counts(item_pieces(items[i])) for i, _ in mats}
    shapes = sorted({s for c in pieces.values() for s in c})
    fits = {s: model.shape_cost(s) for s in shapes}
    launch = {s: max(0.0, fits[s].launch_ms - model.shared_of(s)) for s in shapes}
    per = {s: fits[s].per_matrix_ms for s in shapes}
    adamw = model.elementwise_ms()[0]
    by_key: Dict[tuple, List[int]] = defaultdict(list)
    for j, (i, b) in enumerate(mats):
        by_key[(b, tuple(sorted(pieces[i].items())), align_up(items[i].numel))].append(j)
    keys = sorted(by_key)
    classes = [by_key[k] for k in keys]
    if len(classes) * cells + len(shapes) * cells + 1 > max_variables:
        raise _TooLarge(f"{len(classes) * cells + len(shapes) * cells + 1} variables > max_variables {max_variables}")
    mdl = MilpModel()
    m_var = mdl.var(0.0, math.inf, False, 1.0)
    y = {(k, c): mdl.var(0, len(classes[k]), True) for k in range(len(classes)) for c in range(cells)}
    z = {(s, c): mdl.var(0, 1, True, LAUNCH_TIE / max(1, len(shapes) * cells)) for s in shapes for c in range(cells)}
    for k, members in enumerate(classes):
        mdl.row({y[k, c]: 1.0 for c in range(cells)}, len(members), len(members))
    for s in shapes:
        top = sum(dict(keys[k][1]).get(s, 0) * len(classes[k]) for k in range(len(classes)))
        for c in range(cells):
            coeffs = {y[k, c]: float(dict(keys[k][1]).get(s, 0)) for k in range(len(classes)) if dict(keys[k][1]).get(s)}
            coeffs[z[s, c]] = -float(top)
            mdl.row(coeffs, -math.inf, 0.0)
    for b, (_, _, shard_max) in enumerate(terms):
        for d in range(D):
            coeffs = {y[k, d * T + t]: float(keys[k][2]) for k in range(len(classes)) if keys[k][0] == b for t in range(T)}
            if coeffs:
                mdl.row(coeffs, -math.inf, shard_max + PARAM_ALIGN)
    const = sum(adamw * phi * lo for phi, lo, _ in terms)

    def load(c):  # (coefficients, constant) of cell c's linear load
        d = c // T
        coeffs: Dict[int, float] = defaultdict(float)
        for k, (b, shape_counts, numel) in enumerate(keys):
            ns = sum(n * per[s] for s, n in shape_counts)
            coeffs[y[k, c]] += ns
            displaced = adamw * terms[b][0] * items[mats[classes[k][0]][0]].numel
            for t in range(T):
                coeffs[y[k, d * T + t]] -= displaced
        for s in shapes:
            coeffs[z[s, c]] += launch[s]
        return coeffs, base[c] + const

    rows = [load(c) for c in range(cells)]
    for coeffs, constant in rows:
        with_m = dict(coeffs)
        with_m[m_var] = -1.0
        mdl.row(with_m, -math.inf, -constant)
    if T == 1 and len(set(base)) == 1:  # interchangeable cells: loads in descending order
        for c in range(cells - 1):
            diff = defaultdict(float, rows[c][0])
            for v, a in rows[c + 1][0].items():
                diff[v] -= a
            mdl.row(dict(diff), 0.0, math.inf)
    start = _start(start_layout, items, mats, classes, keys, shapes, y, z, m_var, rows, T)
    if T == 1 and len(set(base)) == 1:
        start = _descending(start, rows, y, z, len(classes), shapes, cells)
    names = ["cbc", "highs"] if backend == "auto" else [backend]
    errors = []
    for name in names:
        left = deadline - time.perf_counter()
        if left <= 0.05:
            errors.append("no time left")
            break
        try:
            values, status = SOLVERS[name](mdl, start, left, 1e-4)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        except NoSolution as exc:
            errors.append(f"{name}: {exc}")
            continue
        counts = [[int(round(values[y[k, c]])) for c in range(cells)] for k in range(len(classes))]
        assigned = spread_counts(classes, counts, len(mats))
        owners, tp_owners = {}, {}
        for (i, _), c in zip(mats, assigned):
            owners[items[i].name], tp_owners[items[i].name] = divmod(c, T)
        return owners, tp_owners, status, name
    raise NoSolution("; ".join(errors), infeasible=False)


def _descending(values, rows, y, z, num_classes, shapes, cells):
    """The warm start with its cells renumbered by descending load (the symmetry rows' order):
    interchangeable cells, so the same plan."""
    load = [constant + sum(a * values[v] for v, a in coeffs.items()) for coeffs, constant in rows]
    order = sorted(range(cells), key=lambda c: -load[c])
    out = dict(values)
    for new, old in enumerate(order):
        for k in range(num_classes):
            out[y[k, new]] = values[y[k, old]]
        for s in shapes:
            out[z[s, new]] = values[z[s, old]]
    return out


def _start(layout, items, mats, classes, keys, shapes, y, z, m_var, rows, T):
    """Variable values of ``layout``'s plan (the warm start)."""
    values: Dict[int, float] = defaultdict(float)
    class_of = {j: k for k, members in enumerate(classes) for j in members}
    for j, (i, _) in enumerate(mats):
        c = layout.owners[items[i].name] * T + layout.tp_owners.get(items[i].name, 0)
        values[y[class_of[j], c]] += 1
        for s in piece_counts(item_pieces(items[i])):
            values[z[s, c]] = 1.0
    for key in y.values():
        values.setdefault(key, 0.0)
    for key in z.values():
        values.setdefault(key, 0.0)
    values[m_var] = max(constant + sum(a * values[v] for v, a in coeffs.items()) for coeffs, constant in rows)
    return dict(values)
