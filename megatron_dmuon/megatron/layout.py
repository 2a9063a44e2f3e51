"""Plan once and hand megatron-core's DDP the owner-aligned FullParamLayout (Megatron 0.19 `full_param_layout`)."""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch

from ..algorithms.tp_shards import tp_full_shape
from ..planning.owner_layout import OwnerLayout, megatron_bucket_size, plan_owner_layout
from ..planning.params import owner_ns_cost, param_routing
from ..planning.plan import DMuonPlan, MatrixRecord, merged_records
from ..planning.plans import split_rule_for
from ..planning.rank_cost import RankCostModel
from ..planning.rank_milp import plan_rank_owner_layout
from ..planning.caches import PlanCache, plan_key
from ..planning.startup_profile import STARTUP_BUDGET_S, milp_time_limit, profile_budget
from ..planning.tp_cost import choose_tp_method


def default_bucket_size(ddp_config, dp_size: int, disable_bucketing: bool = False, pp_rank: int = 0):
    """What DDP's __init__ will use (it sets ddp_config.bucket_size itself later)."""
    return megatron_bucket_size(dp_size, ddp_config.overlap_grad_reduce, ddp_config.bucket_size, pp_rank,
                                disable_bucketing)


def full_matrix_shape(param: torch.Tensor, tp_size: int):
    """Shape of the whole matrix a (possibly TP-sharded) param is part of."""
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        return tp_full_shape(param.shape, param.partition_dim, tp_size)
    return tuple(param.shape)


def layout_groups(config, ddp_config) -> Dict[str, object]:
    """The process groups DDP will use for dense and expert buffers (Megatron's own set-up)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.setup_process_groups_for_ddp(None, config, ddp_config)
    return {
        "dp": pgs["intra_dp_cp_group"], "tp": pgs["tp_group"], "pp": pgs["pp_group"],
        "expert_dp": pgs["intra_expt_dp_group"],
        "expert_tp": parallel_state.get_expert_tensor_parallel_group(),
        # every rank of this pipeline stage (dense and expert owners alike): plans are made once
        "stage": parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True),
    }


def _elementwise_costs(model):
    """``elementwise_costs`` in the planner's units: ms under a profiled cost model, else NS FLOPs
    at the rates of the cluster config's device matching this GPU (the first one on CPU)."""
    from ..planning.cost_model import DeviceSpec, device_spec_for, elementwise_costs

    if model is not None:
        device = getattr(model, "device", None)
        return elementwise_costs(device, "ms") if isinstance(device, DeviceSpec) else None
    on_gpu = torch.cuda.is_available()
    return elementwise_costs(device_spec_for(torch.cuda.get_device_name() if on_gpu else "", warn=on_gpu), "flops")


def buffer_name(key) -> str:
    """A DDP buffer's name in the plan: 'dense' or 'expert', then its param and grad dtypes."""
    kind = "expert" if key.is_expert_parallel else "dense"
    return f"{kind}/{key.param_dtype}/{key.grad_dtype}"


def split_rule(name: str, full_shape, model_config, cfg):
    """How the owner step cuts the full matrix ``name`` (TP shards merged) under ``cfg``'s split
    flags: ``planning.plans.split_rule_for``."""
    return split_rule_for(name, full_shape, model_config, cfg.split_flags())


def _records(named, buffers, sizes, cfg, model_config):
    """{buffer key: [MatrixRecord without owners]} for this rank's params, in buffer order."""
    muon = cfg.muon
    records = {}
    for key, (params, _) in buffers.items():
        tp_size = sizes(key)[1]
        out = []
        for p in params:
            name, shape = named[p], full_matrix_shape(p, tp_size)
            use_muon, reason = param_routing(name, p)
            common = dict(name=name, buffer=buffer_name(key), expert=key.is_expert_parallel, numel=p.numel(),
                          local_shape=tuple(p.shape), full_shape=shape, use_muon=use_muon, reason=reason,
                          own_bucket=bool(getattr(p, "shared_embedding", False)))
            if not use_muon:
                out.append(MatrixRecord(**common))
                continue
            rule = split_rule(name, shape, model_config, cfg)
            pieces = tuple(tuple(s) for s in rule.piece_shapes(shape)) if rule is not None else (tuple(shape),)
            sharded = bool(getattr(p, "tensor_model_parallel", False)) and tp_size > 1
            partition_dim = p.partition_dim if sharded else None
            out.append(MatrixRecord(
                **common, split=rule, pieces=pieces, ns_methods=tuple(muon.ns_method for _ in pieces),
                schedules=tuple(dict(muon.ns_schedule(*s[-2:])) for s in pieces),
                partition_dim=partition_dim,
                partition_stride=getattr(p, "partition_stride", 1) if sharded else 1,
                tp_method=choose_tp_method(shape, tp_size, partition_dim, rule, muon.ns_method, muon.tp_method,
                                           muon.ns_steps)))
        records[key] = out
    return records


