"""Owner plans of one pipeline stage side by side, each predicted with the same cost model.

Planners (all produce an owner-aligned ``OwnerLayout`` per DDP buffer through
``plan_owner_layout``; only who owns what differs):

* ``round_robin``: matrices in buffer order to the DP x TP cells in turn;
* ``numel_lpt``: Megatron 0.19's LayerWise rule: largest numel first to the cell with the least
  numel;
* ``megatron_lpt``: Megatron-LM main's layer-sharded Muon (PR #6379): largest max(M,N)·min(M,N)²
  first to the cell with the least of it (whole matrices, no element-wise work counted);
* ``greedy``: ours: largest predicted NS cost (planning/params.ns_cost: the pieces the owner step
  orthogonalizes, their schedule) first to the least-loaded cell, element-wise work counted;
* ``milp``: planning/milp.py on predicted milliseconds with batched-launch costs.

Every plan is then predicted with the one ``CostModel``: per GPU, each same-shape group it owns
costs launch + k x per-matrix (one batched NS call per shape, as the owner step runs it).
"""
from __future__ import annotations

import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence

from .cost_model import CostModel
from .models import ModelSpec, ParallelSpec, ParamSpec, stage_params
from .layout_stats import state_bytes_per_rank
from .owner_layout import OwnerLayout, ParamItem, megatron_bucket_size, plan_owner_layout
from .split_layout import dp_nodes, exchange_bytes_sent, plan_split_layout
from .params import ns_cost

__all__ = ["PLANNERS", "buffer_items", "split_rule_for", "matrix_pieces", "transformer_shape", "split_pieces", "plan_stage",
           "predict_stage", "compare_plans"]

# the whole-matrix planners (owner_layout.py), then the split layout's NS homes (split_layout.py)
PLANNERS = ("round_robin", "numel_lpt", "megatron_lpt", "greedy", "milp", "split")
# their plan_owner_layout rules (planning/balance.py; milp: the matrix MILP, or the rank MILP on a rank model)
_LAYOUT_RULE = {"round_robin": "round_robin", "numel_lpt": "numel_lpt", "megatron_lpt": "megatron_lpt", "greedy": "cost",
                "milp": "matrix_milp"}


def shape_group(shape: Sequence[int]) -> str:
    """The owner step batches matrices of the same (full, TP-merged) shape in one NS call."""
    return "x".join(str(int(s)) for s in shape)


def buffer_items(params: Sequence[ParamSpec], cost_model: Optional[CostModel] = None,
                 pieces: Optional[Callable[[str, Sequence[int]], List[tuple]]] = None,
                 cost_fn: Callable[[Sequence[int]], float] = ns_cost) -> List[ParamItem]:
    """Planner items of one buffer: with ``cost_model``, cost = predicted ms per matrix and
    launch_cost = the batched call's fixed ms; without, cost = NS FLOPs (``cost_fn``: the
    standard 5-step count by default; ``ns_choice.owner_ns_cost`` for the run's NS).
    ``pieces(name, full_shape)``: the shapes the owner step orthogonalizes for a matrix (its
    split, ``split_pieces``); a matrix then costs the sum over them. None: the whole matrix."""
    items = []
    for p in params:
        cost = launch = 0.0
        if p.is_matrix:
            shapes = pieces(p.name, p.full_shape) if pieces is not None else [tuple(p.full_shape)]
            if cost_model is None:
                cost = sum(cost_fn(s) for s in shapes)
            else:
                cost = sum(cost_model.shape_cost(s).per_matrix_ms for s in shapes)
                launch = sum(cost_model.shape_cost(s).launch_ms for s in set(shapes))
        items.append(ParamItem(p.name, p.numel, p.is_matrix, cost, shape_group(p.full_shape), launch_cost=launch,
                               pieces=tuple(tuple(s) for s in shapes) if p.is_matrix else ()))
    return items


def split_rule_for(name: str, shape: Sequence[int], config, split: dict):
    """How the owner step cuts the full matrix ``name`` before NS under its split flags
    (``split_qkv``, ``split_glu``, ``per_head``; ``config``: a TransformerConfig or
    ``transformer_shape``): ``rule_for_megatron_param``'s rule, or None (no flag set: the whole
    matrix). The one split policy of the package (the plan records its answer)."""
    if not any(split.values()) or config is None:
        return None
    from ..algorithms.splitting import rule_for_megatron_param

    return rule_for_megatron_param(name, tuple(shape), config, **split)


def matrix_pieces(name: str, shape: Sequence[int], config, split: dict) -> List[tuple]:
    """Shapes the optimizer orthogonalizes for the matrix ``name`` of full ``shape`` (``split_rule_for``)."""
    rule = split_rule_for(name, shape, config, split)
    return [tuple(shape)] if rule is None else rule.piece_shapes(shape)


