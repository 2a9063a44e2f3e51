"""The layouts bench/rank_balance.py measures and plans: a layout spec ('qwen2.5-7b/dp8/one'), the
main job's DMuon settings, each planner's plan of a stage, and what each GPU of a plan holds (its
matrices with their split rules and its AdamW fragments; under TP its shards and the TP exchange's
modelled ms), named by the NS piece shapes the rank cost model counts."""
from __future__ import annotations

import functools
import os
import sys
import time

from megatron_dmuon.megatron.config import DMuonConfig
from megatron_dmuon.megatron.flags import add_dmuon_args
from megatron_dmuon.planning.cost_model import cluster_spec, device_spec, elementwise_costs
from megatron_dmuon.planning.models import PRESETS, ParallelSpec
from megatron_dmuon.planning.overlap_mode import OverlapMode
from megatron_dmuon.planning.owner_layout import megatron_bucket_size
from megatron_dmuon.planning.split_layout import shares_ns
from megatron_dmuon.planning.ns_choice import NSResolver, owner_ns_cost
from megatron_dmuon.planning.planners import gpu_cells, plan_stage, split_rule_for, transformer_shape
from megatron_dmuon.planning.rank_cost import piece_counts
from megatron_dmuon.planning.layout_stats import fragments_by_rank

PLANS = ("greedy", "numel_lpt", "megatron_lpt", "milp", "split")  # split: --dmuon-dp-layout split's NS homes
# Megatron-LM's own LayerWise Muon, each rank emulated with Megatron's own optimizer classes
MEGATRON = "megatron_layerwise"
# Megatron's DistributedOptimizer AdamW per GPU (every param sharded evenly): what Muon is to cost
ADAMW = "megatron_adamw"
BASELINES = (MEGATRON, ADAMW)


def job_settings(flags):
    """The DMuonConfig of the main job's dmuon ``flags`` (rank_balance.py's --flags); a bad one is a
    one-line usage error naming --flags."""
    from cli_inputs import OneLineParser

    parser = add_dmuon_args(OneLineParser(prog=os.path.basename(sys.argv[0]), about="--flags: ", add_help=False),
                            validate=False)
    try:
        return DMuonConfig.from_args(parser.parse_args(flags))
    except ValueError as e:
        parser.error(str(e))


def parse_layout(spec: str):
    """'qwen2.5-7b/dp8/ep4/one', 'qwen2.5-7b/tp2/dp4/buckets' -> (model, ParallelSpec, bucket size or None)."""
    parts = spec.split("/")
    if parts[0] not in PRESETS or parts[-1] not in ("buckets", "one"):
        raise ValueError(f"layout {spec!r}: PRESET/dpN[/epE]/(buckets|one), presets {', '.join(sorted(PRESETS))}")
    fields = {p[:2]: int(p[2:]) for p in parts[1:-1]}
    if set(fields) - {"tp", "dp", "ep"}:
        raise ValueError(f"layout {spec!r}: PRESET[/tpT]/dpN[/epE]/(buckets|one)")
    par = ParallelSpec(tp=fields.get("tp", 1), dp=fields["dp"], ep=fields.get("ep", 1))
    size = megatron_bucket_size(par.dp_size, parts[-1] == "buckets")
    return PRESETS[parts[0]], par, size


def make_plans(model, par, bucket_size, cfg, planners, rank_profile=None, milp_options=None):
    muon = cfg.muon
    cost_fn = functools.partial(owner_ns_cost, resolver=NSResolver(
        muon.ns_method, coefficients=muon.coefficients, steps=muon.ns_steps))
    split = cfg.split_flags()
    out = {}
    for name in planners:
        kw = dict(bucket_size=bucket_size, cost_fn=cost_fn, split=split)
        if name in ("greedy", "milp", "split"):  # the milp's greedy warm start is exactly the greedy plan
            kw["elementwise"] = elementwise_costs(device_spec("H200"))
        if name == "split":  # (--dmuon-ns-teams auto in the flags: teams where the planner finds them better)
            kw["shared_ns"] = cfg.layout.ns_teams == "auto" and shares_ns(
                muon.ns_method, OverlapMode(muon.overlap_step).cuts_per_need_group)
        if name == "milp":
            if rank_profile is None:
                raise ValueError("the milp plan needs --rank-profile (a calibrate run's rank cost model)")
            kw.update(rank_model=rank_profile, milp_options=dict(milp_options or {}))
        t0 = time.perf_counter()
        out[name] = plan_stage(model, par, None, name, **kw)
        out[name]["plan_s"] = time.perf_counter() - t0
    return out