def plan_records(module: torch.nn.Module, ddp_config, sizes, cfg, model_config=None) -> List[MatrixRecord]:
    """The plan's records of ``module``'s trainable params (routing, full shape, split pieces, NS
    request and schedule, TP method; no owners), in Megatron's buffer order; ``sizes(buffer key)``
    = (DP size, TP size). ``build_plan`` adds owners and costs; the gather_then_compute baseline
    reads them as they are (every rank owns every matrix)."""
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers

    named = {p: n for n, p in module.named_parameters() if p.requires_grad}
    buffers = group_params_for_buffers(list(named), ddp_config.grad_reduce_in_fp32)
    return [r for recs in _records(named, buffers, sizes, cfg, model_config).values() for r in recs]


def _matrices_of(piece) -> Tuple[Tuple[int, int], int]:
    """(matrix shape, count) of an NS piece: a matrix, or a [heads, rows, cols] stack of them."""
    return (tuple(piece[-2:]), piece[0]) if len(piece) == 3 else (tuple(piece), 1)


def _costed(records, cost_fn, model):
    """The records with each matrix's predicted NS cost: the sum over its pieces, in ms (and
    batched-launch ms) under a profiled cost model, else ``cost_fn`` (FLOPs)."""
    out = {}
    for key, recs in records.items():
        out[key] = []
        for r in recs:
            if r.use_muon:
                matrices = [_matrices_of(s) for s in r.pieces]
                if model is not None:
                    r = dataclasses.replace(r, cost=sum(n * model.per_matrix_ms(s) for s, n in matrices),
                                            launch_cost=sum(model.launch_ms(s) for s in {s for s, _ in matrices}))
                else:
                    r = dataclasses.replace(r, cost=sum(n * cost_fn(s) for s, n in matrices))
            out[key].append(r)
    return out


def owner_cost_fn(muon):
    """NS FLOPs of one piece as the owner step runs it under ``muon`` (schedule, steps, method)."""
    return functools.partial(owner_ns_cost, coefficients=muon.coefficients, steps=muon.ns_steps,
                             ns_method=muon.ns_method)


