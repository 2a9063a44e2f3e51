"""Rank 0's owner planning (planning/owner_planning.py) on CPU, without megatron-core: the plans
of a small GPT's buffers under each balance and cost source, the plan cache, the start-up budget.

The pinned owners, loads and cache keys are those megatron/ddp.py::build_plan gave for the same
model (megatron-core GPTShape(num_layers=3): hidden 64, 4 heads in 2 query groups, SwiGLU FFN 160,
vocab 256; MoE: 4 experts of FFN 96, 2 local under EP 2) on 2 gloo ranks before the planning moved
out of it: the move changed no plan."""
import dataclasses
import json
import warnings

import pytest

from megatron_dmuon.planning import owner_planning
from megatron_dmuon.planning.caches import PlanCache
from megatron_dmuon.planning.cost_model import device_spec_for
from megatron_dmuon.planning.owner_layout import OwnerLayout
from megatron_dmuon.planning.owner_planning import BufferParams, CostSource, OwnerPlanningOptions, plan_owners
from megatron_dmuon.planning.plan import MatrixRecord
from megatron_dmuon.planning.rank_cost import RankCostModel
from megatron_dmuon.planning.startup_budget import profile_budget

# str() of megatron-core's BufferKey: the plan cache names buffers by it
DENSE = "BufferKey(param_dtype=torch.float32, grad_dtype=torch.float32, is_expert_parallel=False, " \
        "is_managed_by_layer_wise_optimizer=False)"
EXPERT = DENSE.replace("is_expert_parallel=False", "is_expert_parallel=True")
# the owner step's NS FLOPs of each piece under the default Muon settings (5 steps of 'you', 'auto')
NS_FLOPS = {(64, 64): 5242880.0, (32, 64): 851968.0, (320, 64): 11534336.0, (64, 160): 7602176.0,
            (4, 64): 7040.0, (192, 64): 8388608.0, (64, 96): 7208960.0}
FLOPS = CostSource(ns_cost=NS_FLOPS.__getitem__)


def _record(name, local, full=None, pieces=None, expert=False):
    full = full or local
    use_muon = pieces is not None
    return MatrixRecord(name=name, buffer="expert" if expert else "dense", expert=expert,
                        numel=local[0] * (local[1] if len(local) == 2 else 1), local_shape=local, full_shape=full,
                        use_muon=use_muon, reason="test", pieces=tuple(pieces or ()))


