"""Predicted optimizer step at scale: the NS cost model + HBM passes + an alpha-beta network model.

For one pipeline stage of a GPT (planning/models.py) on a cluster (clusters.json: device, GPUs per
node, NVLink and InfiniBand alpha/beta), per GPU:

* owner NS: the owner plan's predicted time (planning/planners.py: one batched call per shape);
* element-wise passes: Muon (momentum, Nesterov, casts, update, copy) on the matrices its DP rank
  owns, AdamW on its 1/D of the other parameters, both ``bytes_per_param`` / effective HBM rate;
* TP exchange (TP > 1): bytes of planning/tp_cost.py's per-matrix choice (gather vs distributed
  Gram) over NVLink;
* publish (param all-gather) and reduce (grad reduce-scatter) of the padded buckets: ring
  collectives, flat (one ring over the DP group, bottlenecked by InfiniBand once it spans nodes)
  or two-level (NVLink ring inside the node, then an InfiniBand ring over nodes with 1/L of the
  bytes, L = DP ranks per node).

``optimizer_step_ms`` is what the harness times (the trainer's ``train/loop.TimedOptimizer`` times ``step``):
the slowest GPU's owner NS + element-wise + TP exchange, plus the publish when it is not
overlapped with the next forward (``--overlap-param-gather``); the grad reduce runs in backward.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

from .cost_model import ClusterSpec, CostModel, Link, load_config
from .models import ModelSpec, ParallelSpec, stage_params
from .layout_stats import fragments_by_rank
from .owner_layout import megatron_bucket_size
from .planners import gpu_cells, plan_stage, predict_stage
from .tp_cost import choose_tp_method

__all__ = ["collective_ms", "gpu_step_parts", "predict_optimizer_step", "predict_adamw_step"]


def collective_ms(cluster: ClusterSpec, dp: int, tp: int, total_bytes: float, two_level: bool) -> float:
    """One reduce-scatter or all-gather of ``total_bytes`` (the whole buffer) over a DP group whose
    ranks are TP apart in Megatron's rank order."""
    per_node = max(cluster.gpus_per_node // tp, 1)  # DP ranks in one node
    if dp <= per_node:
        return cluster.intra.ring_ms(dp, total_bytes)
    nodes = math.ceil(dp / per_node)
    if not two_level:
        return cluster.inter.ring_ms(dp, total_bytes)
    return cluster.intra.ring_ms(per_node, total_bytes) + cluster.inter.ring_ms(nodes, total_bytes / per_node)


def _tp_exchange_ms(link: Link, params, owners: Dict[str, int], dp_rank: int, tp: int, ns_method: str,
                    steps: int) -> float:
    """Bytes of the TP exchange of the matrices DP rank ``dp_rank`` owns (one all-to-all each way,
    or the Gram reduce/broadcast), per TP rank, over NVLink."""
    if tp <= 1:
        return 0.0
    total, calls = 0.0, 0
    for p in params:
        if not p.is_matrix or owners.get(p.name) != dp_rank or p.partition_dim is None:
            continue
        m, n = sorted(p.full_shape)
        method = choose_tp_method(p.full_shape, tp, p.partition_dim, None, ns_method, "auto", steps)
        if method == "gather":
            total += 2 * (tp - 1) * m * n * 4 / tp  # shards to the TP owner and back, fp32 (its link)
        else:
            total += 2 * 2 * (tp - 1) / tp * m * m * 2  # R reduce + Q broadcast per segment (2 segments)
        calls += 1
    return total / (link.gbytes_per_s * 1e6) + (2 * link.alpha_us * 1e-3 if calls else 0.0)


def adamw_fragments_in_shard(layout, params, dp_rank: int) -> List[int]:
    """Sizes of the pieces of element-wise (AdamW) params inside DP rank ``dp_rank``'s shards of
    the buckets (``layout_stats.fragments_by_rank``)."""
    return fragments_by_rank(layout, params)[dp_rank]


def adamw_in_shard(layout, params, dp_rank: int) -> int:
    """Elements of element-wise (AdamW) params inside DP rank ``dp_rank``'s shards of the buckets:
    the shards are equal, so a rank owning more matrix elements steps fewer AdamW ones."""
    return sum(adamw_fragments_in_shard(layout, params, dp_rank))


def gpu_step_parts(plan: dict, par: ParallelSpec, cluster: ClusterSpec, cost_model: CostModel, opt: dict,
                   rank_ms: List[float]) -> List[dict]:
    """Per GPU of the stage: {'ns_ms' (``rank_ms[r]``, the plan's predicted owner NS), 'elementwise_ms'
    (Muon bytes on the matrices its DP rank owns + AdamW bytes in its shards, at the HBM rate),
    'tp_exchange_ms'}."""
    hbm = cluster.device.hbm_gbytes_per_s * 1e6  # bytes per ms
    per_gpu: List[dict] = []
    for r in range(par.dp_size * par.tp):
        cells = gpu_cells(par, r)
        muon_numel = adamw_numel = 0
        tp_ms = 0.0
        for kind, layout in plan["layouts"].items():
            params = plan["params"][kind]
            dp_rank = cells[kind] // layout.tp_size
            muon_numel += sum(p.numel for p in params if p.is_matrix and layout.owners[p.name] == dp_rank)
            adamw_numel += adamw_in_shard(layout, params, dp_rank)
            tp_ms += _tp_exchange_ms(cluster.intra, params, layout.owners, dp_rank, layout.tp_size,
                                     cost_model.ns_method, cost_model.steps)
        elementwise = (muon_numel * opt["muon_bytes_per_param"] + adamw_numel * opt["adamw_bytes_per_param"]) / hbm
        per_gpu.append({"ns_ms": rank_ms[r], "elementwise_ms": elementwise, "tp_exchange_ms": tp_ms})
    return per_gpu


def predict_optimizer_step(model: ModelSpec, par: ParallelSpec, cluster: ClusterSpec, cost_model: CostModel, *,
                           planner: str = "milp", two_level: bool = True, overlap_param_gather: bool = False,
                           overlap_grad_reduce: bool = False, optimizer: Optional[dict] = None,
                           milp_options: Optional[dict] = None, stage: int = 0, plan: Optional[dict] = None) -> dict:
    """Predicted optimizer step (ms) and its parts for DMuon on ``cluster`` (``plan``: a
    ``plan_stage`` result to reuse instead of planning again)."""
    opt = optimizer or load_config()["optimizer"]
    if plan is None:
        size = megatron_bucket_size(par.dp_size, overlap_grad_reduce, None, pp_rank=stage)
        plan = plan_stage(model, par, cost_model, planner, stage=stage, bucket_size=size, milp_options=milp_options)
    pred = predict_stage(plan, par, cost_model, opt["grad_bytes"], opt["param_bytes"])
    per_gpu = gpu_step_parts(plan, par, cluster, cost_model, opt, pred["rank_ms"])
    gpus = par.dp_size * par.tp
    compute = [g["ns_ms"] + g["elementwise_ms"] + g["tp_exchange_ms"] for g in per_gpu]
    slowest = max(range(gpus), key=lambda r: compute[r])
    buffer_bytes = {k: l.numel for k, l in plan["layouts"].items()}
    publish = reduce = 0.0
    for kind, numel in buffer_bytes.items():
        layout = plan["layouts"][kind]
        publish += collective_ms(cluster, layout.world_size, layout.tp_size, numel * opt["param_bytes"], two_level)
        reduce += collective_ms(cluster, layout.world_size, layout.tp_size, numel * opt["grad_bytes"], two_level)
    step = compute[slowest] + (0.0 if overlap_param_gather else publish)
    return {"gpus": par.world, "dp": par.dp_size, "tp": par.tp, "pp": par.pp,
            "nodes": math.ceil(par.world / cluster.gpus_per_node), "cluster": cluster.name, "planner": planner,
            "two_level": two_level, "optimizer_step_ms": step, "optimizer_step_overlapped_ms": compute[slowest],
            "owner_ns_ms": pred["makespan_ms"], "owner_ns_mean_ms": pred["mean_ms"],
            "slowest_gpu": {"rank": slowest, **per_gpu[slowest]},
            "publish_ms": publish, "grad_reduce_ms": reduce, "padding_elements": pred["padding_elements"]}


def predict_adamw_step(model: ModelSpec, par: ParallelSpec, cluster: ClusterSpec, *, two_level: bool = False,
                       overlap_param_gather: bool = False, optimizer: Optional[dict] = None, stage: int = 0) -> dict:
    """Megatron's DistributedOptimizer AdamW: every GPU steps 1/D of its parameters, then the
    param all-gather (unless overlapped)."""
    opt = optimizer or load_config()["optimizer"]
    params = stage_params(model, par, stage)
    dense = sum(p.numel for p in params["dense"])
    expert = sum(p.numel for p in params["expert"])
    hbm = cluster.device.hbm_gbytes_per_s * 1e6
    elementwise = (dense / par.dp_size + expert / par.expert_dp_size) * opt["adamw_bytes_per_param"] / hbm
    publish = (collective_ms(cluster, par.dp_size, par.tp, dense * opt["param_bytes"], two_level)
               + collective_ms(cluster, par.expert_dp_size, par.expert_tp, expert * opt["param_bytes"], two_level))
    return {"gpus": par.world, "optimizer_step_ms": elementwise + (0.0 if overlap_param_gather else publish),
            "elementwise_ms": elementwise, "publish_ms": publish}
