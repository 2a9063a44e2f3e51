"""Byte layout of one bucket's FP8 publish (pure data, the same on every rank).

Megatron's param all-gather sends each rank's shard of a bucket in the model's dtype. With
an FP8 publish dtype (``DMuonConfig.publish_dtype`` fp8_*) every rank instead sends one packed byte block per bucket:

    [ float32 scale_inv of each FP8 matrix in its shard | raw model-dtype bytes | FP8 bytes ]

FP8 matrices (Muon matrices, whole inside their owner's shard by the owner-aligned layout) go as
1 byte per element; everything else the shard holds (AdamW params or their pieces) goes as raw
bytes of the model's dtype; padding between params is not sent. Blocks are padded to the largest
rank's block (all_gather_into_tensor needs equal sizes), so the bytes a rank receives are
``D x block_bytes``.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

from .dp_shards import shard_overlap, shard_range


@dataclasses.dataclass(frozen=True)
class Run:
    """``[start, end)`` elements of the bucket, packed at byte ``offset`` of its rank's block;
    ``scale_slot`` >= 0 for an FP8 matrix (its scale_inv at byte 4·slot), -1 for raw bytes."""

    start: int
    end: int
    offset: int
    scale_slot: int = -1
    key: object = None  # the matrix (an FP8 run) this range is; None for raw runs


@dataclasses.dataclass
class PublishLayout:
    block_bytes: int                 # bytes each rank sends (padded to the largest rank's need)
    runs: List[List[Run]]            # per rank
    fp8_elements: int                # elements sent as FP8 (all ranks)
    raw_elements: int                # elements sent in the model's dtype (all ranks)
    scales: int                      # float32 scales (all ranks)

    @property
    def recv_bytes(self) -> int:
        return self.block_bytes * len(self.runs)


def _merge(ranges: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def plan_publish(bucket_numel: int, world: int, params: Sequence[Tuple[int, int, bool, object]],
                 raw_element_bytes: int) -> PublishLayout:
    """``params``: (start, end, is_fp8, key) of every param in the bucket (bucket coordinates).
    Raises if an FP8 matrix crosses a shard boundary (the owner-aligned layout never does)."""
    if bucket_numel % world:
        raise ValueError(f"bucket of {bucket_numel} elements does not split over {world} ranks")
    shard = bucket_numel // world
    runs, sizes = [], []
    fp8_total = raw_total = scale_total = 0
    for r in range(world):
        lo, hi = shard_range(r, shard)
        fp8 = sorted((s, e, k) for s, e, is_fp8, k in params if is_fp8 and s < hi and e > lo)
        for s, e, k in fp8:
            if s < lo or e > hi:
                raise ValueError(f"FP8-published matrix {k} [{s}, {e}) crosses the shard [{lo}, {hi}) of rank {r}: "
                                 "its owner would not hold it whole")
        raw = _merge([shard_overlap(s, e, r, shard) for s, e, is_fp8, _ in params if not is_fp8 and s < hi and e > lo])
        offset = 4 * len(fp8)
        rank_runs = []
        for s, e in raw:
            rank_runs.append(Run(s, e, offset))
            offset += (e - s) * raw_element_bytes
        for slot, (s, e, k) in enumerate(fp8):
            rank_runs.append(Run(s, e, offset, slot, k))
            offset += e - s
        runs.append(rank_runs)
        sizes.append(offset)
        fp8_total += sum(e - s for s, e, _ in fp8)
        raw_total += sum(e - s for s, e in raw)
        scale_total += len(fp8)
    block = max(sizes) if sizes else 0
    block += -block % 4  # the next rank's scales start 4-byte aligned
    return PublishLayout(block, runs, fp8_total, raw_total, scale_total)
