"""Where a DP rank's reduce-scatter shard of a bucket lies, and what of a parameter falls in it.

Megatron reduce-scatters a bucket of ``D x shard_size`` elements in D equal shards, shard r (DP
rank r, or the two-level rank holding shard index r) being ``[start + r*shard_size, start +
(r+1)*shard_size)``. These two functions are that arithmetic, for the planner, the layout checks,
the FP8 publish blocks, the simulation and the optimizer's own ranges.
"""
from __future__ import annotations

from typing import Tuple

__all__ = ["shard_range", "shard_overlap"]


def shard_range(rank: int, shard_size: int, start: int = 0) -> Tuple[int, int]:
    """``[lo, hi)`` of shard ``rank`` of a bucket that starts at buffer offset ``start``."""
    lo = start + rank * shard_size
    return lo, lo + shard_size


def shard_overlap(begin: int, end: int, rank: int, shard_size: int, start: int = 0) -> Tuple[int, int]:
    """The part ``[lo, hi)`` of the range ``[begin, end)`` (a parameter's place in the buffer)
    inside shard ``rank``; ``lo == hi`` when they do not meet."""
    lo, hi = shard_range(rank, shard_size, start)
    lo, hi = max(begin, lo), min(end, hi)
    return lo, max(lo, hi)
