"""Two-level (intra-node, then inter-node) reduce-to-owner and publish for DMuon buckets.

Flat reduce-scatter over D = N nodes x L ranks sends every byte across the slow inter-node
links once per ring step. Two levels instead: reduce-scatter inside the node (fast links) so
local rank l holds node-summed chunk l (1/L of the bucket), then reduce-scatter chunk l across
the N ranks with the same local rank l. Publish is the mirror image (inter-node all-gather of
the sub-chunk, then intra-node all-gather). Inter-node traffic per rank drops by L.

The two-level result leaves shard index s = l*N + k on the rank with node k and local rank l:
shard order is local-major, so consecutive shards (and so the matrices the owner-aligned planner
puts in them) alternate between nodes — concurrent owners sit on different nodes (the node
striping). `DMuonDistributedOptimizer` reads `buffer.dmuon_shard_index` to find its shard.
The bucket-group glue that runs the two stages on Megatron's buffers is in
`megatron_dmuon/megatron/hierarchy.py`.
"""
from __future__ import annotations

import dataclasses
from typing import List

import torch

from ..planning.dp_shards import shard_range


@dataclasses.dataclass
class NodeTopology:
    ranks_per_node: int  # L
    num_nodes: int  # N
    node: int  # k of this rank
    local_rank: int  # l of this rank
    intra_group: object
    inter_group: object

    @property
    def shard_index(self) -> int:
        return self.local_rank * self.num_nodes + self.node

    def shard_owner_dp_rank(self, shard: int) -> int:
        """DP rank (node-major numbering k*L + l) that ends up holding reduce-scatter shard `shard`."""
        l, k = divmod(shard, self.num_nodes)
        return k * self.ranks_per_node + l


def build_node_topology(dp_group, ranks_per_node: int) -> NodeTopology:
    """Create the intra-node and inter-node sub-groups of `dp_group` (collective over all ranks).

    DP ranks are numbered node-major (k*L + l), as torchrun/Slurm place them.
    """
    world = dp_group.size()
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(
            f"ranks_per_node {ranks_per_node} must divide the data-parallel size {world}"
        )
    n_nodes = world // ranks_per_node
    members: List[int] = torch.distributed.get_process_group_ranks(dp_group)
    me = dp_group.rank()
    intra = inter = None
    for k in range(n_nodes):  # every rank creates every group, in the same order
        g = torch.distributed.new_group([members[k * ranks_per_node + l] for l in range(ranks_per_node)])
        if me // ranks_per_node == k:
            intra = g
    for l in range(ranks_per_node):
        g = torch.distributed.new_group([members[k * ranks_per_node + l] for k in range(n_nodes)])
        if me % ranks_per_node == l:
            inter = g
    return NodeTopology(ranks_per_node, n_nodes, me // ranks_per_node, me % ranks_per_node, intra, inter)


def chunk_views(bucket_data: torch.Tensor, topo: NodeTopology):
    """(this rank's intra-node chunk, its sub-chunk) of a bucket: chunk l is what the intra-node
    reduce-scatter leaves on local rank l, sub-chunk k of it what the inter-node stage leaves
    on node k."""
    n = bucket_data.numel()
    chunk = n // topo.ranks_per_node
    sub = chunk // topo.num_nodes
    c = bucket_data[slice(*shard_range(topo.local_rank, chunk))]
    return c, c[slice(*shard_range(topo.node, sub))]