def transformer_shape(model: ModelSpec) -> SimpleNamespace:
    """The TransformerConfig attributes the split rules read, for a ``ModelSpec``."""
    return SimpleNamespace(num_attention_heads=model.heads, num_query_groups=model.groups,
                           kv_channels=model.head_dim, hidden_size=model.hidden, gated_linear_unit=model.swiglu,
                           attention_output_gate=False)


def split_pieces(model: ModelSpec, split: dict) -> Callable[[str, Sequence[int]], List[tuple]]:
    """``buffer_items``'s ``pieces`` for ``model`` under the optimizer's split flags."""
    config = transformer_shape(model)
    return lambda name, shape: matrix_pieces(name, shape, config, split)


def _sizes(kind: str, par: ParallelSpec):
    return (par.expert_dp_size, par.expert_tp) if kind == "expert" else (par.dp_size, par.tp)


def plan_stage(model: ModelSpec, par: ParallelSpec, cost_model: CostModel, planner: str, *, stage: int = 0,
               bucket_size: Optional[int] = None, max_bucket_padding: float = 0.02,
               milp_options: Optional[dict] = None, split: Optional[dict] = None,
               elementwise: Optional[tuple] = None, cost_fn: Callable[[Sequence[int]], float] = ns_cost,
               rank_model=None, shared_ns: bool = False) -> dict:
    """{'layouts': {kind: OwnerLayout}, 'params': {kind: [ParamSpec]}, 'info': {...}, 'seconds'}.

    ``split`` (the optimizer's split flags) costs matrices by their pieces; ``elementwise``
    (AdamW, Muon) is ``plan_owner_layout``'s, in the planner's units (NS FLOPs; ms for 'milp').
    ``rank_model`` (planning/rank_cost.py): 'milp' minimises the slowest rank's predicted owner
    step under it (planning/rank_milp.py), the other planners are unchanged. ``shared_ns``: the
    'split' planner may share tall matrices' NS over teams of homes (split_layout.shares_ns)."""
    if planner not in PLANNERS:
        raise ValueError(f"planner {planner!r} unknown; valid: {', '.join(PLANNERS)}")
    params = {k: v for k, v in stage_params(model, par, stage).items() if v}
    layouts, info = {}, {}
    t0 = time.perf_counter()
    for kind, plist in params.items():
        dp, tp = _sizes(kind, par)
        items = buffer_items(plist, cost_model if planner == "milp" and rank_model is None else None,
                             split_pieces(model, split) if split else None, cost_fn)
        kinfo: dict = {}
        if planner == "milp" and rank_model is not None:
            from .rank_milp import plan_rank_owner_layout

            layouts[kind] = plan_rank_owner_layout(items, dp, bucket_size, max_bucket_padding, None, tp, milp_options,
                                                   kinfo, elementwise, model=rank_model)
        elif planner == "split":
            exchange, per_node = _exchange_costs(cost_model, dp, tp)
            layouts[kind] = plan_split_layout(items, dp, bucket_size, None, tp, elementwise, exchange.move, per_node,
                                              exchange.node_move, shared_ns)
        else:
            layouts[kind] = plan_owner_layout(items, dp, bucket_size, max_bucket_padding, None, tp, _LAYOUT_RULE[planner],
                                              milp_options=milp_options, info=kinfo, elementwise=elementwise)
        if kinfo:
            info[kind] = kinfo
    return {"layouts": layouts, "params": params, "info": info, "seconds": time.perf_counter() - t0}


