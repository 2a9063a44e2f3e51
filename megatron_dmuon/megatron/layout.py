"""Hand megatron-core's DDP an owner-aligned FullParamLayout (Megatron 0.19 `full_param_layout`)."""
from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from typing import Callable, Dict, List, Optional

import torch

from ..planning.owner_layout import OwnerLayout, ParamItem, megatron_bucket_size, plan_owner_layout
from ..algorithms.tp_shards import tp_full_shape
from ..planning.params import is_muon_param, ns_cost
from ..planning.plans import matrix_pieces
from ..planning.caches import PlanCache, default_plan_cache_path, plan_key
from ..planning.startup_profile import STARTUP_BUDGET_S, milp_time_limit, profile_budget


def default_bucket_size(ddp_config, dp_size: int, disable_bucketing: bool = False, pp_rank: int = 0):
    """What DDP's __init__ will use (it sets ddp_config.bucket_size itself later)."""
    return megatron_bucket_size(dp_size, ddp_config.overlap_grad_reduce, ddp_config.bucket_size, pp_rank,
                                disable_bucketing)


def full_matrix_shape(param: torch.Tensor, tp_size: int):
    """Shape of the whole matrix a (possibly TP-sharded) param is part of."""
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        return tp_full_shape(param.shape, param.partition_dim, tp_size)
    return tuple(param.shape)


def milp_planning_options(settings, startup_budget_s: float = STARTUP_BUDGET_S, plan_cache=None) -> dict:
    """Layout options of ``--dmuon-balance milp``: profile the owner step's NS on this GPU (cached
    per device and software versions), then the MILP, both inside ``startup_budget_s`` on rank 0;
    the finished plan is cached, so the next start with the same model plans nothing."""
    from ..runtime.ns_timing import profiled_cost_model

    return dict(cost_model_fn=functools.partial(profiled_cost_model, settings=settings,
                                                budget_s=profile_budget(startup_budget_s)),
                plan_cache=plan_cache or default_plan_cache_path(), startup_budget_s=startup_budget_s)


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


# DMuonConfig().split_flags(): the split an optimizer built with the defaults applies (config.py
# imports this module, so the value is repeated here; tests/test_load_balancing.py checks they agree)
DEFAULT_SPLIT = dict(split_qkv=True, split_glu=False, per_head=False)


def _elementwise_costs(model):
    """``elementwise_costs`` in the planner's units: ms under a profiled cost model, else NS FLOPs
    at the rates of the cluster config's device matching this GPU (the first one on CPU)."""
    from ..planning.cost_model import DeviceSpec, device_spec_for, elementwise_costs

    if model is not None:
        device = getattr(model, "device", None)
        return elementwise_costs(device, "ms") if isinstance(device, DeviceSpec) else None
    on_gpu = torch.cuda.is_available()
    return elementwise_costs(device_spec_for(torch.cuda.get_device_name() if on_gpu else "", warn=on_gpu), "flops")


