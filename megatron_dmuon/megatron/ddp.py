"""Plan once and hand megatron-core's DDP the owner-aligned FullParamLayout (Megatron 0.19 `full_param_layout`)."""
from __future__ import annotations

import functools
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from ..algorithms.tp_shards import tp_full_shape
from ..planning.owner_layout import megatron_bucket_size
from ..planning.overlap_mode import OverlapMode
from ..planning.owner_planning import BufferParams, CostSource, plan_owners
from ..planning.ns_choice import owner_ns_cost
from ..planning.params import param_routing
from ..planning.plan import DMuonPlan, MatrixRecord, merged_records
from ..planning.planners import split_rule_for
from ..planning.split_layout import shares_ns
from ..planning.tp_cost import choose_tp_method
from .config import in_flag_words


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


def buffer_name(key) -> str:
    """A DDP buffer's name in the plan: 'dense' or 'expert', then its param and grad dtypes."""
    kind = "expert" if key.is_expert_parallel else "dense"
    return f"{kind}/{key.param_dtype}/{key.grad_dtype}"


def split_rule(name: str, full_shape, model_config, cfg):
    """How the owner step cuts the full matrix ``name`` (TP shards merged) under ``cfg``'s split
    flags: ``planning.planners.split_rule_for``."""
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


def build_plan(module: torch.nn.Module, ddp_config, groups: Dict[str, object], bucket_size: Optional[int],
               cfg, model_config=None):
    """The DMuonPlan of `module` under the complete config `cfg` (dense buffers: DP x TP owners;
    expert buffers: expert-DP x expert-TP owners), and the FullParamLayout DDP builds its buffers
    from. The Megatron side of the planning: the buffers and records (``plan_records``, the split
    flags need `model_config`, the TransformerConfig), then ``planning.owner_planning.plan_owners``
    on rank 0 of the pipeline stage (with ``cfg.layout``'s planning options and
    ``cost_source(cfg)``), broadcast so that every rank holds rank 0's plan."""
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers

    if not ddp_config.use_distributed_optimizer:
        raise ValueError(
            "--optimizer dmuon needs the distributed optimizer: set "
            "DistributedDataParallelConfig(use_distributed_optimizer=True) / --use-distributed-optimizer"
        )
    named = {p: n for n, p in module.named_parameters() if p.requires_grad}
    buffers = group_params_for_buffers(list(named), ddp_config.grad_reduce_in_fp32)
    sizes = _grid_sizes(groups)
    records = _records(named, buffers, sizes, cfg, model_config)
    opts, stage = cfg.layout, groups["stage"]
    payload = [None]
    if stage.rank() == 0:  # one plan for everybody: rank 0's (costs may come from profiling that differs per rank)
        to_plan = {key: BufferParams(tuple(records[key]), *sizes(key), expert=key.is_expert_parallel)
                   for key in buffers}
        options = planning_options(cfg, model_config)
        with warnings.catch_warnings(record=True) as said:  # (re-said below in the flags' words)
            warnings.simplefilter("always")
            payload = [plan_owners(to_plan, bucket_size, options, cost_source(cfg))]
        for w in said:
            warnings.warn_explicit(in_flag_words(str(w.message)), w.category, w.filename, w.lineno)
    if stage.size() > 1:
        torch.distributed.broadcast_object_list(payload, src=torch.distributed.get_global_rank(stage, 0), group=stage)
    planned = payload[0]
    layouts = {buffer_name(k): planned.layout(k) for k in buffers}
    costed = [planned.costed(r) for k in buffers for r in records[k]]
    plan = DMuonPlan(records=merged_records(costed, layouts), layouts=layouts, settings=cfg.plan_summary(),
                     ranks_per_node=opts.ranks_per_node, publish_dtype=cfg.publish_dtype, config=cfg)
    return plan, _full_param_layout(buffers, named, layouts, sizes)


def split_layout_refusal(cfg, model_config=None) -> Optional[str]:
    """Why this run cannot take the split layout (``DMuonConfig.split_layout_refusal``, plus the model's
    --qk-clip, whose clip rescales each linear_qkv master as a whole matrix on one rank); None: it can."""
    if getattr(model_config, "qk_clip", False):
        return "does not run --qk-clip (Megatron's clip rescales each linear_qkv master whole on its owner)"
    return cfg.split_layout_refusal()


