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
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import List

import torch


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
            f"--dmuon-ranks-per-node {ranks_per_node} must divide the data-parallel size {world}"
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


def _side_stream_context(bucket_group):
    if not torch.cuda.is_available() or not bucket_group.buckets[0].grad_data.is_cuda:
        return contextlib.nullcontext()
    stream = getattr(bucket_group, "_dmuon_stream", None)
    if stream is None:
        stream = bucket_group._dmuon_stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(stream)


def _two_level(bucket_group, tensors_of, first, second, async_op):
    """Run `first` over all buckets, then `second` (which consumes first's output).

    With async_op the second stage is issued from a side stream that waits on the first, so
    neither the CPU nor the compute stream blocks."""
    h1 = [first(b, *tensors_of(b), async_op) for b in bucket_group.buckets]
    if not async_op:
        for b in bucket_group.buckets:
            second(b, *tensors_of(b), False)
        return None
    with _side_stream_context(bucket_group):
        for h in h1:
            if h is not None:
                h.wait()
        h2 = [second(b, *tensors_of(b), True) for b in bucket_group.buckets]
    return _MultiHandle(h2)


class _MultiHandle:
    """Waits on every second-stage handle of a two-level collective."""

    def __init__(self, handles):
        self.handles = handles

    def wait(self):
        for h in self.handles:
            if h is not None:
                h.wait()


def _views(bucket_data, topo: NodeTopology):
    n = bucket_data.numel()
    chunk = n // topo.ranks_per_node
    sub = chunk // topo.num_nodes
    c = bucket_data[topo.local_rank * chunk:(topo.local_rank + 1) * chunk]
    return c, c[topo.node * sub:(topo.node + 1) * sub]


def make_hierarchical(bucket_group, topo: NodeTopology) -> None:
    """Turn one of DDP's bucket groups (distributed-optimizer mode) into a two-level one."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    if not bucket_group.ddp_config.use_distributed_optimizer:
        raise ValueError("hierarchical DMuon groups need the distributed optimizer")
    if bucket_group.ddp_config.num_distributed_optimizer_instances != 1:
        raise ValueError("hierarchical DMuon groups need --num-distributed-optimizer-instances 1")
    base = type(bucket_group)
    if issubclass(base, _HierarchicalMixin):
        return
    bucket_group.__class__ = type("Hierarchical" + base.__name__, (_HierarchicalMixin, base), {})
    bucket_group.dmuon_topology = topo


class _HierarchicalMixin:
    dmuon_topology: NodeTopology

    def start_grad_sync(self, force_all_reduce=False):
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        prev = self.previous_grad_reduce_bucket_group
        if prev is not None and prev.grad_reduce_handle is not None:
            prev.finish_grad_sync(force_all_reduce=force_all_reduce)
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                             check_for_large=self.ddp_config.check_for_large_grads)
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
        if self.ddp_config.average_in_collective:
            raise ValueError("hierarchical DMuon reduce does not support --ddp-average-in-collective yet")
        op = torch.distributed.ReduceOp.SUM
        topo = self.dmuon_topology

        def intra(b, chunk, sub, async_op):
            return torch.distributed.reduce_scatter_tensor(chunk, b.grad_data, op=op, group=topo.intra_group, async_op=async_op)

        def inter(b, chunk, sub, async_op):
            return torch.distributed.reduce_scatter_tensor(sub, chunk, op=op, group=topo.inter_group, async_op=async_op)

        self.grad_reduce_handle = _two_level(self, lambda b: _views(b.grad_data, topo), intra, inter,
                                             self.ddp_config.overlap_grad_reduce)

    def start_param_sync(self, force_sync: bool = False):
        if force_sync:
            if self.param_gather_handle is not None:
                self.param_gather_handle.wait()
                self.param_gather_handle = None
                self._post_param_sync()
                return
        else:
            assert self.param_gather_handle is None
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        topo = self.dmuon_topology

        def inter(b, chunk, sub, async_op):
            return torch.distributed.all_gather_into_tensor(chunk, sub, group=topo.inter_group, async_op=async_op)

        def intra(b, chunk, sub, async_op):
            return torch.distributed.all_gather_into_tensor(b.param_data, chunk, group=topo.intra_group, async_op=async_op)

        self.param_gather_handle = _two_level(self, lambda b: _views(b.param_data, topo), inter, intra, async_op)
        if force_sync and self.ddp_config.overlap_param_gather:
            self._post_param_sync()
        self.param_gather_dispatched = True
