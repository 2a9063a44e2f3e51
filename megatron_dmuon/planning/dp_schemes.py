"""Which DP layout, and how many distributed-optimizer instances: every candidate's bytes, padding,
state, NS and modelled step side by side, and the one the planner picks (``dmuon plan``'s 'DP
layouts' table; docs/dmuon_dp.md).

A candidate is a DP layout (``whole``: owner_layout.py, ``split``: split_layout.py) inside each of
``N`` instances of Megatron's partial distributed optimizer (``--num-distributed-optimizer-instances``):
the optimizer is sharded over the ``D / N`` ranks of an instance, and each instance runs every
matrix's NS once. Per GPU, from the plan and the cluster config (pure data, no torch):

* bytes per step: the grad reduce-scatter and the param all-gather of the padded buffers inside the
  instance, the all-reduce of each reduced shard across the instances, and the split layout's
  exchange (its pieces to the NS homes and back; the busiest rank); AdamW's reference is Megatron's
  DistributedOptimizer with one instance at the same DP;
* optimizer state: fp32 masters, momenta and AdamW moments of the shard (``state_bytes_per_rank``),
  the largest rank, next to Megatron's AdamW at the same DP and instance count;
* NS per rank: each rank's matrices or NS homes (one batched launch per piece shape), next to the
  bound max(the largest matrix, total NS / DP);
* the modelled optimizer step (the slowest GPU's NS + element-wise passes + exchange, then the param
  all-gather, not overlapped: the scale table's convention) and the iteration (forward + backward of
  ``global_batch`` sequences at the device's model rate, planning/compute_model.py, + that step + the
  reduce the backward cannot hide).

The pick: the fewest instances (then the fewest bytes) among the candidates whose modelled iteration
is within ``PICK_SLACK`` of the best; at one instance count the scheme is the one a run chooses
(owner_planning.choose_scheme).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

from .cost_model import ClusterSpec, CostModel, elementwise_costs, exchange_costs
from .models import ModelSpec, ParallelSpec, stage_params
from .layout_stats import state_bytes_per_rank
from .owner_layout import OwnerLayout, ParamItem, megatron_bucket_size, plan_owner_layout
from .owner_planning import OVERLAPPED_WHOLE_PADDING_LIMIT, choose_scheme
from .planners import buffer_items, split_pieces
from .split_layout import shares_ns, team_block_cost, team_reduce_ms, dp_nodes, exchange_bytes, exchange_ms, megatron_buckets, narrow_directions, plan_split_layout

__all__ = ["PICK_SLACK", "compare_dp_layouts", "instance_counts"]

# fewer instances (less optimizer memory per GPU, fewer bytes) win among the candidates whose modelled
# iteration is within 3% of the best: about the model's own error (docs/load_balancing.md)
PICK_SLACK = 0.03
DEFAULT_SPLIT = dict(split_qkv=True, split_glu=False, per_head=False)  # Megatron's default split (QKV apart)


def instance_counts(dp: int, most: int = 64) -> List[int]:
    """The instance counts worth showing at DP ``dp``: powers of two dividing it, up to ``most``."""
    return [n for n in (2 ** k for k in range(int(math.log2(most)) + 1)) if n <= dp and dp % n == 0]


def _ns_ms(layout: OwnerLayout, items: Sequence[ParamItem], cost_model: CostModel) -> List[float]:
    """Each DP x TP cell's NS: its matrices' per-matrix costs, plus one launch per piece shape it runs."""
    ms = [0.0] * (layout.world_size * layout.tp_size)
    shapes: Dict[int, set] = {}
    for it in items:
        if it.is_matrix and it.name in layout.teams:  # (a team: each home its block's share)
            for home, first, end in layout.homes(it.name)[1]:
                ms[home] += team_block_cost(it, end - first)
                shapes.setdefault(home, set()).add(tuple(it.pieces[0]))
        elif it.is_matrix:
            cell = layout.owners[it.name] * layout.tp_size + layout.tp_owners.get(it.name, 0)
            ms[cell] += it.cost
            shapes.setdefault(cell, set()).update(tuple(p[-2:]) for p in it.pieces)
    for cell, seen in shapes.items():
        ms[cell] += sum(cost_model.shape_cost(s).launch_ms for s in seen)
    return ms


def _elementwise_ms(layout: OwnerLayout, items: Sequence[ParamItem], rates) -> List[float]:
    """Each DP rank's element-wise passes: Muon's on the matrix elements of its shard, AdamW's on the rest."""
    adamw, muon = rates
    ms = [0.0] * layout.world_size
    for it in items:
        for r, lo, hi in layout.pieces(it.name):
            ms[r] += (muon if it.is_matrix else adamw) * (hi - lo)
    return ms