def gpt_buffers(dp=2, tp=1, experts=0, expert_dp=1):
    """The buffers build_plan hands the planning for the small GPT, in Megatron's buffer order."""
    def shard(rows, cols, dim):  # this TP rank's shard of a (rows, cols) matrix split along dim
        return (rows // tp, cols) if dim == 0 else (rows, cols // tp)

    dense = [_record("embedding.word_embeddings.weight", shard(256, 64, 0), (256, 64))]
    expert = []
    for i in range(3):
        layer = f"decoder.layers.{i}"
        dense += [_record(f"{layer}.input_layernorm.weight", (64,)),
                  _record(f"{layer}.self_attention.linear_proj.weight", shard(64, 64, 1), (64, 64), [(64, 64)]),
                  _record(f"{layer}.self_attention.linear_qkv.weight", shard(128, 64, 0), (128, 64),
                          [(64, 64), (32, 64), (32, 64)]),
                  _record(f"{layer}.pre_mlp_layernorm.weight", (64,))]
        if experts:
            dense.append(_record(f"{layer}.mlp.router.weight", (experts, 64), pieces=[(experts, 64)]))
            for e in range(2):
                local = f"{layer}.mlp.experts.local_experts.{e}"
                expert += [_record(f"{local}.linear_fc1.weight", (192, 64), pieces=[(192, 64)], expert=True),
                           _record(f"{local}.linear_fc2.weight", (64, 96), pieces=[(64, 96)], expert=True)]
        else:
            dense += [_record(f"{layer}.mlp.linear_fc1.weight", shard(320, 64, 0), (320, 64), [(320, 64)]),
                      _record(f"{layer}.mlp.linear_fc2.weight", shard(64, 160, 1), (64, 160), [(64, 160)])]
    dense += [_record("decoder.final_layernorm.weight", (64,)),
              _record("output_layer.weight", shard(256, 64, 0), (256, 64))]
    buffers = {DENSE: BufferParams(tuple(dense), dp, tp)}
    if expert:
        buffers[EXPERT] = BufferParams(tuple(expert), expert_dp, 1, expert=True)
    return buffers


def owners(planned, buffers, key=DENSE, tp=False):
    """The buffer's DP (or TP) owners as a string, one digit per matrix in buffer order."""
    layout = planned.layout(key)
    held = layout.tp_owners if tp else layout.owners
    return "".join(str(held.get(r.name, 0)) for r in buffers[key].records if r.use_muon)


def planned_records(planned, buffers):
    return [planned.costed(r) for b in buffers.values() for r in b.records]


def planned_ranks(planned):
    return OwnerLayout.from_json(next(iter(planned.layouts.values()))).world_size


def analytic_profile(counts, cells, budget_s):
    """The start-up profile off CUDA: the analytic rank model of the cluster config's first device."""
    return RankCostModel.analytic(device_spec_for("", warn=False), 5, "auto")


class RankZeroCosts:
    """A per-matrix cost model in ms that finds wide matrices dear (rank 0's of tests/planning/lb_workers.py)."""

    def per_matrix_ms(self, shape):
        r, c = shape
        return r * c * 1e-4 * (6.0 if r < c else 1.0)

    def launch_ms(self, shape):
        return 0.05


# ----------------------------------------------------------------------------- the plans build_plan made


@pytest.mark.parametrize("balance, bucket_size, expected, loads", [
    ("cost", None, "000110110101", [698140635.4285715, 718873417.1428572]),
    ("cost", 4000, "110100001111", [722904686.8571429, 694109365.7142859]),
    ("round_robin", None, "101010101010", [43646976.0, 50331648.0]),
])
def test_greedy_plans_are_build_plans(balance, bucket_size, expected, loads):
    buffers = gpt_buffers()
    planned = plan_owners(buffers, bucket_size, OwnerPlanningOptions(balance=balance), FLOPS)
    assert owners(planned, buffers) == expected
    layout = planned.layout(DENSE)
    assert layout.rank_cost == pytest.approx(loads, rel=1e-12)
    layout.validate([r.param_item() for r in planned_records(planned, buffers)])
    # the costs recorded in every rank's plan: NS FLOPs summed over the pieces (q, k, v)
    qkv = next(r for r in buffers[DENSE].records if r.name.endswith("0.self_attention.linear_qkv.weight"))
    assert planned.costs[qkv.name] == (NS_FLOPS[(64, 64)] + 2 * NS_FLOPS[(32, 64)], 0.0)
    assert planned.costed(qkv).cost == 6946816.0
    adamw = buffers[DENSE].records[0]
    assert adamw.name not in planned.costs and planned.costed(adamw) is adamw


def test_milp_plans_are_build_plans():
    buffers = gpt_buffers()
    planned = plan_owners(buffers, None, OwnerPlanningOptions(balance="milp", milp_options={"time_limit_s": 20.0}),
                          FLOPS)
    assert owners(planned, buffers) == "100001111101"
    assert [(b.start, b.end) for b in planned.layout(DENSE).buckets] == [(0, 164774)]


def test_the_start_up_profile_plans_on_the_rank_milp():
    buffers = gpt_buffers()
    calls = []

    def profile(counts, cells, budget_s):
        calls.append((dict(counts), cells, budget_s))
        return analytic_profile(counts, cells, budget_s)

    planned = plan_owners(buffers, None, OwnerPlanningOptions(balance="milp", plan_budget_s=20.0, profile=True),
                          dataclasses.replace(FLOPS, rank_profile=profile))
    assert owners(planned, buffers) == "001000100010"
    assert planned.layout(DENSE).rank_cost == pytest.approx([2.4762403926157015, 0.8563127858574002], rel=1e-12)
    # the shapes the owner step orthogonalizes, the fewest owner cells of a buffer, 2/3 of the budget
    assert calls == [({(64, 64): 6, (32, 64): 6, (320, 64): 3, (64, 160): 3}, 2, profile_budget(20.0))]
    # the rank model prices the plan; the matrices keep their NS FLOPs (the greedy warm start's costs)
    assert planned.costs["decoder.layers.0.mlp.linear_fc1.weight"] == (NS_FLOPS[(320, 64)], 0.0)


def test_a_per_matrix_cost_model_gives_ms_and_launch_costs():
    buffers = gpt_buffers()
    seen = []

    def cost_model_fn(shapes, max_batch):
        seen.append((shapes, max_batch))
        return RankZeroCosts()

    costs = dataclasses.replace(FLOPS, cost_model_fn=cost_model_fn, rank_profile=analytic_profile)
    greedy = plan_owners(buffers, None, OwnerPlanningOptions(), costs)
    # the cost model wins over the profile; it is asked for the sorted shapes and the largest batch (at most 8)
    assert seen == [([(32, 64), (64, 64), (64, 160), (320, 64)], 6)]
    assert owners(greedy, buffers) == "010011010110"
    assert greedy.layout(DENSE).rank_cost == pytest.approx([17.2032, 17.2032], rel=1e-12)
    assert greedy.costs["decoder.layers.1.self_attention.linear_qkv.weight"] == pytest.approx((2.8672, 0.1))
    assert greedy.costs["decoder.layers.1.mlp.linear_fc2.weight"] == pytest.approx((6.144, 0.05))
    milp = plan_owners(buffers, None, OwnerPlanningOptions(balance="milp", milp_options={"time_limit_s": 20.0}),
                       costs)
    assert owners(milp, buffers) == "011100010000"
    assert milp.layout(DENSE).rank_cost == pytest.approx([17.4532, 17.4032], rel=1e-12)


def test_tp_cells_own_matrices_of_the_dense_buffer():
    buffers = gpt_buffers(dp=1, tp=2)
    planned = plan_owners(buffers, None, OwnerPlanningOptions(), FLOPS)
    assert owners(planned, buffers) == "0" * 12
    assert owners(planned, buffers, tp=True) == "010110110100"
    assert planned.layout(DENSE).rank_cost == pytest.approx([713331004.9523809, 711102780.9523809], rel=1e-12)


def test_expert_and_dense_buffers_are_planned_on_their_own_cells():
    buffers = gpt_buffers(experts=4)
    planned = plan_owners(buffers, None, OwnerPlanningOptions(), FLOPS)
    assert owners(planned, buffers) == "100110100"
    assert owners(planned, buffers, EXPERT) == "0" * 12  # EP 2 on 2 ranks: one expert-DP cell
    assert planned.layout(DENSE).rank_cost == pytest.approx([428441256.76190484, 383702779.8095238], rel=1e-12)
    assert planned.layout(EXPERT).rank_cost == pytest.approx([756084150.8571429], rel=1e-12)
    # the rank profile on both: the budget split between the two buffers' MILPs
    profiled = plan_owners(buffers, None, OwnerPlanningOptions(balance="milp", plan_budget_s=20.0, profile=True),
                           dataclasses.replace(FLOPS, rank_profile=analytic_profile))
    assert owners(profiled, buffers) == "010010010"
    assert profiled.layout(EXPERT).rank_cost == pytest.approx([1.6213623137853281], rel=1e-12)
    # with two expert-DP cells, the expert buffer starts from its own empty cells, not the dense loads
    wide = gpt_buffers(experts=4, expert_dp=2)
    both = plan_owners(wide, None, OwnerPlanningOptions(), FLOPS)
    alone = plan_owners({EXPERT: wide[EXPERT]}, None, OwnerPlanningOptions(), FLOPS)
    assert both.layouts[EXPERT] == alone.layouts[EXPERT]
    assert sorted(set(both.layout(EXPERT).owners.values())) == [0, 1]


def test_elementwise_work_as_requested_or_from_the_cluster_config():
    buffers = gpt_buffers()
    none = plan_owners(buffers, None, OwnerPlanningOptions(elementwise=None), FLOPS)
    assert owners(none, buffers) == "010110110100"
    assert none.layout(DENSE).rank_cost == [48103424.0, 45875200.0]  # NS FLOPs alone
    fixed = plan_owners(buffers, None, OwnerPlanningOptions(elementwise=(3.0, 5.0)), FLOPS)
    assert fixed.layout(DENSE).rank_cost == [48481952.0, 46241440.0]
    # 'auto' off CUDA: the cluster config's first device, as plan_owner_layout's (AdamW, Muon) FLOPs
    auto = plan_owners(buffers, None, OwnerPlanningOptions(), FLOPS)
    assert auto.layout(DENSE).rank_cost[0] > 10 * none.layout(DENSE).rank_cost[0]


# ----------------------------------------------------------------------------- the plan cache and the budget


def test_the_plan_cache_misses_then_hits_and_replans_a_damaged_entry(tmp_path, monkeypatch):
    path = str(tmp_path / "plans.json")
    buffers = gpt_buffers()
    options = OwnerPlanningOptions(elementwise=(3.0, 5.0), plan_cache=path)
    runs = []
    plan = owner_planning.plan_owner_layout

    def counted(*args, **kwargs):
        runs.append(1)
        return plan(*args, **kwargs)

    monkeypatch.setattr(owner_planning, "plan_owner_layout", counted)
    # whole matrices only: the key build_plan wrote for this model before the move (cache files of older
    # runs still hit); where the split layout is a candidate (--dmuon-dp-layout auto, the default) the
    # key also holds the DP layout and the node size
    whole = plan_owners(buffers, None, dataclasses.replace(options, dp_layout="whole"), FLOPS)
    entries = json.load(open(path))["entries"]
    assert list(entries) == ["f4f2dc907590699f0f2d307a4bb6bf43e745820b46ab4a8d6c66d761af05f347"]
    path = str(tmp_path / "auto_plans.json")
    options = dataclasses.replace(options, plan_cache=path)
    runs.clear()
    first = plan_owners(buffers, None, options, FLOPS)
    assert first == whole and owners(first, buffers) == "010110110100" and len(runs) == 1
    entries = json.load(open(path))["entries"]
    assert len(entries) == 1 and "f4f2dc907590699f0f2d307a4bb6bf43e745820b46ab4a8d6c66d761af05f347" not in entries
    assert entries[next(iter(entries))] == {DENSE: first.layouts[DENSE]}
    assert plan_owners(buffers, None, options, FLOPS) == first and len(runs) == 1  # a hit plans nothing
    # another DP size is another key: planned, and both entries kept
    other = plan_owners(gpt_buffers(dp=4), None, options, FLOPS)
    assert planned_ranks(other) == 4 and len(runs) == 2 and len(json.load(open(path))["entries"]) == 2
    # an entry whose owners are no ranks of this DP size: a warning naming the file, planned again
    data = json.load(open(path))
    key = next(iter(entries))
    layout = json.loads(data["entries"][key][DENSE])
    layout["owners"] = {name: 7 for name in layout["owners"]}
    data["entries"][key][DENSE] = json.dumps(layout)
    json.dump(data, open(path, "w"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = plan_owners(buffers, None, options, FLOPS)
    messages = [str(w.message) for w in caught if "unusable" in str(w.message)]
    assert len(messages) == 1 and path in messages[0] and "is not a rank of 2" in messages[0]
    assert again == first and len(runs) == 3
    assert PlanCache(path).get(key) == {DENSE: first.layouts[DENSE]}  # the damaged entry replaced
    # an entry of other buffers under this key: the same
    data = json.load(open(path))
    data["entries"][key] = {EXPERT: data["entries"][key][DENSE]}
    json.dump(data, open(path, "w"))
    with pytest.warns(RuntimeWarning, match="unusable [(]other buffers[)]; planning again"):
        assert plan_owners(buffers, None, options, FLOPS) == first
    assert len(runs) == 4


def test_the_budget_bounds_the_profile_and_the_milps_together(monkeypatch):
    buffers = gpt_buffers(experts=4)
    limits = []
    plan = owner_planning.plan_rank_owner_layout

    def captured(*args, **kwargs):
        limits.append(kwargs["milp_options"])
        return plan(*args, **kwargs)

    monkeypatch.setattr(owner_planning, "plan_rank_owner_layout", captured)
    costs = dataclasses.replace(FLOPS, rank_profile=analytic_profile)
    plan_owners(buffers, None, OwnerPlanningOptions(balance="milp", plan_budget_s=20.0, profile=True), costs)
    # what profiling left of the 20 s, shared by the two buffers' MILPs
    assert [set(o) for o in limits] == [{"time_limit_s"}] * 2
    assert all(9.0 < o["time_limit_s"] <= 10.0 for o in limits)
    limits.clear()
    plan_owners(buffers, None, OwnerPlanningOptions(balance="milp", plan_budget_s=20.0, profile=True,
                                                    milp_options={"time_limit_s": 3.0, "backend": "cbc"}), costs)
    assert limits == [{"time_limit_s": 1.5, "backend": "cbc"}] * 2  # a requested limit holds, then shared
    limits.clear()
    plan_owners(buffers, None, OwnerPlanningOptions(balance="milp", profile=True), costs)
    assert limits == [{}] * 2  # no budget: the MILP's own defaults


def test_choose_scheme_keeps_whole_matrices_within_the_models_error_unless_they_break_the_bytes_goal():
    from types import SimpleNamespace

    from megatron_dmuon.planning.owner_planning import SPLIT_MIN_GAIN, WHOLE_PADDING_LIMIT, choose_scheme

    def pick(whole_numel, whole_load, split_load, split_numel=1000, collective=0.0):
        return choose_scheme({"whole": (SimpleNamespace(numel=whole_numel), [whole_load]),
                              "split": (SimpleNamespace(numel=split_numel), [split_load])}, collective)

    lean, padded = 1000 * (1 + WHOLE_PADDING_LIMIT / 2), 1000 * (1 + 2 * WHOLE_PADDING_LIMIT)
    within = 1 + SPLIT_MIN_GAIN / 2  # the split layout predicted this much slower: inside the model's error
    assert pick(lean, 100.0, 100.0 / within) == "whole"  # a little faster is not enough to exchange pieces
    assert pick(lean, 100.0, 100.0 * (1 - 2 * SPLIT_MIN_GAIN)) == "split"
    assert pick(padded, 100.0, 100.0 * within) == "split"  # past the bytes goal the margin turns round
    assert pick(padded, 100.0, 100.0 * (1 + 2 * SPLIT_MIN_GAIN)) == "whole"
    # the all-gather of the padded buffer counts in the prediction
    assert pick(padded, 100.0, 100.0 * (1 + 2 * SPLIT_MIN_GAIN), collective=1.0) == "split"
    assert choose_scheme({"whole": (SimpleNamespace(numel=padded), [1.0])}, 0.0) == "whole"
