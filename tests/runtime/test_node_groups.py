"""Node topology arithmetic of the two-level reduce/publish (pure, no process groups)."""
import pytest

from megatron_dmuon.runtime.node_groups import NodeTopology


@pytest.mark.parametrize("L,N", [(2, 2), (4, 2), (8, 4), (1, 3), (3, 1)])
def test_shards_map_one_to_one_and_stripe_nodes(L, N):
    topos = [NodeTopology(L, N, node=r // L, local_rank=r % L, intra_group=None, inter_group=None)
             for r in range(L * N)]
    shards = [t.shard_index for t in topos]
    assert sorted(shards) == list(range(L * N))
    for r, t in enumerate(topos):
        assert t.shard_owner_dp_rank(t.shard_index) == r
    if N > 1:  # consecutive shards belong to different nodes
        node_of_shard = {t.shard_index: t.node for t in topos}
        assert all(node_of_shard[s] != node_of_shard[s + 1] for s in range(L * N - 1) if (s + 1) % N)