def build_plan(module: torch.nn.Module, ddp_config, groups: Dict[str, object], bucket_size: Optional[int],
               cfg, model_config=None):
    """The DMuonPlan of `module` under the complete config `cfg` (dense buffers: DP x TP owners;
    expert buffers: expert-DP x expert-TP owners), and the FullParamLayout DDP builds its buffers
    from. Owners are planned on rank 0 of the pipeline stage and broadcast.

    A matrix costs what the owner step will run on it: the sum over its pieces (q, k, v; gate,
    up) under the config's split flags (with `model_config`, the TransformerConfig), by
    ``cfg.layout.cost_fn`` (default: ``owner_cost_fn(cfg.muon)``, NS FLOPs) or, with a cost model
    (``cfg.layout.cost_model_fn``, or the start-up profile when ``cfg.layout.profile``), predicted
    ms and batched-launch costs (rank 0 only). The element-wise work per element
    (``plan_owner_layout``'s `elementwise`) comes from the cluster config ('auto'). A plan cache
    (``cfg.layout.plan_cache``) lets rank 0 reuse a plan made for the same parameters, sizes,
    options and costs; ``cfg.layout.plan_budget_s`` bounds profiling + MILP at start-up."""
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
    from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout

    if not ddp_config.use_distributed_optimizer:
        raise ValueError(
            "--optimizer dmuon needs the distributed optimizer: set "
            "DistributedDataParallelConfig(use_distributed_optimizer=True) / --use-distributed-optimizer"
        )
    opts = cfg.layout
    named = {p: n for n, p in module.named_parameters() if p.requires_grad}
    buffers = group_params_for_buffers(list(named), ddp_config.grad_reduce_in_fp32)
    keys = list(buffers.keys())

    def sizes(key):
        kind = "expert_" if key.is_expert_parallel else ""
        return groups[kind + "dp"].size(), groups[kind + "tp"].size()

    records = _records(named, buffers, sizes, cfg, model_config)
    cost_model_fn = opts.cost_model_fn
    rank_profile = cost_model_fn is None and opts.profile  # --dmuon-balance milp: the rank cost model
    cost_fn = opts.cost_fn or owner_cost_fn(cfg.muon)
    milp_options = opts.milp_options
    stage = groups["stage"]
    payload = [None]
    if stage.rank() == 0:
        model = None
        started = time.perf_counter()
        counts = Counter()  # the shapes the owner step will orthogonalize
        for r in (r for recs in records.values() for r in recs):
            for shape, n in map(_matrices_of, r.pieces):
                counts[shape] += n
        if rank_profile:  # measure (or read the cache) on this GPU; analytic off CUDA
            from ..runtime.rank_profile import profile_counts, profiled_rank_model

            cells = min(dp * tp for dp, tp in map(sizes, keys)) if keys else 1
            model = profiled_rank_model(profile_counts(counts, cells), settings=cfg.muon,
                                        budget_s=profile_budget(opts.plan_budget_s or STARTUP_BUDGET_S))
        elif cost_model_fn is not None:
            model = cost_model_fn(sorted(counts), min(max(counts.values(), default=1), 8))
        rank_model = model if isinstance(model, RankCostModel) else None
        if rank_model is not None:  # the greedy warm start plans on NS FLOPs, as --dmuon-balance cost
            model = None
        if opts.plan_budget_s is not None and opts.balance == "milp":
            limit = milp_time_limit(opts.plan_budget_s, time.perf_counter() - started,
                                    (milp_options or {}).get("time_limit_s"))
            milp_options = dict(milp_options or {}, time_limit_s=limit)
        items = {key: [r.param_item() for r in recs] for key, recs in _costed(records, cost_fn, model).items()}
        elementwise = _elementwise_costs(model) if isinstance(opts.elementwise, str) else opts.elementwise
        cache, cache_key = None, None
        if opts.plan_cache is not None:
            cache = PlanCache(opts.plan_cache)
            cache_key = plan_key({"items": {str(k): [dataclasses.astuple(it) for it in items[k]] for k in keys},
                                  "sizes": {str(k): sizes(k) for k in keys}, "bucket_size": bucket_size,
                                  "max_bucket_padding": opts.max_bucket_padding, "balance": opts.balance,
                                  "milp_options": milp_options, "elementwise": elementwise,
                                  "rank_model": rank_model.to_json() if rank_model is not None else None})
            cached = cache.get(cache_key)
            problem = _cached_plan_problem(cached, keys, items, sizes) if cached is not None else None
            if problem:  # a damaged or foreign entry: planned again (and replaced below)
                warnings.warn(f"{cache.label} {cache.path}: its entry for this model is unusable ({problem}); "
                              "planning again", RuntimeWarning)
            elif cached is not None:
                payload = [({k: cached[str(k)] for k in keys}, _cost_of(items))]
        if payload[0] is None:
            rank_cost: Dict[bool, List[float]] = {}
            layouts = {}
            for key in keys:
                dp_size, tp_size = sizes(key)
                cost = rank_cost.setdefault(key.is_expert_parallel, [0.0] * (dp_size * tp_size))
                if rank_model is not None and opts.balance == "milp":
                    # the rank MILP uses all of its limit (local search included): buffers share it
                    options = dict(milp_options or {})
                    if "time_limit_s" in options:
                        options["time_limit_s"] /= len(keys)
                    layouts[key] = plan_rank_owner_layout(items[key], dp_size, bucket_size, opts.max_bucket_padding,
                                                          cost, tp_size, milp_options=options,
                                                          elementwise=elementwise, model=rank_model)
                    continue
                layouts[key] = plan_owner_layout(items[key], dp_size, bucket_size, opts.max_bucket_padding, cost,
                                                 tp_size, opts.balance, milp_options=milp_options,
                                                 elementwise=elementwise)
            # one plan for everybody: rank 0's (costs may come from profiling that differs per rank)
            payload = [({k: layouts[k].to_json() for k in keys}, _cost_of(items))]
            if cache is not None:
                cache.put(cache_key, {str(k): v for k, v in payload[0][0].items()})
    if stage.size() > 1:
        torch.distributed.broadcast_object_list(payload, src=torch.distributed.get_global_rank(stage, 0), group=stage)
    layout_json, costs = payload[0]
    layouts = {buffer_name(k): OwnerLayout.from_json(layout_json[k]) for k in keys}
    costed = [dataclasses.replace(r, cost=costs[r.name][0], launch_cost=costs[r.name][1]) if r.use_muon else r
              for k in keys for r in records[k]]
    plan = DMuonPlan(records=merged_records(costed, layouts), layouts=layouts, settings=cfg.plan_summary(),
                     ranks_per_node=opts.ranks_per_node, publish_dtype=cfg.publish_dtype, config=cfg)

    per_buffer = {}
    for key in keys:
        params, param_indices = buffers[key]
        layout = layouts[buffer_name(key)]
        per_buffer[key] = PerBufferParamLayout(
            param_index_map={p: layout.param_ranges[named[p]] for p in params},
            bucket_indices=[(b.start, b.end) for b in layout.buckets],
            per_bucket_numel_unpadded=[b.numel_unpadded for b in layout.buckets],
            param_indices=param_indices,
            num_optimizer_shards=sizes(key)[0],
        )
    return plan, FullParamLayout(layouts=per_buffer)


