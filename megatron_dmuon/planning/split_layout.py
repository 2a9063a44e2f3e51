"""Past the matrix count: Megatron's own equal shards, and one NS home per matrix.

The whole-matrix layout (owner_layout.py) lays every Muon matrix inside one rank's shard. Megatron
gives every DP rank an equal shard of each bucket, so once the DP size nears the number of matrices
every shard grows to the largest matrix: at DP 256 a Qwen2.5-7B buffer is 4.6x the model and most
ranks own nothing. The split scheme keeps Megatron's DistributedOptimizer layout as it is (the same
order, alignment and bucket padding as ``DistributedOptimizer.compute_full_param_layout``, so the
reduce-scatter and the param all-gather move exactly AdamW's bytes) and lets shard boundaries cut
matrices. Every rank keeps the fp32 master and the momentum of the pieces in its shard (element-wise,
as AdamW keeps its moments); each matrix gets one **NS home**, a DP x TP cell that receives the
pieces of its Nesterov update, runs the NS once, and sends each piece holder its part of the
direction back (runtime/dp_exchange.py). The update is the same Muon update: momentum and apply are
element-wise, the NS input is the whole matrix.

Homes are chosen heaviest matrix first: the cell whose load after taking the matrix is least,
where a cell's load is its NS cost so far plus, for a matrix it does not hold whole, the moving of
the pieces it lacks (``move_cost`` per element, in the same units as the NS cost). A holder of the
biggest piece wins ties, so a matrix stays where most of it is unless that rank is busy.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .owner_layout import PARAM_ALIGN, BucketLayout, OwnerLayout, ParamItem, align_up, check_plan_inputs

__all__ = ["megatron_buckets", "plan_split_layout", "bucket_end_divisor", "exchange_bytes", "exchange_bytes_sent"]


def bucket_end_divisor(world_size: int) -> int:
    """Megatron pads each bucket's end to a multiple of lcm(DP, 128) (param_layout.bucket_end_divisor)."""
    import math

    return math.lcm(world_size, 128)


def megatron_buckets(items: Sequence[ParamItem], bucket_size: Optional[int],
                     world_size: int) -> Tuple[Dict[str, Tuple[int, int, int]], List[BucketLayout]]:
    """Megatron DistributedOptimizer's own layout of one buffer (``_compute_per_buffer_param_layout``):
    params in reverse (backprop) order, starts aligned to 64 elements, a bucket closed once it holds
    ``bucket_size`` elements or before and after a param of its own (the shared embedding), its end
    padded to lcm(DP, 128). Returns ({name: (start, end, bucket)}, buckets)."""
    ranges: Dict[str, Tuple[int, int, int]] = {}
    buckets: List[BucketLayout] = []
    divisor = bucket_end_divisor(world_size)
    bucket_start = cursor = 0
    held = 0  # params in the open bucket
    end = 0

    def close(param_end: int) -> int:
        padded = -(-param_end // divisor) * divisor
        buckets.append(BucketLayout(start=bucket_start, end=padded, numel_unpadded=param_end - bucket_start,
                                    shard_size=(padded - bucket_start) // world_size))
        return padded

    for it in reversed(items):
        cursor = align_up(cursor, PARAM_ALIGN)
        if it.own_bucket and held:
            bucket_start = close(cursor)
            cursor, held = bucket_start, 0
        end = cursor + it.numel
        ranges[it.name] = (cursor, end, len(buckets))
        held += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or it.own_bucket:
            bucket_start = close(end)
            cursor, held = bucket_start, 0
        else:
            cursor = end
    if held:
        close(end)
    return ranges, buckets


def _pieces(ranges, buckets, world_size, name) -> List[Tuple[int, int]]:
    """[(DP rank, elements of ``name`` in its shard)] of the ranks holding part of it."""
    layout = OwnerLayout(world_size, ranges, {}, buckets, [], scheme="split")
    return [(r, hi - lo) for r, lo, hi in layout.pieces(name)]


def plan_split_layout(items: Sequence[ParamItem], world_size: int, bucket_size: Optional[int] = None,
                      rank_cost: Optional[List[float]] = None, tp_size: int = 1,
                      elementwise: Optional[Tuple[float, float]] = None, move_cost: float = 0.0) -> OwnerLayout:
    """The split-scheme layout of one buffer: Megatron's own buckets and shards, and each matrix's
    NS home (``OwnerLayout.owners`` / ``tp_owners``, scheme 'split').

    ``rank_cost`` (one entry per DP x TP cell) carries the loads of buffers planned before and
    receives this one's; ``elementwise = (adamw, muon)``: the element-wise work per element of each
    optimizer, charged to every cell of the DP row whose shard holds the element (as the run steps
    it); ``move_cost``: the cost of moving one matrix element to its home and its direction back, in
    the NS cost's units (planning/cost_model.py: ``exchange_cost_per_element``)."""
    rank_cost = check_plan_inputs(items, world_size, tp_size, rank_cost, "cost", elementwise)
    ranges, buckets = megatron_buckets(items, bucket_size, world_size)
    if elementwise:
        adamw, muon = elementwise
        for it in items:
            for r, n in _pieces(ranges, buckets, world_size, it.name):
                for c in range(r * tp_size, (r + 1) * tp_size):
                    rank_cost[c] += (muon if it.is_matrix else adamw) * n
    owners: Dict[str, int] = {}
    tp_owners: Dict[str, int] = {}
    for it in sorted((it for it in items if it.is_matrix), key=lambda it: (-it.cost, -it.numel, it.name)):
        held = dict(_pieces(ranges, buckets, world_size, it.name))

        def load_after(cell: int) -> float:
            return rank_cost[cell] + it.cost + move_cost * (it.numel - held.get(cell // tp_size, 0))

        cell = min(range(world_size * tp_size), key=lambda c: (load_after(c), -held.get(c // tp_size, 0), c))
        rank_cost[cell] = load_after(cell)
        owners[it.name], tp_owners[it.name] = divmod(cell, tp_size)
    layout = OwnerLayout(world_size, ranges, owners, buckets, list(rank_cost), tp_size, tp_owners, scheme="split")
    layout.validate(items)
    return layout


def exchange_bytes(layout: OwnerLayout, bytes_each_way: int = 4) -> Tuple[List[float], List[float]]:
    """(sent, received): bytes each DP rank sends and receives per step in the split layout's exchange
    (runtime/dp_exchange.py): a holder sends its pieces of the updates of matrices homed elsewhere and
    receives their directions' pieces back; a home receives the other pieces of its matrices' updates
    and sends their directions' pieces back (``bytes_each_way`` per element: the masters' fp32).
    Zeros for a whole-matrix layout."""
    sent = [0.0] * layout.world_size
    received = [0.0] * layout.world_size
    if layout.scheme != "split":
        return sent, received
    for name, home in layout.owners.items():
        for r, lo, hi in layout.pieces(name):
            if r != home:
                moved = (hi - lo) * bytes_each_way
                sent[r] += moved  # the update's piece to the home ...
                received[home] += moved
                sent[home] += moved  # ... and the direction's piece back
                received[r] += moved
    return sent, received


def exchange_bytes_sent(layout: OwnerLayout, bytes_each_way: int = 4) -> List[float]:
    """The bytes each DP rank sends per step in the split layout's exchange (``exchange_bytes``)."""
    return exchange_bytes(layout, bytes_each_way)[0]