def _collective_ms(cluster: ClusterSpec, ranks: int, tp: int, total_bytes: float, two_level: bool) -> float:
    from .simulate import collective_ms

    return collective_ms(cluster, ranks, tp, total_bytes, two_level)


def compare_dp_layouts(model: ModelSpec, par: ParallelSpec, cost_model: CostModel, cluster: ClusterSpec, opt: dict, *,
                       instances: Optional[Sequence[int]] = None, schemes: Sequence[str] = ("whole", "split"),
                       stage: int = 0, overlap_grad_reduce: bool = True, bucket_size: Optional[int] = None,
                       two_level: bool = False, param_bytes: Optional[int] = None, momentum_bytes: int = 4,
                       seq_length: int = 4096, global_batch: int = 1024, split: Optional[dict] = None,
                       overlapped_step: bool = False, ns_method: str = "auto", shared_ns: bool = False) -> dict:
    """Every (instances, scheme) candidate of ``model``'s dense buffer of pipeline stage ``stage`` at
    DP ``par.dp_size`` (MoE expert buffers are not covered), and the pick: {'candidates': [...],
    'picked': index, 'why': str, 'adamw': AdamW's figures}. ``opt``: the cluster config's optimizer
    section (grad/param bytes per element); ``global_batch`` sequences of ``seq_length`` tokens per
    iteration; ``split``: the optimizer's split flags (default Megatron's QKV split); ``overlapped_step``:
    the run's step is overlapped (its pick: ``choose_scheme``); ``ns_method``: the run's NS method;
    ``shared_ns``: the split layout may share matrices' NS over teams where the method allows
    (split_layout.shares_ns; off, as in runs, until teams are taken there)."""
    from .compute_model import iteration_flops, model_tflops

    dp, tp = par.dp_size, par.tp
    grad_b, param_b = opt["grad_bytes"], param_bytes or opt["param_bytes"]
    master = 4 if param_b < 4 else 0
    params = stage_params(model, par, stage)["dense"]
    items = buffer_items(params, cost_model, split_pieces(model, split or DEFAULT_SPLIT))
    total_ns = sum(it.cost for it in items if it.is_matrix)
    largest = max((it.cost + sum(cost_model.shape_cost(tuple(p[-2:])).launch_ms for p in set(it.pieces))
                   for it in items if it.is_matrix), default=0.0)
    ns_bound = max(largest, total_ns / dp)
    rates = elementwise_costs(cluster.device, "ms")
    # AdamW: Megatron's DistributedOptimizer, one instance, the same DP
    adam_numel = megatron_buckets(items, megatron_bucket_size(dp, overlap_grad_reduce, bucket_size, stage), dp)[1][-1].end
    unpadded = sum(it.numel for it in items)
    adam_bytes = (dp - 1) / dp * adam_numel * (grad_b + param_b)
    per_gpu = max(global_batch // dp, 1)  # sequences per GPU per iteration (micro-batch 1)
    fwd_bwd = iteration_flops(model, par, seq_length=seq_length, micro_batches=per_gpu, stage=stage) / (
        model_tflops(cluster.device.name) * 1e9) if not model.num_experts else 0.0
    adam_step = rates[0] * unpadded / dp + _collective_ms(cluster, dp, tp, adam_numel * param_b, two_level)
    adam_reduce = _collective_ms(cluster, dp, tp, adam_numel * grad_b, two_level)
    adam = {"bytes_per_rank": adam_bytes, "state_bytes_per_rank_one_instance": (master + 8) * unpadded / dp,
            "optimizer_step_ms": adam_step, "grad_reduce_ms": adam_reduce,
            "iteration_ms": fwd_bwd + adam_step + max(0.0, adam_reduce - 2 / 3 * fwd_bwd)}
    # the directions that come back in 16 bits (bf16 NS on the GPU, fp32 masters; split_layout.narrow_directions)
    narrow = narrow_directions([it.name for it in items if it.is_matrix], tp)
    candidates = []
    for n in instances or instance_counts(dp):
        d = dp // n
        bucket = megatron_bucket_size(d, overlap_grad_reduce, bucket_size, stage)
        exchange = exchange_costs(cluster.device, cluster, d, tp, "ms")
        collective = exchange.collective
        per_node = max(cluster.gpus_per_node // tp, 1)  # DP ranks a node (the exchange's routes)
        planned = {}
        for scheme in schemes:
            loads = [0.0] * (d * tp)
            layout = (plan_split_layout(items, d, bucket, loads, tp, rates, exchange.move, per_node,
                                        exchange.node_move, shared_ns and shares_ns(ns_method, overlapped_step))
                      if scheme == "split" else
                      plan_owner_layout(items, d, bucket, 0.02, loads, tp, "cost", elementwise=rates))
            planned[scheme] = (layout, loads)
        for scheme, (layout, _) in planned.items():
            ns = _ns_ms(layout, items, cost_model)
            elementwise = _elementwise_ms(layout, items, rates)
            back16 = set(narrow) - set(layout.teams)
            exchange_b = exchange_bytes(layout, dp_nodes(d, per_node), narrow=back16)[0]
            moving = exchange_ms(layout, cluster.intra, cluster.inter, per_node, narrow=back16)  # (split_layout.exchange_ms)
            moving = [a + b for a, b in zip(moving, team_reduce_ms(layout, items, cluster.inter))]
            compute = [ns[c] + elementwise[c // tp] + moving[c // tp] for c in range(d * tp)]
            numel = layout.numel
            publish = _collective_ms(cluster, d, tp, numel * param_b, two_level)
            reduce_ms = _collective_ms(cluster, d, tp, numel * grad_b, two_level) + (
                cluster.inter.ring_ms(n, 2 * numel / d * grad_b) if n > 1 else 0.0)
            step = max(compute) + publish
            state = max(s["total"] for s in state_bytes_per_rank(layout, param_b, momentum_bytes))
            bytes_ = (d - 1) / d * numel * (grad_b + param_b) + 2 * (n - 1) / n * numel / d * grad_b + max(exchange_b)
            candidates.append({
                "instances": n, "scheme": scheme, "instance_dp": d,
                "bytes_per_rank": bytes_, "bytes_vs_adamw": bytes_ / adam_bytes if adam_bytes else 1.0,  # (DP 1: none)
                "padding_bytes": (numel - unpadded) * (grad_b + param_b),
                "max_state_bytes": state, "adamw_state_bytes": (master + 8) * unpadded / d,
                "state_vs_adamw": state / ((master + 8) * unpadded / d),
                "max_ns_ms": max(ns), "ns_vs_bound": max(ns) / ns_bound if ns_bound else 1.0,
                "idle_ranks": sum(1 for r in range(d) if not any(ns[r * tp:(r + 1) * tp])),
                # the matrices whose NS a team of homes shares (the layout option ns_teams): homes per team
                "team_homes": sorted(len(t["blocks"]) for t in layout.teams.values()),
                "optimizer_step_ms": step, "publish_ms": publish, "grad_reduce_ms": reduce_ms,
                "iteration_ms": fwd_bwd + step + max(0.0, reduce_ms - 2 / 3 * fwd_bwd),
            })
        if len(planned) == 2:  # as a run chooses at this instance count
            run_choice = choose_scheme(planned, collective, overlapped_step)
            for c in candidates[-2:]:
                c["run_choice"] = c["scheme"] == run_choice
    best = min(c["iteration_ms"] for c in candidates)
    eligible = [i for i, c in enumerate(candidates) if c["iteration_ms"] <= (1 + PICK_SLACK) * best
                and c.get("run_choice", True)] or [min(range(len(candidates)), key=lambda i: candidates[i]["iteration_ms"])]
    picked = min(eligible, key=lambda i: (candidates[i]["instances"], candidates[i]["bytes_per_rank"]))
    c = candidates[picked]
    why = (f"{c['instances']} instance(s), {c['scheme']} layout: modelled iteration {c['iteration_ms']:.1f} ms, within "
           f"{100 * PICK_SLACK:.0f}% of the best candidate ({best:.1f} ms) with the fewest instances (the least "
           f"optimizer memory), then the fewest bytes; {c['bytes_vs_adamw']:.2f}x AdamW's bytes, state "
           f"{c['state_vs_adamw']:.2f}x AdamW's at this instance count, NS {c['ns_vs_bound']:.2f}x the bound")
    if overlapped_step:
        why += (f"; the step overlapped, the layout is the run's: whole matrices unless they pad the buffers past "
                f"{1 + OVERLAPPED_WHOLE_PADDING_LIMIT:.1f}x the split layout's (their step and iteration above are "
                "the synchronous step's)")
    return {"model": model.name, "dp": dp, "tp": tp, "stage": stage, "cluster": cluster.name,
            "two_level": two_level, "global_batch": global_batch, "seq_length": seq_length,
            "forward_backward_ms": fwd_bwd, "ns_bound_ms": ns_bound, "adamw": adam, "candidates": candidates,
            "picked": picked, "why": why}


def dp_layout_lines(report: dict) -> List[str]:
    """``compare_dp_layouts``' table for ``dmuon plan``."""
    a = report["adamw"]
    lines = [f"\nDP layouts: {report['model']} at DP {report['dp']} x TP {report['tp']} on {report['cluster']} "
             f"({'two-level' if report['two_level'] else 'flat'} collectives); global batch {report['global_batch']} x "
             f"{report['seq_length']} tokens: forward + backward {report['forward_backward_ms']:.0f} ms per GPU",
             f"AdamW (Megatron's DistributedOptimizer, one instance): {a['bytes_per_rank'] / 1e9:.2f} GB per rank, "
             f"step {a['optimizer_step_ms']:.1f} ms, iteration {a['iteration_ms']:.1f} ms",
             "", "| instances | layout | GB per rank (x AdamW) | padding GB | state GB, largest (x AdamW) | "
                 "NS ms, slowest (x bound) | ranks without NS | step ms | iteration ms (x AdamW) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for i, c in enumerate(report["candidates"]):
        mark = " **picked**" if i == report["picked"] else ""
        homes = c.get("team_homes")
        if homes:
            mark += f" ({len(homes)} teams of {homes[0]}-{homes[-1]} NS homes)"
        lines.append(f"| {c['instances']} | {c['scheme']}{mark} | {c['bytes_per_rank'] / 1e9:.2f} "
                     f"({c['bytes_vs_adamw']:.2f}) | {c['padding_bytes'] / 1e9:.2f} | {c['max_state_bytes'] / 1e9:.2f} "
                     f"({c['state_vs_adamw']:.2f}) | {c['max_ns_ms']:.2f} ({c['ns_vs_bound']:.2f}) | "
                     f"{c['idle_ranks']} of {c['instance_dp']} | {c['optimizer_step_ms']:.1f} | "
                     f"{c['iteration_ms']:.1f} ({c['iteration_ms'] / a['iteration_ms']:.3f}) |")
    lines.append(f"picked: {report['why']}")
    return lines


def candidate(report: dict, instances: int, scheme: str) -> dict:
    """The candidate of ``report`` with ``instances`` and ``scheme``."""
    return next(c for c in report["candidates"] if c["instances"] == instances and c["scheme"] == scheme)


__all__ += ["dp_layout_lines", "candidate"]
del dataclasses