def _cached_plan_problem(cached, keys, items, sizes) -> Optional[str]:
    """Why a plan-cache entry cannot serve this model (None: it can): other buffers, a layout that
    does not read, or one that fails the layout's invariants at these DP x TP sizes."""
    try:
        if set(cached) != {str(k) for k in keys}:
            return "other buffers"
        for key in keys:
            layout = OwnerLayout.from_json(cached[str(key)])
            if (layout.world_size, layout.tp_size) != tuple(sizes(key)):
                return f"made for DP x TP {layout.world_size} x {layout.tp_size}, not {sizes(key)[0]} x {sizes(key)[1]}"
            layout.validate(items[key])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _cost_of(items) -> Dict[str, Tuple[float, float]]:
    """{matrix name: (cost, launch cost)} rank 0 planned with (recorded in every rank's plan)."""
    return {it.name: (it.cost, it.launch_cost) for recs in items.values() for it in recs if it.is_matrix}


def _import_distributed_data_parallel():
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel


class DMuonDDP(_import_distributed_data_parallel()):
    """Megatron's DistributedDataParallel over an owner-aligned layout (the DMuon drop-in for
    DDP(...)); constructible exactly as Megatron constructs its DDP.

    ``dmuon``: the run's complete DMuonConfig (default ``DMuonConfig()``); keyword overrides of
    its layout options (``ranks_per_node``, ``balance``, ``megabatch``, ``cost_fn``, ...) and
    ``publish_dtype`` are accepted for the Python API. The DDP plans once (``build_plan``) and
    carries the frozen ``dmuon_plan``, the only DMuon object on it. `full_param_layout`
    (Megatron's own layout, which Megatron-LM computes before it calls its DDP class) is replaced
    by the owner-aligned one. `pg_collection` must hold Megatron's global data-parallel group.
    ranks_per_node > 0 switches grad reduce and param publish to two levels (intra-node, then
    inter-node; megatron/hierarchy.py) with node-striped owners. publish_dtype 'fp8_e4m3' /
    'fp8_e5m2' publishes Muon matrices as owner-quantized FP8 bytes (megatron/publish.py)."""

    def __init__(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None,
                 full_param_layout=None, *, dmuon=None, **overrides):
        from .checks import check_model_parallel_config
        from .config import with_overrides
        from .hierarchy import check_two_level_config
        from .publish import check_publish_config, install_fp8_publish
        from .qk_clip import check_qk_clip_plan

        cfg = with_overrides(dmuon, overrides)
        opts = cfg.layout
        check_model_parallel_config(config)  # unsupported layouts fail here, before any buffer exists
        check_publish_config(cfg.publish_dtype, module.parameters(), opts.ranks_per_node)
        # megabatch: one bucket per buffer even with --overlap-grad-reduce, so every same-shape group
        # is reduced and published by the buffer's one collective, however many layers (docs/dion3.md)
        disable_bucketing = disable_bucketing or opts.megabatch
        groups = layout_groups(config, ddp_config)
        dp_group = groups["dp"]
        _check_same_group(pg_collection, dp_group)
        check_two_level_config(ddp_config, dp_group.size(), opts.ranks_per_node)
        bucket_size = default_bucket_size(ddp_config, dp_group.size(), disable_bucketing, groups["pp"].rank())
        plan, full_layout = build_plan(module, ddp_config, groups, bucket_size, cfg, model_config=config)
        check_qk_clip_plan(config, plan)
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing,
                         full_param_layout=full_layout)
        self.dmuon_plan = plan
        from .te_fp8 import fp8_param_summary

        fp8_params = fp8_param_summary(self, config)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"> {plan.routing_summary()}", flush=True)  # (this stage's params; PP stages plan their own)
            if fp8_params:
                print(f"> DMuon FP8 params: {fp8_params}", flush=True)
        self._grads_reduced = False
        self.node_topology = None  # two-level groups (runtime/node_groups.py), when ranks_per_node > 0
        if opts.ranks_per_node:
            from ..runtime.node_groups import build_node_topology
            from .hierarchy import make_two_level

            self.node_topology = build_node_topology(dp_group, opts.ranks_per_node)
            make_two_level(self, self.node_topology)
        self.publish_masters = install_fp8_publish(self, plan)

    def param_names(self) -> Dict[torch.Tensor, str]:
        """{param: its name in the plan} of every trainable param."""
        return {p: n for n, p in self.module.named_parameters() if p.requires_grad}

    # Whether this step's grads reached their owners: a hand-written loop that skips
    # finish_grad_sync() would otherwise step every owner on its own unreduced grads, silently.
    @property
    def grads_reduced(self) -> bool:
        return self._grads_reduced

    def zero_grad_buffer(self):
        super().zero_grad_buffer()
        self._grads_reduced = False

    def start_grad_sync(self, *unused):
        super().start_grad_sync(*unused)
        self._grads_reduced = not self.ddp_config.overlap_grad_reduce  # synchronous without overlap

    def finish_grad_sync(self, *args, **kwargs):
        super().finish_grad_sync(*args, **kwargs)
        self._grads_reduced = True


