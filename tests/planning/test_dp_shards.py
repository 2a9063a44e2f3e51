"""planning/dp_shards.py: the one DP-shard window arithmetic, and the planner code built on it."""
from megatron_dmuon.planning.dp_shards import shard_overlap, shard_range
from megatron_dmuon.planning.layout_stats import state_bytes_per_rank
from megatron_dmuon.planning.owner_layout import ParamItem, plan_owner_layout
from megatron_dmuon.planning.fp8_blocks import plan_publish


def test_shard_range_and_overlap():
    assert shard_range(0, 10) == (0, 10) and shard_range(2, 10, start=100) == (120, 130)
    assert shard_overlap(5, 25, 1, 10) == (10, 20)  # a param over the whole shard
    assert shard_overlap(12, 15, 1, 10) == (12, 15)  # inside it
    assert shard_overlap(0, 8, 1, 10) == (10, 10)  # before it: empty
    assert shard_overlap(25, 30, 1, 10) == (25, 25)  # after it: empty
    assert shard_overlap(95, 125, 1, 10, start=100) == (110, 120)


def test_every_element_of_a_layout_lies_in_exactly_one_shard():
    items = [ParamItem(f"m{i}", 64 * (i + 3), True, float(i + 1), "s") for i in range(5)]
    items += [ParamItem(f"v{i}", 37 + 11 * i, False) for i in range(4)]
    layout = plan_owner_layout(items, 3, bucket_size=600)
    for name, (s, e, b) in layout.param_ranges.items():
        bucket = layout.buckets[b]
        pieces = [shard_overlap(s, e, r, bucket.shard_size, bucket.start) for r in range(layout.world_size)]
        assert sum(hi - lo for lo, hi in pieces) == e - s
        if name in layout.owners:  # a matrix lies whole in its owner's shard
            lo, hi = pieces[layout.owners[name]]
            assert (lo, hi) == (s, e)
    state = state_bytes_per_rank(layout, param_bytes=2, momentum_bytes=4)
    assert sum(acc["masters"] for acc in state) == 4 * sum(it.numel for it in items)


def test_publish_blocks_cut_straddling_params_at_the_shard_edges():
    layout = plan_publish(40, 2, [(0, 8, True, "w"), (8, 30, False, "v"), (30, 38, False, "b")], 2)
    raw = [[(run.start, run.end) for run in runs if run.scale_slot < 0] for runs in layout.runs]
    assert raw == [[(8, 20)], [(20, 38)]]  # v cut at the edge 20; v and b merged into one run