def _exchange_costs(cost_model: Optional[CostModel], dp: int, tp: int):
    """(cost_model.ExchangeCosts, DP ranks a node) of the split layout in the planner's units (ms under
    a cost model, else NS FLOPs) on the cost model's device's cluster (the cluster config's first
    device without one)."""
    from .cost_model import cluster_for_device, device_spec_for, exchange_costs

    device = cost_model.device if cost_model is not None else device_spec_for("", warn=False)
    cluster = cluster_for_device(device)
    return (exchange_costs(device, cluster, dp, tp, "ms" if cost_model else "flops"),
            max(cluster.gpus_per_node // tp, 1))


def cell_ms(layout: OwnerLayout, params: Sequence[ParamSpec], cost_model: CostModel) -> List[float]:
    """Predicted NS time of each DP x TP cell of one buffer's plan."""
    full = {p.name: p.full_shape for p in params}
    counts = defaultdict(int)
    for name, dp in layout.owners.items():
        counts[dp * layout.tp_size + layout.tp_owners.get(name, 0), tuple(full[name])] += 1
    ms = [0.0] * (layout.world_size * layout.tp_size)
    for (cell, shape), k in counts.items():
        ms[cell] += cost_model.time_ms(shape, k)
    return ms


def gpu_cells(par: ParallelSpec, r: int) -> Dict[str, int]:
    """Megatron's rank order inside a stage: TP fastest, then DP; experts: expert TP, EP, expert DP."""
    etp = par.expert_tp
    return {"dense": r, "expert": (r // (etp * par.ep)) * etp + r % etp}


def _buffer_bytes(layout: OwnerLayout, per_element: float) -> float:
    d = layout.world_size
    return sum((d - 1) / d * (b.end - b.start) * per_element for b in layout.buckets)


def predict_stage(plan: dict, par: ParallelSpec, cost_model: CostModel, grad_bytes: int = 4,
                  param_bytes: int = 2, momentum_bytes: int = 4) -> dict:
    """Per GPU predicted owner time, bytes, padding, makespan and mean of a ``plan_stage`` plan,
    and its optimizer state (``state_bytes_per_rank``) next to Megatron's AdamW
    DistributedOptimizer's on the same stage (fp32 master where the model is narrower, two fp32
    moments, per element / DP)."""
    layouts, params = plan["layouts"], plan["params"]
    per_cell = {k: cell_ms(layouts[k], params[k], cost_model) for k in layouts}
    gpus = par.dp_size * par.tp
    rank_ms = [sum(per_cell[k][gpu_cells(par, r)[k]] for k in per_cell) for r in range(gpus)]
    reduce_b = sum(_buffer_bytes(l, grad_bytes) for l in layouts.values())
    publish_b = sum(_buffer_bytes(l, param_bytes) for l in layouts.values())
    # the split layout's pieces to their NS homes and the directions back: the busiest rank's sends
    exchange_b = sum(max(exchange_bytes_sent(l, dp_nodes(l.world_size, max(par.gpus_per_node // l.tp_size, 1))))
                     for l in layouts.values())
    pad = sum(b.end - b.start - b.numel_unpadded for l in layouts.values() for b in l.buckets)
    owned = [0] * gpus
    for k, layout in layouts.items():
        numel = {p.name: p.numel for p in params[k]}
        for r in range(gpus):
            c = gpu_cells(par, r)[k]
            owned[r] += sum(numel[n] for n, dp in layout.owners.items()
                            if dp * layout.tp_size + layout.tp_owners.get(n, 0) == c)
    state = [0] * gpus
    adamw_state = 0.0
    master = 4 if param_bytes < 4 else 0
    for k, layout in layouts.items():
        per_dp = state_bytes_per_rank(layout, param_bytes, momentum_bytes)
        for r in range(gpus):
            state[r] += per_dp[gpu_cells(par, r)[k] // layout.tp_size]["total"]
        adamw_state += (master + 8) * layout.numel_unpadded / layout.world_size
    makespan = max(rank_ms)
    mean = sum(rank_ms) / len(rank_ms)
    return {"state_bytes_per_rank": state, "max_state_bytes": max(state),
            "adamw_distopt_state_bytes_per_rank": adamw_state,"makespan_ms": makespan, "mean_ms": mean, "makespan_over_mean": makespan / mean if mean else 1.0,
            "rank_ms": rank_ms, "owned_numel": owned,
            "bytes_per_rank": reduce_b + publish_b + exchange_b, "reduce_bytes_per_rank": reduce_b,
            "publish_bytes_per_rank": publish_b, "exchange_bytes_per_rank": exchange_b, "padding_elements": pad,
            "padding_bytes": pad * (grad_bytes + param_bytes),
            "buckets": {k: len(l.buckets) for k, l in layouts.items()}}


def lower_bound_ms(params: Dict[str, List[ParamSpec]], par: ParallelSpec, cost_model: CostModel) -> float:
    """max(heaviest single matrix with its launch, total work / GPUs of the stage), total work
    counting each shape group's launch once per buffer (experts: once per EP rank)."""
    largest, total = 0.0, 0.0
    for kind, plist in params.items():
        shapes = [tuple(p.full_shape) for p in plist if p.is_matrix]
        copies = par.ep if kind == "expert" else 1
        for s in shapes:
            sc = cost_model.shape_cost(s)
            largest = max(largest, sc.launch_ms + sc.per_matrix_ms)
            total += copies * sc.per_matrix_ms
        total += copies * sum(cost_model.shape_cost(s).launch_ms for s in set(shapes))
    return max(largest, total / (par.dp_size * par.tp))


def compare_plans(model: ModelSpec, par: ParallelSpec, cost_model: CostModel, *, planners=PLANNERS,
                  stage: int = 0, overlap_grad_reduce: bool = False, bucket_size: Optional[int] = None,
                  max_bucket_padding: float = 0.02, milp_options: Optional[dict] = None,
                  grad_bytes: int = 4, param_bytes: int = 2, momentum_bytes: int = 4,
                  plans_out: Optional[dict] = None) -> dict:
    """``{'plans': {planner: prediction}, 'lower_bound_ms', 'model', 'parallel', ...}``; the
    ``plan_stage`` results go to ``plans_out`` (by planner) when given."""
    size = megatron_bucket_size(par.dp_size, overlap_grad_reduce, bucket_size, pp_rank=stage)
    out = {"model": model.name, "stage": stage, "bucket_size": size,
           "parallel": {"dp": par.dp_size, "tp": par.tp, "pp": par.pp, "ep": par.ep, "etp": par.expert_tp,
                        "world": par.world},
           "plans": {}}
    for planner in planners:
        plan = plan_stage(model, par, cost_model, planner, stage=stage, bucket_size=size,
                          max_bucket_padding=max_bucket_padding, milp_options=milp_options)
        if plans_out is not None:
            plans_out[planner] = plan
        pred = predict_stage(plan, par, cost_model, grad_bytes, param_bytes, momentum_bytes)
        pred["plan_seconds"] = plan["seconds"]
        if plan["info"]:
            pred["solver"] = plan["info"]
        out["plans"][planner] = pred
        out.setdefault("_params", plan["params"])
    params = out.pop("_params")
    lb = lower_bound_ms(params, par, cost_model)
    out["lower_bound_ms"] = lb
    for pred in out["plans"].values():
        pred["makespan_over_lower_bound"] = pred["makespan_ms"] / lb if lb else 1.0
    out["matrices"] = {k: sum(p.is_matrix for p in v) for k, v in params.items()}
    out["shapes"] = {shape_group(s): {"launch_ms": cost_model.shape_cost(s).launch_ms,
                                      "per_matrix_ms": cost_model.shape_cost(s).per_matrix_ms,
                                      "source": cost_model.source(s)}
                     for s in sorted({tuple(p.full_shape) for v in params.values() for p in v if p.is_matrix})}
    return out


def predict_rank_ms(plan: dict, par: ParallelSpec, rank_model, model: Optional[ModelSpec] = None,
                    split: Optional[dict] = None) -> List[float]:
    """Per GPU of the stage, the predicted owner step (ms) of a ``plan_stage`` plan under the rank
    cost model (planning/rank_cost.py): the pieces each GPU orthogonalizes (``split`` with
    ``model``: the optimizer's split flags) and the AdamW fragments inside its shards, read off
    the layouts; dense and expert buffers add up."""
    from .rank_milp import layout_work

    works = {}
    for kind, layout in plan["layouts"].items():
        items = buffer_items(plan["params"][kind], None, split_pieces(model, split) if split and model else None)
        works[kind] = layout_work(items, layout)
    gpus = par.dp_size * par.tp
    return [sum(rank_model.rank_ms(works[k][gpu_cells(par, r)[k]]) for k in works) for r in range(gpus)]


RANK_PLANNERS = ("greedy", "numel_lpt", "megatron_lpt", "milp")


def compare_rank_plans(model: ModelSpec, par: ParallelSpec, rank_model, *, split: Optional[dict] = None,
                       stage: int = 0, bucket_size: Optional[int] = None, elementwise: Optional[tuple] = None,
                       cost_fn: Callable[[Sequence[int]], float] = ns_cost, milp_options: Optional[dict] = None,
                       planners: Sequence[str] = RANK_PLANNERS, plans_out: Optional[dict] = None) -> dict:
    """The four planners a job can run, each predicted per GPU by the rank cost model (the whole
    owner step: the pieces under ``split``, the AdamW fragments of its shards): ``greedy``
    (balance 'cost': ``cost_fn`` FLOPs and ``elementwise``), Megatron's two LPT rules, and
    ``milp`` on ``rank_model`` (balance 'milp', the rank MILP). {'plans': {planner: {'rank_ms',
    'makespan_ms', 'mean_ms', 'plan_seconds', 'solver'}}}."""
    out = {"plans": {}, "rank_model": dict(rank_model.meta)}
    for planner in planners:
        kw = dict(stage=stage, bucket_size=bucket_size, split=split, cost_fn=cost_fn)
        if planner in ("greedy", "milp"):
            kw["elementwise"] = elementwise
        if planner == "milp":
            kw.update(rank_model=rank_model, milp_options=milp_options)
        plan = plan_stage(model, par, None, planner, **kw)
        if plans_out is not None:
            plans_out[planner] = plan
        rank_ms = predict_rank_ms(plan, par, rank_model, model, split)
        row = {"rank_ms": rank_ms, "makespan_ms": max(rank_ms), "mean_ms": sum(rank_ms) / len(rank_ms),
               "plan_seconds": plan["seconds"]}
        if plan["info"]:
            row["solver"] = plan["info"]
        out["plans"][planner] = row
    return out