def compute_owner_aligned_layout(
    module: torch.nn.Module,
    ddp_config,
    groups: Dict[str, object],
    bucket_size: Optional[int],
    cost_fn: Callable = ns_cost,
    max_bucket_padding: float = 0.02,
    balance: str = "cost",
    cost_model_fn: Optional[Callable] = None,
    milp_options: Optional[dict] = None,
    plan_cache=None,
    startup_budget_s: Optional[float] = None,
    model_config=None,
    split: Optional[dict] = None,
    elementwise="auto",
):
    """Owner plan + FullParamLayout for every buffer of `module` (dense: DP x TP owners; expert:
    expert-DP x expert-TP owners), planned on rank 0 of the pipeline stage and broadcast.

    A matrix costs what the owner step will run on it: with `model_config` (the TransformerConfig)
    and `split` (``rule_for_megatron_param``'s flags, default DMuonConfig's: QKV split), the sum
    over its pieces (q, k, v; gate, up), else the whole matrix. `cost_fn(shape)` gives NS FLOPs.
    `elementwise`: (AdamW, Muon) element-wise work per parameter element in the cost's units
    (``plan_owner_layout``); 'auto': from the cluster config (``planning.cost_model.elementwise_costs``:
    NS FLOPs, or ms with `cost_model_fn`); None: NS only.

    `cost_model_fn(shapes, max_batch) -> planning.cost_model.CostModel` (e.g.
    runtime.ns_timing.profiled_cost_model: the start-up profile) replaces `cost_fn` with predicted
    ms and batched-launch costs; it runs on rank 0 only. `milp_options` go to the MILP
    (balance='milp'). `plan_cache` (a path): rank 0 reuses a plan made for the same parameters,
    sizes, options and costs. `startup_budget_s`: the MILP's time limit shrinks to what profiling
    left of it (planning.startup_profile.milp_time_limit).

    Returns (FullParamLayout, {BufferKey: OwnerLayout}, {param: name}).
    """
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
    from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout

    if not ddp_config.use_distributed_optimizer:
        raise ValueError(
            "--optimizer dmuon needs the distributed optimizer: set "
            "DistributedDataParallelConfig(use_distributed_optimizer=True) / --use-distributed-optimizer"
        )
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    name_of = {p: n for n, p in named}
    buffers = group_params_for_buffers([p for _, p in named], ddp_config.grad_reduce_in_fp32)
    keys = list(buffers.keys())

    def sizes(key):
        kind = "expert_" if key.is_expert_parallel else ""
        return groups[kind + "dp"].size(), groups[kind + "tp"].size()

    split = DEFAULT_SPLIT if split is None else split

    def pieces_of(name, shape):  # what the owner step orthogonalizes for this matrix
        return matrix_pieces(name, shape, model_config, split) if model_config is not None else [tuple(shape)]

    def items_of(key, model=None):
        params, _ = buffers[key]
        tp_size = sizes(key)[1]
        items = []
        for p in params:
            name, shape = name_of[p], full_matrix_shape(p, tp_size)
            matrix = is_muon_param(name, p)
            cost = launch = 0.0
            if matrix:
                pieces = pieces_of(name, shape)
                if model is not None:
                    cost = sum(model.per_matrix_ms(s) for s in pieces)
                    launch = sum(model.launch_ms(s) for s in set(pieces))
                else:
                    cost = sum(cost_fn(s) for s in pieces)
            items.append(ParamItem(name=name, numel=p.numel(), is_matrix=matrix, cost=cost,
                                   shape_key="x".join(map(str, shape)),  # the owner batches full matrices by shape
                                   own_bucket=bool(getattr(p, "shared_embedding", False)), launch_cost=launch))
        return items

    stage = groups["stage"]
    payload = [None]
    if stage.rank() == 0:
        model = None
        started = time.perf_counter()
        if cost_model_fn is not None:  # profile the shapes the owner step will orthogonalize
            counts = Counter(s for key in keys for p in buffers[key][0] if is_muon_param(name_of[p], p)
                             for s in pieces_of(name_of[p], full_matrix_shape(p, sizes(key)[1])))
            model = cost_model_fn(sorted(counts), min(max(counts.values(), default=1), 8))
        if startup_budget_s is not None and balance == "milp":
            limit = milp_time_limit(startup_budget_s, time.perf_counter() - started,
                                    (milp_options or {}).get("time_limit_s"))
            milp_options = dict(milp_options or {}, time_limit_s=limit)
        items = {key: items_of(key, model) for key in keys}
        if isinstance(elementwise, str):
            elementwise = _elementwise_costs(model)
        cache, cache_key = None, None
        if plan_cache is not None:
            cache = PlanCache(plan_cache)
            cache_key = plan_key({"items": {str(k): [dataclasses.astuple(it) for it in items[k]] for k in keys},
                                  "sizes": {str(k): sizes(k) for k in keys}, "bucket_size": bucket_size,
                                  "max_bucket_padding": max_bucket_padding, "balance": balance,
                                  "milp_options": milp_options, "elementwise": elementwise})
            cached = cache.get(cache_key)
            if cached is not None and set(cached) == {str(k) for k in keys}:
                payload = [{k: cached[str(k)] for k in keys}]
        if payload[0] is None:
            rank_cost: Dict[bool, List[float]] = {}
            plans = {}
            for key in keys:
                dp_size, tp_size = sizes(key)
                cost = rank_cost.setdefault(key.is_expert_parallel, [0.0] * (dp_size * tp_size))
                plans[key] = plan_owner_layout(items[key], dp_size, bucket_size, max_bucket_padding, cost, tp_size,
                                               balance, milp_options=milp_options, elementwise=elementwise)
            # one plan for everybody: rank 0's (costs may come from profiling that differs per rank)
            payload = [{k: plans[k].to_json() for k in keys}]
            if cache is not None:
                cache.put(cache_key, {str(k): v for k, v in payload[0].items()})
    if stage.size() > 1:
        torch.distributed.broadcast_object_list(payload, src=torch.distributed.get_global_rank(stage, 0), group=stage)
    plans = {k: OwnerLayout.from_json(payload[0][k]) for k in keys}

    layouts = {}
    for key in keys:
        params, param_indices = buffers[key]
        plan = plans[key]
        plan.validate(items_of(key))  # rank 0's plan fits this rank's params (same names and sizes)
        layouts[key] = PerBufferParamLayout(
            param_index_map={p: plan.param_ranges[name_of[p]] for p in params},
            bucket_indices=[(b.start, b.end) for b in plan.buckets],
            per_bucket_numel_unpadded=[b.numel_unpadded for b in plan.buckets],
            param_indices=param_indices,
            num_optimizer_shards=sizes(key)[0],
        )
    return FullParamLayout(layouts=layouts), plans, name_of


