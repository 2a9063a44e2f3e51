"""How a DDP buffer is cut into buckets: Megatron's bucket size, and the owner-aligned layout's
bucket boundaries (``split_buckets``)."""
from __future__ import annotations

import heapq
import math
from typing import List, Optional, Sequence


def megatron_bucket_size(dp_size: int, overlap_grad_reduce: bool, bucket_size: Optional[int] = None,
                         pp_rank: int = 0, disable_bucketing: bool = False) -> Optional[int]:
    """The bucket size Megatron's DDP uses (None: one bucket per buffer)."""
    if disable_bucketing or pp_rank > 0 or not overlap_grad_reduce:
        return None
    if bucket_size is not None:
        return bucket_size
    return max(40_000_000, 1_000_000 * dp_size)


def split_buckets(items: Sequence, bucket_size: Optional[int], world_size: int,
                   max_padding: float) -> List[List[int]]:
    """Group param indices (in reverse order, i.e. backprop order, as Megatron does) into buckets.

    A bucket closes once it reaches `bucket_size` *and* its matrices can be spread over the DP
    ranks with at most `max_padding` extra elements; so buckets grow with D instead of padding.
    """
    order = list(range(len(items)))[::-1]
    buckets: List[List[int]] = []
    cur: List[int] = []

    def balanced(idx: List[int]) -> bool:
        total = sum(items[i].numel for i in idx)
        mats = sorted((items[i].numel for i in idx if items[i].is_matrix), reverse=True)
        # largest first onto the least-loaded rank, the lowest rank on ties (placement.least_loaded_cell's
        # rule when every rank has room), kept in a heap: this runs for every param past bucket_size
        loads = [(0, d) for d in range(min(world_size, len(mats)))]
        for m in mats:
            load, d = loads[0]
            heapq.heapreplace(loads, (load + m, d))
        shard = max(math.ceil(total / world_size), max(load for load, _ in loads) if mats else 0)
        return shard * world_size <= total * (1.0 + max_padding)

    for i in order:
        if items[i].own_bucket and cur:
            buckets.append(cur)
            cur = []
        cur.append(i)
        size = sum(items[j].numel for j in cur)
        if items[i].own_bucket or (bucket_size is not None and size >= bucket_size and balanced(cur)):
            buckets.append(cur)
            cur = []
    if cur:
        buckets.append(cur)
    return buckets
