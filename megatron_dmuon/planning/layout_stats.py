"""What a layout leaves on each DP rank (pure data): the element-wise params' pieces inside its shards
and the optimizer state it keeps, for the planners' reports, the simulation and the rank MILP."""
from __future__ import annotations

from typing import Dict, List

from .dp_shards import shard_overlap
from .owner_layout import OwnerLayout

__all__ = ["fragments_by_rank", "state_bytes_per_rank"]


def fragments_by_rank(layout: OwnerLayout, params) -> List[List[int]]:
    """Per DP rank, in param order, the sizes of the element-wise (AdamW) params' pieces inside
    its shards of the buckets (a param straddling a shard boundary counts by its overlap). Each
    param visits only the shards it touches."""
    out: List[List[int]] = [[] for _ in range(layout.world_size)]
    for p in params:
        if p.is_matrix:
            continue
        s, e, b = layout.param_ranges[p.name]
        bucket = layout.buckets[b]
        first = max(0, (s - bucket.start) // bucket.shard_size)
        last = min(layout.world_size - 1, (e - 1 - bucket.start) // bucket.shard_size)
        for r in range(first, last + 1):
            lo, hi = shard_overlap(s, e, r, bucket.shard_size, bucket.start)
            if hi > lo:
                out[r].append(hi - lo)
    return out


def state_bytes_per_rank(layout: OwnerLayout, param_bytes: int = 2, momentum_bytes: int = 4) -> List[Dict[str, int]]:
    """Optimizer state each DP rank of one buffer keeps under this plan, in bytes: ``masters``
    (an fp32 copy of every element of its shard when the model is narrower than fp32: a
    ``param_bytes=4`` param is its own master), ``momentum`` (Muon matrices it owns, whole) and
    ``adamw`` (two fp32 moments of its slice of every other param; step counters not counted).
    The same rule as megatron/memory.optimizer_state_bytes, which counts the live tensors."""
    master = 4 if param_bytes < 4 else 0
    out = [{"masters": 0, "momentum": 0, "adamw": 0} for _ in range(layout.world_size)]
    for name, (start, end, bucket_id) in layout.param_ranges.items():
        bucket = layout.buckets[bucket_id]
        for rank, acc in enumerate(out):
            lo, hi = shard_overlap(start, end, rank, bucket.shard_size, bucket.start)
            if hi <= lo:
                continue
            acc["masters"] += master * (hi - lo)
            if name in layout.owners:
                acc["momentum"] += momentum_bytes * (hi - lo)
            else:
                acc["adamw"] += 8 * (hi - lo)
    for acc in out:
        acc["total"] = acc["masters"] + acc["momentum"] + acc["adamw"]
    return out