def gpu_work(plan, model, par, split):
    """Per GPU of the stage: (owned matrices [(name, full shape, split rule)], AdamW fragment sizes)."""
    config = transformer_shape(model)
    gpus = par.dp_size * par.tp
    fragments = {kind: fragments_by_rank(layout, plan["params"][kind]) for kind, layout in plan["layouts"].items()}
    rules = {p.name: split_rule_for(p.name, p.full_shape, config, split) for ps in plan["params"].values()
             for p in ps if p.is_matrix}
    owned = {kind: {} for kind in plan["layouts"]}  # per kind: {(DP rank, TP rank): [its matrices]}
    for kind, layout in plan["layouts"].items():
        for p in plan["params"][kind]:
            if p.is_matrix and p.name not in layout.teams:  # (a team's blocks: split_cell_work)
                cell = (layout.owners[p.name], layout.tp_owners.get(p.name, 0))
                owned[kind].setdefault(cell, []).append((p.name, tuple(p.full_shape), rules[p.name]))
    out = []
    for r in range(gpus):
        mats, frags = [], []
        for kind, layout in plan["layouts"].items():
            dp, tp = divmod(gpu_cells(par, r)[kind], layout.tp_size)
            mats += owned[kind].get((dp, tp), [])
            frags += fragments[kind][dp]
        out.append((mats, frags))
    return out


def tp_cell_work(plan, par, cluster="h200"):
    """Per GPU of a TP > 1 stage: (element counts of its shards of the matrices its DP row owns and
    another TP rank orthogonalizes, the TP exchange's modelled ms). The GPU runs those shards'
    momentum and apply (``time_owner_step(tp_shards=...)``); the exchange is two all-to-alls inside
    the TP group (shards to each matrix's TP owner, directions back: runtime/tp_exchange.py), fp32,
    at the cluster's intra-node link (planning/clusters.json), modelled, not timed: one GPU has no
    peer. Every matrix is emulated as gathered to its TP owner (``--dmuon-tp-method gather``);
    distributed Gram NS (``auto``'s pick for shapes sharded along their long dim) is not emulated."""
    link = cluster_spec(cluster).intra
    out = []
    for r in range(par.dp_size * par.tp):
        shards, sent, received = [], 0, 0
        for kind, layout in plan["layouts"].items():
            if layout.tp_size <= 1:
                continue
            dp, tp = divmod(gpu_cells(par, r)[kind], layout.tp_size)
            for p in plan["params"][kind]:
                if not p.is_matrix or layout.owners[p.name] != dp or p.partition_dim is None:
                    continue
                if layout.tp_owners.get(p.name, 0) == tp:  # gathers the others' shards, returns theirs
                    received += (layout.tp_size - 1) * p.numel * 4
                    sent += (layout.tp_size - 1) * p.numel * 4
                else:
                    shards.append(p.numel)
                    sent += p.numel * 4
                    received += p.numel * 4
        # two all-to-alls: each a latency, the bytes (both ways counted) at the link's rate
        exchange_ms = 2 * link.alpha_us * 1e-3 + max(sent, received) / (link.gbytes_per_s * 1e6) if sent else 0.0
        out.append((shards, exchange_ms))
    return out


