"""Two-level grad reduce / param publish on Megatron's own bucket groups (`--dmuon-ranks-per-node`).

Megatron's `_ParamAndGradBucketGroup.start_grad_sync` reduce-scatters each bucket over its
`intra_distributed_optimizer_instance_group`. Pointing that group at the ranks of one node makes
Megatron's own code (CUDA-graph waits, extra main grads, NaN checks, scaling, averaging,
coalescing) run the intra-node stage; the subclass below only adds the inter-node
reduce-scatter of the chunk that stage leaves behind. Param publish is the mirror image: the
inter-node all-gather of the sub-chunk first, then Megatron's own intra-node all-gather.
Features whose semantics would change across two stages are refused at start-up
(`check_two_level_config`).
"""
from __future__ import annotations

import contextlib

import torch

from ..runtime.node_groups import NodeTopology, chunk_views
from .bucket_groups import extend_bucket_groups


def check_two_level_config(ddp_config, dp_size: int, ranks_per_node: int) -> None:
    """Start-up checks of --dmuon-ranks-per-node; each error names the flag and the fix."""
    if ranks_per_node < 0:
        raise ValueError(f"--dmuon-ranks-per-node must be >= 0, got {ranks_per_node}")
    if not ranks_per_node:
        return
    if dp_size % ranks_per_node:
        raise ValueError(f"--dmuon-ranks-per-node {ranks_per_node} must divide the data-parallel size {dp_size}")
    if not ddp_config.use_distributed_optimizer:
        raise ValueError("--dmuon-ranks-per-node needs --use-distributed-optimizer")
    if ddp_config.num_distributed_optimizer_instances != 1:
        raise ValueError("--dmuon-ranks-per-node needs --num-distributed-optimizer-instances 1")
    if getattr(ddp_config, "reduce_scatter_with_fp32_accumulation", False):
        raise ValueError(
            "--dmuon-ranks-per-node cannot keep fp32 accumulation across two reduce-scatter stages: "
            "drop --reduce-scatter-with-fp32-accumulation (use --grad-reduce-in-fp32) or --dmuon-ranks-per-node"
        )


def make_two_level(ddp, topo: NodeTopology) -> None:
    """Turn every (distributed-optimizer) bucket group of a DMuon DDP into a two-level one, and
    tell each buffer which reduce-scatter shard this rank receives (node-striped owners)."""

    def state_of(bucket_group):
        bucket_group.intra_distributed_optimizer_instance_group = topo.intra_group
        bucket_group.intra_distributed_optimizer_instance_size = topo.ranks_per_node
        bucket_group.intra_distributed_optimizer_instance_rank = topo.local_rank
        bucket_group.cached_grad_buffer_shard_list = [None] * len(bucket_group.buckets)
        bucket_group.cached_param_buffer_shard_list = [None] * len(bucket_group.buckets)
        return topo

    extend_bucket_groups(ddp, _TwoLevelBucketGroup, state_of)
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        # read by DMuonDistributedOptimizer._build_model_gbuf_range, a classmethod Megatron calls
        # with the buffer alone (the one attribute DMuon sets on a Megatron buffer)
        buffer.dmuon_shard_index = topo.shard_index


class HandleGroup:
    """One handle for several async collectives (Megatron waits on one ``*_handle``): waits for
    each; used for a two-stage collective's second stage and for FP8 publish's per-bucket gathers."""

    def __init__(self, handles):
        self.handles = [h for h in handles if h is not None]

    def wait(self):
        for h in self.handles:
            h.wait()


class _TwoLevelBucketGroup:
    state_name = "two_level"
    two_level: NodeTopology

    def _two_level_stream(self):
        """The second stage waits for the first on a side stream, so neither the CPU nor the
        compute stream blocks (overlap)."""
        if not (torch.cuda.is_available() and self.buckets[0].grad_data.is_cuda):
            return contextlib.nullcontext()
        stream = getattr(self, "_two_level_side_stream", None)
        if stream is None:
            stream = self._two_level_side_stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    def start_grad_sync(self, force_all_reduce=False):
        if force_all_reduce:
            raise RuntimeError("--dmuon-ranks-per-node: a forced all-reduce of DMuon buckets is not supported")
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        super().start_grad_sync()  # Megatron's intra-node reduce-scatter (chunk l on local rank l)
        topo = self.two_level
        op = (torch.distributed.ReduceOp.AVG if self.ddp_config.average_in_collective
              else torch.distributed.ReduceOp.SUM)
        async_op = self.ddp_config.overlap_grad_reduce
        first = self.grad_reduce_handle
        with self._two_level_stream() if async_op else contextlib.nullcontext():
            if first is not None:
                first.wait()
            second = []
            for bucket in self.buckets:
                chunk, sub = chunk_views(bucket.grad_data, topo)
                second.append(torch.distributed.reduce_scatter_tensor(
                    sub, chunk, op=op, group=topo.inter_group, async_op=async_op))
        self.grad_reduce_handle = HandleGroup(second) if async_op else None

    def start_param_sync(self, force_sync: bool = False):
        if force_sync and self.param_gather_handle is not None:
            return super().start_param_sync(force_sync=True)  # waits for the pending publish
        topo = self.two_level
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        with self._two_level_stream() if async_op else contextlib.nullcontext():
            first = []
            for bucket in self.buckets:  # inter-node stage: sub-chunks -> this rank's chunk
                chunk, sub = chunk_views(bucket.param_data, topo)
                first.append(torch.distributed.all_gather_into_tensor(
                    chunk, sub, group=topo.inter_group, async_op=async_op))
            HandleGroup(first).wait()
            super().start_param_sync(force_sync=force_sync)  # Megatron's intra-node all-gather