def _check_same_group(pg_collection, dp_group) -> None:
    group = getattr(pg_collection, "intra_dp_cp", None) or getattr(pg_collection, "dp_cp", None)
    if group is None:
        return
    ranks = torch.distributed.get_process_group_ranks
    if ranks(group) != ranks(dp_group):
        raise ValueError(
            "DMuon plans owners over Megatron's global data-parallel group; this DDP was given a "
            "pg_collection with another one (custom process groups are not supported yet)"
        )


def build_dmuon_ddp(config, ddp_config, module, disable_bucketing=False, dmuon=None, **overrides) -> DMuonDDP:
    """DistributedDataParallel over an owner-aligned layout (the DMuon drop-in for DDP(...))."""
    return DMuonDDP(config, ddp_config, module, disable_bucketing=disable_bucketing, dmuon=dmuon, **overrides)


class MegatronLayerWiseDDP(_import_distributed_data_parallel()):
    """Megatron's own DDP as Megatron-LM's `wrap_model_chunks_with_ddp` builds it for `--optimizer
    muon --use-distributed-optimizer` (the `--dmuon-mode megatron_layerwise` baseline): params tagged
    for buffer routing and LayerWise's shard-aligned `full_param_layout`, so each Muon matrix is
    reduced whole onto the rank that steps it. Without a distributed optimizer, Megatron's plain DDP."""

    def __init__(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None,
                 full_param_layout=None):
        if ddp_config.use_distributed_optimizer and full_param_layout is None:
            from megatron.core import parallel_state
            from megatron.core.optimizer.layer_wise_optimizer import (
                LayerWiseDistributedOptimizer, tag_params_for_buffer_routing)

            tag_params_for_buffer_routing([module])
            full_param_layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
                [p for p in module.parameters() if p.requires_grad], ddp_config.bucket_size,
                parallel_state.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True),
                ddp_config,
                expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size(
                    partial_expert_data_parallel=True))
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing,
                         pg_collection=pg_collection, full_param_layout=full_param_layout)
