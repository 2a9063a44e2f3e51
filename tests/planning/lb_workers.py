"""Rank function for tests/planning/test_milp.py: MILP owner plans of a real megatron-core GPT on
gloo ranks, with costs that differ per rank (as start-up profiles may)."""
from __future__ import annotations

import torch


class RankCosts:
    """Predicted ms per matrix that disagree between ranks: rank 0 finds wide matrices dear,
    rank 1 tall ones."""

    def __init__(self, rank):
        self.rank = rank

    def per_matrix_ms(self, shape):
        r, c = shape
        dear = (r < c) if self.rank == 0 else (r > c)
        return r * c * 1e-4 * (6.0 if dear else 1.0)

    def launch_ms(self, shape):
        return 0.05


def milp_layouts(rank, world_size, cache_dir):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_dmuon.megatron import ddp as layout_mod
    from megatron_dmuon.megatron.config import with_overrides
    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt
    from megatron_dmuon.planning import owner_layout
    from megatron_dmuon.testing.workers import init_parallel

    init_parallel()
    model = build_gpt(GPTShape(num_layers=3))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    groups = layout_mod.layout_groups(model.config, ddp_config)
    runs = {"milp": 0, "cost_model": 0}
    solve = owner_layout._milp_owners

    def counted(*a, **k):
        runs["milp"] += 1
        return solve(*a, **k)

    owner_layout._milp_owners = counted

    def cost_model_fn(shapes, max_batch):
        runs["cost_model"] += 1
        return RankCosts(rank)

    def plan(stage_group, cache=None, budget=None):
        g = dict(groups, stage=stage_group)
        cfg = with_overrides(None, dict(balance="milp", cost_model_fn=cost_model_fn, milp_options={"time_limit_s": 20.0},
                                        plan_cache=cache, plan_budget_s=budget))
        dmuon_plan, _ = layout_mod.build_plan(model, ddp_config, g, bucket_size=None, cfg=cfg)
        return [p.to_json() for p in dmuon_plan.layouts.values()]

    alone = [torch.distributed.new_group([r]) for r in range(world_size)]  # collective: every rank makes both
    local = plan(alone[rank])  # what this rank would plan on its own costs
    runs.update(milp=0, cost_model=0)
    cache = f"{cache_dir}/plans.json"
    shared = plan(groups["stage"], cache, budget=60.0)
    milp_runs = runs["milp"]
    # the next start (another time left for the MILP): the plan comes from the cache
    second = plan(groups["stage"], cache, budget=45.0)
    assert runs["milp"] == milp_runs, "the cached plan was planned again"
    calls = runs["cost_model"]
    # an entry whose owners are not ranks of this DP size (7 at DP = 2) is dropped with
    # a warning naming the cache file, and the model is planned again
    import json
    import warnings

    if rank == 0:
        data = json.load(open(cache))
        for entry in data["entries"].values():
            for key, text in entry.items():
                layout = json.loads(text)
                layout["owners"] = {name: 7 for name in layout["owners"]}
                entry[key] = json.dumps(layout)
        json.dump(data, open(cache, "w"))
    torch.distributed.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        third = plan(groups["stage"], cache, budget=45.0)
    warned = [str(w.message) for w in caught if "unusable" in str(w.message)]
    return {"layouts": shared, "local": local, "second": second, "milp_runs": milp_runs,
            "cost_model_calls": calls, "third": third, "warned": warned, "milp_after": runs["milp"]}


def layout_item_costs(rank, world_size, split):
    """The planner items build_plan makes for a real megatron-core GPT (GQA,
    SwiGLU) under ``split``, and the element-wise credit it plans with."""
    from megatron_dmuon.megatron import ddp as layout_mod
    from megatron_dmuon.megatron.config import with_overrides
    from megatron_dmuon.planning.params import ns_cost

    model, ddp_config, groups, seen = _captured_planning(1)
    cfg = with_overrides(None, dict(split=split, cost_fn=ns_cost))
    layout_mod.build_plan(model, ddp_config, groups, bucket_size=None, cfg=cfg, model_config=model.config)
    config = model.config
    return {"items": {it.name: (it.cost, it.numel, it.is_matrix) for it in seen["items"]},
            "elementwise": list(seen["kwargs"]["elementwise"]), "heads": config.num_attention_heads,
            "groups": config.num_query_groups, "kv_channels": config.kv_channels, "hidden": config.hidden_size,
            "ffn": config.ffn_hidden_size}


def rank_milp_layouts(rank, world_size):
    """--dmuon-balance milp as the flag sets it (the start-up rank profile; analytic on CPU) on a
    real megatron-core GPT: every rank's plan, and on rank 0 the rank model's prediction of that
    plan and of the greedy's on the same items."""
    from megatron_dmuon.megatron import ddp as layout_mod
    from megatron_dmuon.megatron.config import with_overrides
    from megatron_dmuon.planning.owner_layout import plan_owner_layout
    from megatron_dmuon.planning.rank_milp import layout_loads

    model, ddp_config, groups, seen = _captured_planning(3)
    cfg = with_overrides(None, dict(balance="milp", profile=True, plan_budget_s=20.0))
    dmuon_plan, _ = layout_mod.build_plan(model, ddp_config, groups, bucket_size=None, cfg=cfg,
                                          model_config=model.config)
    out = {"layouts": {k: v.to_json() for k, v in dmuon_plan.layouts.items()}}
    if rank == 0:
        items, kwargs = seen["items"], seen["kwargs"]
        rank_model = kwargs["model"]
        layout = next(iter(dmuon_plan.layouts.values()))
        zero = [0.0] * world_size
        greedy = plan_owner_layout(items, world_size, None, balance="cost", elementwise=kwargs["elementwise"])
        out.update(source=rank_model.meta.get("source"), rank_cost=layout.rank_cost,
                   predicted=layout_loads(items, layout, rank_model, zero),
                   greedy=layout_loads(items, greedy, rank_model, zero),
                   pieces=[list(it.pieces) for it in items if it.is_matrix])
    return out


def _captured_planning(num_layers):
    """A real megatron-core GPT, its DDP config and layout groups, and a dict that receives the
    items and keyword arguments of the owner planner build_plan's planning calls (``plan_owner_layout``,
    or ``plan_rank_owner_layout`` for --dmuon-balance milp)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_dmuon.megatron import ddp as layout_mod
    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt
    from megatron_dmuon.planning import owner_planning
    from megatron_dmuon.testing.workers import init_parallel

    init_parallel()
    model = build_gpt(GPTShape(num_layers=num_layers))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    groups = layout_mod.layout_groups(model.config, ddp_config)
    seen = {}

    def capturing(plan):
        def capture(items, *args, **kwargs):
            seen.update(items=items, kwargs=kwargs)
            return plan(items, *args, **kwargs)
        return capture

    owner_planning.plan_owner_layout = capturing(owner_planning.plan_owner_layout)
    owner_planning.plan_rank_owner_layout = capturing(owner_planning.plan_rank_owner_layout)
    return model, ddp_config, groups, seen
