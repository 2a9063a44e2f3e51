"""Hand megatron-core's DDP an owner-aligned FullParamLayout (Megatron 0.19 `full_param_layout`)."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from ..planning.owner_layout import OwnerLayout, ParamItem, plan_owner_layout
from ..planning.params import is_muon_param, ns_cost


def default_bucket_size(ddp_config, dp_size: int, disable_bucketing: bool = False, pp_rank: int = 0):
    """What DDP's __init__ will use (it sets ddp_config.bucket_size itself later)."""
    if disable_bucketing or pp_rank > 0 or not ddp_config.overlap_grad_reduce:
        return None
    if ddp_config.bucket_size is not None:
        return ddp_config.bucket_size
    return max(40_000_000, 1_000_000 * dp_size)


def compute_owner_aligned_layout(
    module: torch.nn.Module,
    ddp_config,
    dp_group,
    bucket_size: Optional[int],
    cost_fn: Callable = ns_cost,
    max_bucket_padding: float = 0.02,
):
    """Owner plan + FullParamLayout for every buffer of `module`, planned on DP rank 0 and broadcast.

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
    groups = group_params_for_buffers([p for _, p in named], ddp_config.grad_reduce_in_fp32)
    dp_size = dp_group.size()
    plans: Dict = {}
    rank_cost = [0.0] * dp_size
    keys = list(groups.keys())
    for key in keys:
        params, _ = groups[key]
        if key.is_expert_parallel:
            raise NotImplementedError(
                "DMuon: expert-parallel buffers (EP > 1) are not supported yet; run MoE with "
                "--expert-model-parallel-size 1 or use --optimizer adam for now"
            )
        items = [
            ParamItem(
                name=name_of[p],
                numel=p.numel(),
                is_matrix=is_muon_param(name_of[p], p),
                cost=cost_fn(p.shape) if is_muon_param(name_of[p], p) else 0.0,
                shape_key="x".join(map(str, p.shape)),
                own_bucket=bool(getattr(p, "shared_embedding", False)),
            )
            for p in params
        ]
        plans[key] = plan_owner_layout(items, dp_size, bucket_size, max_bucket_padding, rank_cost)
    # one plan for everybody: rank 0's (costs may come from profiling that differs per rank)
    payload = [{k: plans[k].to_json() for k in keys} if dp_group.rank() == 0 else None]
    if dp_size > 1:
        src = torch.distributed.get_global_rank(dp_group, 0)
        torch.distributed.broadcast_object_list(payload, src=src, group=dp_group)
    plans = {k: OwnerLayout.from_json(payload[0][k]) for k in keys}

    layouts = {}
    for key in keys:
        params, param_indices = groups[key]
        plan = plans[key]
        layouts[key] = PerBufferParamLayout(
            param_index_map={p: plan.param_ranges[name_of[p]] for p in params},
            bucket_indices=[(b.start, b.end) for b in plan.buckets],
            per_bucket_numel_unpadded=[b.numel_unpadded for b in plan.buckets],
            param_indices=param_indices,
            num_optimizer_shards=dp_size,
        )
    return FullParamLayout(layouts=layouts), plans, name_of


def build_dmuon_ddp(config, ddp_config, module, dp_group=None, disable_bucketing=False,
                    ranks_per_node: int = 0, **layout_kwargs):
    """DistributedDataParallel over an owner-aligned layout (the DMuon drop-in for DDP(...)).

    ranks_per_node > 0 switches grad reduce and param publish to two levels (intra-node, then
    inter-node; megatron/hierarchy.py) with node-striped owners."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel

    from .hierarchy import check_two_level_config

    dp_group = dp_group or parallel_state.get_data_parallel_group(with_context_parallel=True)
    check_two_level_config(ddp_config, dp_group.size(), ranks_per_node)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    bucket_size = default_bucket_size(ddp_config, dp_group.size(), disable_bucketing, pp_rank)
    full_layout, plans, name_of = compute_owner_aligned_layout(module, ddp_config, dp_group, bucket_size, **layout_kwargs)
    ddp = DistributedDataParallel(config, ddp_config, module, disable_bucketing=disable_bucketing, full_param_layout=full_layout)
    ddp.dmuon_owner_plans = plans
    ddp.dmuon_param_names = name_of
    ddp.dmuon_topology = None
    if ranks_per_node:
        from ..runtime.hierarchy import build_node_topology
        from .hierarchy import make_two_level

        topo = build_node_topology(dp_group, ranks_per_node)
        for bucket_group in ddp.bucket_groups:
            make_two_level(bucket_group, topo)
        for buffer in ddp.buffers:
            buffer.dmuon_shard_index = topo.shard_index
        ddp.dmuon_topology = topo
    return ddp
