"""Rank 0's owner planning: which DP x TP cell owns each Muon matrix of every DDP buffer, and the
owner-aligned layout around it. Pure data in, pure data out: ``plan_owners`` takes each buffer's
records and owner grid (``BufferParams``), the layout options (``OwnerPlanningOptions``) and where
the costs come from (``CostSource``), and returns the ``PlannedOwners`` that rank 0 broadcasts.

megatron/ddp.py::build_plan is its one production caller: it turns Megatron's buffers and the
run's config into these inputs on rank 0 of the pipeline stage, broadcasts the result and builds
the DMuonPlan and Megatron's FullParamLayout from it.

    counts      = the NS piece shapes of every matrix, and how many of each
    model       = costs.cost_model_fn(shapes, batch) | costs.rank_profile(counts, cells, budget) | None
    cost        = per matrix, summed over its pieces: ms under a per-matrix model, else costs.ns_cost
    elementwise = options.elementwise, or 'auto': the cluster config's rates in the same units
    layouts     = the plan cache's entry for (items, sizes, options, costs), if it is sound
                | per buffer: plan_rank_owner_layout (the rank MILP) or plan_owner_layout
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from collections import Counter
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from .caches import PlanCache, plan_key
from .cost_model import DeviceSpec, cluster_for_device, device_spec_for, elementwise_costs, exchange_costs
from .owner_layout import BalanceMethod, OwnerLayout, ParamItem, plan_owner_layout
from .plan import MatrixRecord
from .rank_cost import RankCostModel
from .rank_milp import plan_rank_owner_layout
from .split_layout import plan_split_layout
from .startup_budget import STARTUP_BUDGET_S, milp_time_limit, profile_budget

Shape = Tuple[int, int]


@dataclasses.dataclass(frozen=True)
class BufferParams:
    """One DDP buffer as the owner planner sees it: its params' records (no owners, no costs) in
    buffer order, and the grid of cells that own its matrices."""

    records: Tuple[MatrixRecord, ...]
    dp_size: int
    tp_size: int = 1
    expert: bool = False  # expert buffers share one load per cell, dense buffers another

    @property
    def sizes(self) -> Tuple[int, int]:
        return self.dp_size, self.tp_size


@dataclasses.dataclass(frozen=True)
class OwnerPlanningOptions:
    """The layout options the owner planning reads (the run's ``LayoutOptions`` has them under
    the same names, beside those of the DDP and the cost source)."""

    balance: str = "cost"
    max_bucket_padding: float = 0.02
    milp_options: Optional[dict] = None
    elementwise: object = "auto"  # (AdamW, Muon) work per element, 'auto' (cluster config) or None
    plan_cache: Optional[str] = None  # a PlanCache file: a plan made for the same inputs is reused
    plan_budget_s: Optional[float] = None  # bounds profiling + MILP together
    # profile the owner step on this GPU first (``CostSource.rank_profile``): the rank MILP's cost model
    profile: bool = False
    # how matrices lie in the DP shards: 'whole', 'split' or 'auto' (the cheaper under the cost model,
    # per buffer: ``choose_scheme``); ``split_allowed`` False keeps 'auto' to 'whole' (a run whose
    # features need whole matrices: DMuonConfig.split_layout_refusal)
    dp_layout: str = "auto"
    split_allowed: bool = True
    # the run's step is overlapped (MuonSettings.overlap_step 'on' or 'sync'): 'auto' weighs the layouts by padding
    # alone (``choose_scheme``)
    overlapped_step: bool = False
    # the split layout may share a large matrix's NS over a team of homes on several nodes (planning/
    # split_layout.py): the run's NS may run Gram (its NS method gram or auto) and its step is not overlapped
    shared_ns: bool = False


@dataclasses.dataclass(frozen=True)
class CostSource:
    """Where rank 0's costs come from. ``ns_cost(piece shape)``: one NS piece's cost (FLOPs),
    used unless a per-matrix model gives ms. ``cost_model_fn(shapes, max batch)``: a model with
    ``per_matrix_ms`` / ``launch_ms`` (planning.cost_model.CostModel) or a RankCostModel.
    ``rank_profile(shape counts, owner cells, budget_s)``: the start-up profile's RankCostModel, taken
    where the options ask for it (``OwnerPlanningOptions.profile``)
    (measured by the caller's runtime; ``cost_model_fn`` wins when both are given). ``gpu_name``:
    this GPU, whose cluster-config rates price the element-wise work (None off CUDA: the first
    device, quietly)."""

    ns_cost: Callable[[Shape], float]
    cost_model_fn: Optional[Callable[[List[Shape], int], object]] = None
    rank_profile: Optional[Callable[[Dict[Shape, int], int, float], RankCostModel]] = None
    gpu_name: Optional[str] = None
    gpus_per_node: int = 8  # where a DP group leaves NVLink (the split layout's exchange and the collectives)


@dataclasses.dataclass(frozen=True)
class PlannedOwners:
    """What rank 0 planned and broadcasts: each buffer's OwnerLayout (JSON, by buffer key) and
    each Muon matrix's (cost, launch cost), recorded in every rank's plan."""

    layouts: Dict[Hashable, str]
    costs: Dict[str, Tuple[float, float]]

    def layout(self, key) -> OwnerLayout:
        return OwnerLayout.from_json(self.layouts[key])

    def costed(self, record: MatrixRecord) -> MatrixRecord:
        """``record`` with the cost rank 0 planned it with."""
        if not record.use_muon:
            return record
        cost, launch_cost = self.costs[record.name]
        return dataclasses.replace(record, cost=cost, launch_cost=launch_cost)


def plan_owners(buffers: Mapping[Hashable, BufferParams], bucket_size: Optional[int],
                options: OwnerPlanningOptions, costs: CostSource) -> PlannedOwners:
    """The owners and owner-aligned layout of every buffer (keyed as ``buffers``; a key's ``str``
    names it in the plan cache). A matrix costs the sum over its NS pieces. Each buffer's owners are
    placed by ``options.balance`` (planning/balance.py: 'milp' is the rank MILP on a rank cost model,
    the buffers sharing its time limit, else the matrix MILP of ``plan_owner_layout``). ``options.plan_budget_s`` bounds
    the profile and the MILP together; ``options.plan_cache`` reuses a plan made for the same
    items, sizes, options and costs."""
    started = time.perf_counter()
    model = _cost_model(buffers, options, costs)
    rank_model = model if isinstance(model, RankCostModel) else None
    if rank_model is not None:  # the greedy warm start plans on NS FLOPs, as balance 'cost' does
        model = None
    milp_options = options.milp_options
    if options.plan_budget_s is not None and BalanceMethod(options.balance).solves_milp:
        limit = milp_time_limit(options.plan_budget_s, time.perf_counter() - started,
                                (milp_options or {}).get("time_limit_s"))
        milp_options = dict(milp_options or {}, time_limit_s=limit)
    items = {key: [r.param_item() for r in _costed(b.records, costs.ns_cost, model)] for key, b in buffers.items()}
    elementwise = _elementwise(options.elementwise, model, costs.gpu_name)
    cache, cache_key = None, None
    if options.plan_cache is not None:
        cache = PlanCache(options.plan_cache)
        inputs = {"items": {str(k): [dataclasses.astuple(it) for it in items[k]] for k in buffers},
                  "sizes": {str(k): b.sizes for k, b in buffers.items()}, "bucket_size": bucket_size,
                  "max_bucket_padding": options.max_bucket_padding, "balance": options.balance,
                  "milp_options": milp_options, "elementwise": elementwise,
                  "rank_model": rank_model.to_json() if rank_model is not None else None}
        if any("split" in _schemes(options, b) for b in buffers.values()):  # (whole-only plans keep their keys)
            inputs.update(dp_layout=options.dp_layout, gpus_per_node=costs.gpus_per_node)
            if options.overlapped_step:  # ('auto' weighs the layouts otherwise there: choose_scheme)
                inputs["overlapped_step"] = True
            if options.shared_ns:
                inputs["shared_ns"] = True
        cache_key = plan_key(inputs)
        cached = cache.get(cache_key)
        problem = _cached_plan_problem(cached, buffers, items) if cached is not None else None
        if problem:  # a damaged or foreign entry: planned again (and replaced below)
            warnings.warn(f"{cache.label} {cache.path}: its entry for this model is unusable ({problem}); "
                          "planning again", RuntimeWarning)
        elif cached is not None:
            return PlannedOwners({k: cached[str(k)] for k in buffers}, _cost_of(items))
    device = _device(model, costs.gpu_name)
    layouts = _plan_buffers(buffers, items, bucket_size, options, milp_options, elementwise, rank_model,
                            lambda b: _exchange_rates(device, b, costs.gpus_per_node, "flops" if model is None else "ms"))
    planned = PlannedOwners({k: layout.to_json() for k, layout in layouts.items()}, _cost_of(items))
    if cache is not None:
        cache.put(cache_key, {str(k): v for k, v in planned.layouts.items()})
    return planned


def _cost_model(buffers, options, costs):
    """The cost model of the shapes the owner step will orthogonalize (None: NS FLOPs)."""
    if costs.cost_model_fn is None and not (options.profile and costs.rank_profile is not None):
        return None
    counts = Counter()
    for r in (r for b in buffers.values() for r in b.records):
        for shape, n in map(_matrices_of, r.pieces):
            counts[shape] += n
    if costs.cost_model_fn is not None:
        return costs.cost_model_fn(sorted(counts), min(max(counts.values(), default=1), 8))
    cells = min(b.dp_size * b.tp_size for b in buffers.values()) if buffers else 1
    return costs.rank_profile(counts, cells, profile_budget(options.plan_budget_s or STARTUP_BUDGET_S))


def _matrices_of(piece) -> Tuple[Shape, int]:
    """(matrix shape, count) of an NS piece: a matrix, or a [heads, rows, cols] stack of them."""
    return (tuple(piece[-2:]), piece[0]) if len(piece) == 3 else (tuple(piece), 1)


def _costed(records: Sequence[MatrixRecord], ns_cost, model) -> List[MatrixRecord]:
    """The records with each matrix's predicted NS cost: the sum over its pieces, in ms (and
    batched-launch ms) under a per-matrix cost model, else ``ns_cost`` (FLOPs)."""
    out = []
    for r in records:
        if r.use_muon:
            matrices = [_matrices_of(s) for s in r.pieces]
            if model is not None:
                r = dataclasses.replace(r, cost=sum(n * model.per_matrix_ms(s) for s, n in matrices),
                                        launch_cost=sum(model.launch_ms(s) for s in {s for s, _ in matrices}))
            else:
                r = dataclasses.replace(r, cost=sum(n * ns_cost(s) for s, n in matrices))
        out.append(r)
    return out


def _elementwise(requested, model, gpu_name: Optional[str]):
    """``plan_owner_layout``'s `elementwise` in the planner's units: as requested, or for 'auto'
    ms under a per-matrix cost model of a cluster-config device, else NS FLOPs at this GPU's rates
    (the cluster config's first device off CUDA)."""
    if not isinstance(requested, str):
        return requested
    if model is not None:
        device = getattr(model, "device", None)
        return elementwise_costs(device, "ms") if isinstance(device, DeviceSpec) else None
    return elementwise_costs(device_spec_for(gpu_name or "", warn=gpu_name is not None), "flops")


def _device(model, gpu_name: Optional[str]) -> DeviceSpec:
    """The device whose rates price the planner's costs: the cost model's, else this GPU's (the
    cluster config's first off CUDA)."""
    device = getattr(model, "device", None)
    return device if isinstance(device, DeviceSpec) else device_spec_for(gpu_name or "", warn=False)


def _exchange_rates(device: DeviceSpec, b: "BufferParams", gpus_per_node: int, unit: str):
    """(cost_model.ExchangeCosts, DP ranks a node) for buffer ``b`` on this device's cluster with
    ``gpus_per_node`` GPUs a node."""
    cluster = dataclasses.replace(cluster_for_device(device), gpus_per_node=gpus_per_node)
    return exchange_costs(device, cluster, b.dp_size, b.tp_size, unit), max(gpus_per_node // b.tp_size, 1)


# the split layout replaces the whole one only where it is predicted this much cheaper: within the
# cost model's own error (the rank model is within ~6% of the emulated GPUs, docs/load_balancing.md)
# the whole layout, which exchanges nothing, stays
SPLIT_MIN_GAIN = 0.05


def predicted_cost(layout: OwnerLayout, loads: Sequence[float], collective: float) -> float:
    """A layout's predicted step in the planner's units: the slowest cell's load after it (NS,
    element-wise work and, split, the moves to NS homes) plus its buffers through the param all-gather
    that publishes the step (``collective`` per element of the padded buffer: cost_model.ExchangeCosts),
    as bench/rank_scale.py's step counts them."""
    return max(loads) + collective * layout.numel


# ... unless the whole layout pads its buffers by more than this over Megatron's own (the split layout's):
# then it breaks the bytes goal of docs/dmuon_dp.md (at most 1.10x AdamW's) and is kept only where the
# model predicts it SPLIT_MIN_GAIN faster, beyond the model's error
WHOLE_PADDING_LIMIT = 0.10


# Under an overlapped step (overlap_step 'on' or 'sync') the whole layout's NS runs beside its all-gathers,
# and the split layout's way back runs group by group through each group's few homes: modelled from the
# H100 emulation (docs/dmuon_dp.md, the overlapped table), the whole layout is the faster one wherever its
# buffers are at most 1.28x the split one's (7B DP 16-64, 32B DP 128) and the split one from 2.26x (7B DP
# 128+, 32B DP 256+). 'auto' then keeps whole matrices unless they pad the buffers by more than this.
OVERLAPPED_WHOLE_PADDING_LIMIT = 0.5


def choose_scheme(candidates: Mapping[str, Tuple[OwnerLayout, List[float]]], collective: float,
                  overlapped: bool = False) -> str:
    """'split' where its ``predicted_cost`` is at least ``SPLIT_MIN_GAIN`` below the whole layout's, else
    'whole' (the only candidate, or the one kept within the model's error); where the whole layout pads
    its buffers by more than ``WHOLE_PADDING_LIMIT`` the margin turns round: the whole one is kept only
    where it is predicted ``SPLIT_MIN_GAIN`` cheaper than the split one. ``overlapped`` (the step is
    overlapped): 'split' only where the whole layout pads by more than ``OVERLAPPED_WHOLE_PADDING_LIMIT``."""
    if "split" not in candidates or "whole" not in candidates:
        return next(iter(candidates))
    if overlapped:
        limit = (1.0 + OVERLAPPED_WHOLE_PADDING_LIMIT) * candidates["split"][0].numel
        return "split" if candidates["whole"][0].numel > limit else "whole"
    whole, split = (predicted_cost(*candidates[k], collective) for k in ("whole", "split"))
    padded = candidates["whole"][0].numel > (1.0 + WHOLE_PADDING_LIMIT) * candidates["split"][0].numel
    return "split" if split < (1.0 + SPLIT_MIN_GAIN if padded else 1.0 - SPLIT_MIN_GAIN) * whole else "whole"


def _plan_buffers(buffers, items, bucket_size, options, milp_options, elementwise,
                  rank_model, rates) -> Dict[Hashable, OwnerLayout]:
    """Each buffer's OwnerLayout, the loads of the buffers planned before it carried along
    (dense and expert buffers apart: their owners are different cells). Under 'auto' both schemes
    are planned from the same loads and ``choose_scheme`` keeps one; ``rates(buffer)``: its
    (ExchangeCosts, DP ranks a node)."""
    rank_cost: Dict[bool, List[float]] = {}
    layouts = {}
    for key, b in buffers.items():
        cost = rank_cost.setdefault(b.expert, [0.0] * (b.dp_size * b.tp_size))
        schemes = _schemes(options, b)
        if "split" in schemes:
            exchange, per_node = rates(b)
            collective = exchange.collective
            candidates = {}
            for scheme in schemes:
                loads = list(cost)
                candidates[scheme] = (plan_split_layout(items[key], b.dp_size, bucket_size, loads, b.tp_size,
                                                        elementwise, exchange.move, per_node, exchange.node_move,
                                                        shared_ns=options.shared_ns)
                                      if scheme == "split"
                                      else _plan_whole(items[key], b, bucket_size, options, milp_options, elementwise,
                                                       rank_model, loads, len(buffers)), loads)
            chosen = choose_scheme(candidates, collective, options.overlapped_step)
            layouts[key], cost[:] = candidates[chosen]
            continue
        layouts[key] = _plan_whole(items[key], b, bucket_size, options, milp_options, elementwise, rank_model, cost,
                                   len(buffers))
    return layouts


def _schemes(options: OwnerPlanningOptions, b: BufferParams) -> Tuple[str, ...]:
    """The layouts planned for buffer ``b``: the one asked for, or under 'auto' both where the run
    can take the split one and more than one DP rank shares the buffer."""
    if options.dp_layout != "auto":
        return (options.dp_layout,)
    return ("whole", "split") if options.split_allowed and b.dp_size > 1 else ("whole",)


def _plan_whole(items, b, bucket_size, options, milp_options, elementwise, rank_model, cost,
                buffer_count) -> OwnerLayout:
    """One buffer's whole-matrix layout (owner_layout.py, or the rank MILP's), ``cost`` updated."""
    rule = BalanceMethod(options.balance).layout_rule(rank_model is not None)
    if rule is None:
        # the rank MILP uses all of its limit (local search included): buffers share it
        shared = dict(milp_options or {})
        if "time_limit_s" in shared:
            shared["time_limit_s"] /= buffer_count
        return plan_rank_owner_layout(items, b.dp_size, bucket_size, options.max_bucket_padding, cost, b.tp_size,
                                      milp_options=shared, elementwise=elementwise, model=rank_model)
    return plan_owner_layout(items, b.dp_size, bucket_size, options.max_bucket_padding, cost, b.tp_size,
                             rule, milp_options=milp_options, elementwise=elementwise)


def _cached_plan_problem(cached, buffers, items) -> Optional[str]:
    """Why a plan-cache entry cannot serve these buffers (None: it can): other buffers, a layout
    that does not read, or one that fails the layout's invariants at these DP x TP sizes."""
    try:
        if set(cached) != {str(k) for k in buffers}:
            return "other buffers"
        for key, b in buffers.items():
            layout = OwnerLayout.from_json(cached[str(key)])
            if (layout.world_size, layout.tp_size) != b.sizes:
                return f"made for DP x TP {layout.world_size} x {layout.tp_size}, not {b.dp_size} x {b.tp_size}"
            layout.validate(items[key])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _cost_of(items: Mapping[Hashable, Sequence[ParamItem]]) -> Dict[str, Tuple[float, float]]:
    """{matrix name: (cost, launch cost)} the plan was made with."""
    return {it.name: (it.cost, it.launch_cost) for recs in items.values() for it in recs if it.is_matrix}