def planning_options(cfg, model_config=None):
    """Rank 0's owner-planning options of this run (planning/owner_planning.OwnerPlanningOptions): the
    layout flags; whether 'auto' may take the split layout (``split_layout_refusal``); whether the step
    is overlapped (--dmuon-overlap-step on|sync: 'auto' then weighs the layouts by their padding,
    owner_planning.choose_scheme); whether the split layout may share a tall matrix's NS over a team
    of homes (split_layout.shares_ns)."""
    overlapped = OverlapMode(cfg.muon.overlap_step).cuts_per_need_group
    return cfg.layout.planning_options(split_allowed=split_layout_refusal(cfg, model_config) is None,
                                       overlapped_step=overlapped,
                                       shared_ns=cfg.layout.ns_teams == "auto" and shares_ns(cfg.muon.ns_method, overlapped))


def check_split_layout(cfg, model_config=None) -> None:
    """--dmuon-dp-layout split on a run that cannot take it: refused by name before any buffer exists."""
    refusal = split_layout_refusal(cfg, model_config)
    if cfg.layout.dp_layout == "split" and refusal:
        raise ValueError(f"--dmuon-dp-layout split {refusal}: drop one of the two flags (or pass --dmuon-dp-layout "
                         "auto, which keeps whole matrices for such runs)")


def _grid_sizes(groups: Dict[str, object]):
    """``sizes(buffer key)`` = (DP size, TP size) of the cells that own the buffer's matrices."""
    def sizes(key) -> Tuple[int, int]:
        kind = "expert_" if key.is_expert_parallel else ""
        return groups[kind + "dp"].size(), groups[kind + "tp"].size()

    return sizes


def cost_source(cfg) -> CostSource:
    """Where rank 0's planning takes its costs from under `cfg`: ``cfg.layout.cost_fn`` (default
    ``owner_ns_cost`` under the run's own resolver, ``cfg.muon.ns_resolver('cuda')``: on the GPU the
    plan is for, 'auto' takes this GPU's autotune measurement where there is one, else the FLOP rule,
    so the planner costs what runs) per piece; a cost model (``cfg.layout.cost_model_fn``) or the
    start-up profile of this GPU (taken where the planning options ask for it); this GPU's name for
    the cluster config's element-wise rates."""
    opts = cfg.layout
    ns_cost = opts.cost_fn or functools.partial(owner_ns_cost, resolver=cfg.muon.ns_resolver("cuda"))
    return CostSource(ns_cost=ns_cost, cost_model_fn=opts.cost_model_fn,
                      rank_profile=functools.partial(_profiled_rank_model, settings=cfg.muon),
                      gpu_name=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      gpus_per_node=gpus_per_node())


def gpus_per_node() -> int:
    """GPUs (ranks) per node: torchrun's LOCAL_WORLD_SIZE, else this node's GPU count, else 8."""
    import os

    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    return (torch.cuda.device_count() if torch.cuda.is_available() else 0) or 8


def _profiled_rank_model(counts, cells: int, budget_s: float, *, settings):
    """The start-up profile's RankCostModel (measured on this GPU or read from its cache;
    analytic off CUDA) for ``counts`` matrices of each piece shape shared by ``cells`` owners."""
    from ..runtime.rank_profile import profile_counts, profiled_rank_model

    return profiled_rank_model(profile_counts(counts, cells), settings=settings, budget_s=budget_s)


def _full_param_layout(buffers, named, layouts, sizes):
    """Megatron's FullParamLayout of the planned buffers: each param's range, the buckets."""
    from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout

    per_buffer = {}
    for key, (params, param_indices) in buffers.items():
        layout = layouts[buffer_name(key)]
        per_buffer[key] = PerBufferParamLayout(
            param_index_map={p: layout.param_ranges[named[p]] for p in params},
            bucket_indices=[(b.start, b.end) for b in layout.buckets],
            per_bucket_numel_unpadded=[b.numel_unpadded for b in layout.buckets],
            param_indices=param_indices,
            num_optimizer_shards=sizes(key)[0],
        )
    return FullParamLayout(layouts=per_buffer)


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
        from .config_checks import check_model_parallel_config
        from .config import with_overrides
        from .hierarchy import check_two_level_config
        from .publish import check_publish_config, install_fp8_publish
        from .qk_clip import check_qk_clip_plan

        cfg = with_overrides(dmuon, overrides)
        opts = cfg.layout
        check_model_parallel_config(config)  # unsupported layouts fail here, before any buffer exists
        check_split_layout(cfg, config)
        check_publish_config(cfg.publish_dtype, module.parameters())
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
            print(f"> {plan.layout_summary()}", flush=True)
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