def split_cell_work(plan, par, cluster="h200"):
    """Per GPU of a split-layout plan (TP = 1): (the sizes of its pieces of matrices homed on other GPUs,
    the exchange's modelled ms). The GPU runs those pieces' momentum and apply (``time_owner_step``'s
    ``tp_shards``, the same passes) beside the NS of the matrices homed on it, which it steps whole
    (its own pieces of them only, in the job: an upper bound here). The exchange (runtime/dp_exchange.py:
    pieces to their homes in fp32, directions back as their bf16 NS outputs' bits, point to point) is
    modelled at the link the DP group crosses (planning/clusters.json, its routes through the homes'
    node-mates: split_layout.exchange_ms), not timed: one GPU has no peer. A matrix whose NS a team
    shares (--dmuon-ns-teams auto): every piece of it is element-wise work where it lies; each home gets
    (rows, cols, first, end) of its block (a third entry per GPU), whose NS ``time_owner_step`` times as
    one home computes it, and the team's Gram reductions (split_layout.team_reduce_ms) join the exchange."""
    from megatron_dmuon.planning.split_layout import exchange_ms, narrow_directions, team_reduce_ms

    if par.tp > 1:
        raise ValueError("the split layout is emulated at TP = 1 only")
    spec = cluster_spec(cluster)
    per_kind = {}
    for kind, layout in plan["layouts"].items():
        pieces = [[] for _ in range(layout.world_size)]  # per DP rank: its pieces of matrices homed elsewhere
        blocks = [[] for _ in range(layout.world_size)]  # per DP rank: the team blocks homed on it
        for p in plan["params"][kind]:
            if p.is_matrix:
                for rank, lo, hi in layout.pieces(p.name):
                    if rank != layout.owners[p.name] or p.name in layout.teams:
                        pieces[rank].append(hi - lo)
            if p.name in layout.teams:
                shape, team = layout.homes(p.name)
                for home, first, end in team:
                    blocks[home].append((*shape, first, end))
        narrow = narrow_directions([p.name for p in plan["params"][kind] if p.is_matrix and p.name not in layout.teams],
                                   par.tp)
        moving = exchange_ms(layout, spec.intra, spec.inter, spec.gpus_per_node // par.tp, narrow=narrow)
        reduce = team_reduce_ms(layout, _items(plan, kind), spec.inter)
        per_kind[kind] = (pieces, [a + b for a, b in zip(moving, reduce)], blocks)
    out = []
    for r in range(par.dp_size):
        shards, ms, homed = [], 0.0, []
        for kind, (pieces, times, blocks) in per_kind.items():
            dp = gpu_cells(par, r)[kind]
            shards += pieces[dp]
            ms += times[dp]
            homed += blocks[dp]
        out.append((shards, ms, homed))
    return out


def _items(plan, kind):
    """The planner items of a buffer's team matrices (team_reduce_ms reads their shapes)."""
    from megatron_dmuon.planning.owner_layout import ParamItem

    layout = plan["layouts"][kind]
    return [ParamItem(name, team["shape"][0] * team["shape"][1], True, pieces=(tuple(team["shape"]),))
            for name, team in layout.teams.items()]


def shard_signature(shards):
    """Ranks whose pieces or TP shards differ by under 1 M elements in all and not in count time alike."""
    return round(sum(shards) / 1e6), len(shards)


def pieces_of(mats):
    """Counter of the NS piece shapes (m, n), m <= n, a rank's matrices give."""
    return piece_counts(s for _, shape, rule in mats for s in ([shape] if rule is None else rule.piece_shapes(shape)))


def signature(mats, frags):
    return (tuple(sorted((shape, tuple(map(tuple, rule.piece_shapes(shape))) if rule else ())
                         for _, shape, rule in mats)), round(sum(frags) / 1e6), len(frags))


def describe(mats, frags):
    return {"pieces": {f"{m}x{n}": k for (m, n), k in sorted(pieces_of(mats).items())},
            "matrices": len(mats), "muon_elements": sum(s[0] * s[1] for _, s, _ in mats),
            "adamw_elements": sum(frags), "fragments": len(frags)}