def _import_distributed_data_parallel():
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel


class DMuonDDP(_import_distributed_data_parallel()):
    """Megatron's DistributedDataParallel over an owner-aligned layout (the DMuon drop-in for
    DDP(...)); constructible exactly as Megatron constructs its DDP.

    `full_param_layout` (Megatron's own layout, which Megatron-LM computes before it calls its DDP
    class) is replaced by the owner-aligned one. `pg_collection` must hold Megatron's global
    data-parallel group: owners are planned over the global parallel state.
    ranks_per_node > 0 switches grad reduce and param publish to two levels (intra-node, then
    inter-node; megatron/hierarchy.py) with node-striped owners. publish_dtype 'fp8_e4m3' /
    'fp8_e5m2' publishes Muon matrices as owner-quantized FP8 bytes (megatron/publish.py)."""

    def __init__(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None,
                 full_param_layout=None, *, ranks_per_node: int = 0, publish_dtype: str = "param",
                 megabatch: bool = False, **layout_kwargs):
        from .checks import check_model_parallel_config
        from .hierarchy import check_two_level_config
        from .publish import check_publish_config, install_fp8_publish

        check_model_parallel_config(config)  # unsupported layouts fail here, before any buffer exists
        check_publish_config(publish_dtype, module.parameters(), ranks_per_node)
        # megabatch: one bucket per buffer even with --overlap-grad-reduce, so every same-shape group
        # is reduced and published by the buffer's one collective, however many layers (docs/dion3.md)
        disable_bucketing = disable_bucketing or megabatch
        groups = layout_groups(config, ddp_config)
        dp_group = groups["dp"]
        _check_same_group(pg_collection, dp_group)
        check_two_level_config(ddp_config, dp_group.size(), ranks_per_node)
        bucket_size = default_bucket_size(ddp_config, dp_group.size(), disable_bucketing, groups["pp"].rank())
        full_layout, plans, name_of = compute_owner_aligned_layout(module, ddp_config, groups, bucket_size,
                                                                   model_config=config, **layout_kwargs)
        super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing,
                         full_param_layout=full_layout)
        self.dmuon_owner_plans = plans
        self.dmuon_param_names = name_of
        self.dmuon_topology = None
        if ranks_per_node:
            from ..runtime.node_groups import build_node_topology
            from .hierarchy import make_two_level

            topo = build_node_topology(dp_group, ranks_per_node)
            for bucket_group in self.bucket_groups:
                make_two_level(bucket_group, topo)
            for buffer in self.buffers:
                buffer.dmuon_shard_index = topo.shard_index
            self.dmuon_topology = topo
        install_fp8_publish(self, publish_dtype)

    # Whether this step's grads reached their owners: a hand-written loop that skips
    # finish_grad_sync() would otherwise step every owner on its own unreduced grads, silently.
    dmuon_grads_reduced = False

    def zero_grad_buffer(self):
        super().zero_grad_buffer()
        self.dmuon_grads_reduced = False

    def start_grad_sync(self, *unused):
        super().start_grad_sync(*unused)
        self.dmuon_grads_reduced = not self.ddp_config.overlap_grad_reduce  # synchronous without overlap

    def finish_grad_sync(self, *args, **kwargs):
        super().finish_grad_sync(*args, **kwargs)
        self.dmuon_grads_reduced = True


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


def build_dmuon_ddp(config, ddp_config, module, disable_bucketing=False,
                    ranks_per_node: int = 0, publish_dtype: str = "param", megabatch: bool = False,
                    **layout_kwargs) -> DMuonDDP:
    """DistributedDataParallel over an owner-aligned layout (the DMuon drop-in for DDP(...))."""
    return DMuonDDP(config, ddp_config, module, disable_bucketing=disable_bucketing,
                    ranks_per_node=ranks_per_node, publish_dtype=publish_dtype, megabatch=megabatch, **layout_kwargs)
