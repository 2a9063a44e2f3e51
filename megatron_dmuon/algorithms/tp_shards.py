"""Tensor-parallel shards of a matrix and the full matrix they come from (pure reshapes).

Megatron cuts a TP-parallel weight along ``partition_dim`` (0: column-parallel, rows split;
1: row-parallel, columns split) into ``t`` shards. With ``partition_stride = s`` the matrix is
first cut into ``s·t`` equal chunks along that dim and shard ``i`` holds chunks
``i, i+t, ..., i+(s−1)t`` (``_initialize_affine_weight_cpu``; a GLU fc1 has s = 2, so shard
``i`` is ``[gate_i; up_i]``). ``merge_tp_shards`` rebuilds the canonical full matrix (the one a
TP=1 model holds) and ``split_tp_shards`` is its exact inverse, so an owner can orthogonalize
the same matrix a single-GPU run would, whatever the TP size.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["merge_tp_shards", "split_tp_shards", "tp_full_shape"]


def _check(partition_dim: int, stride: int, tp_size: int) -> None:
    if partition_dim not in (0, 1):
        raise ValueError(f"partition_dim must be 0 or 1 for a matrix, got {partition_dim!r}")
    if stride < 1 or tp_size < 1:
        raise ValueError(f"partition_stride and tp_size must be >= 1, got {stride}, {tp_size}")


def tp_full_shape(local_shape: Sequence[int], partition_dim: int, tp_size: int) -> tuple[int, int]:
    """Shape of the full matrix whose TP shards have ``local_shape``."""
    rows, cols = int(local_shape[0]), int(local_shape[1])
    return (rows * tp_size, cols) if partition_dim == 0 else (rows, cols * tp_size)


def merge_tp_shards(shards: Sequence[Tensor], partition_dim: int, stride: int = 1) -> Tensor:
    """The canonical full matrix from its ``len(shards)`` TP shards (rank order)."""
    t = len(shards)
    _check(partition_dim, stride, t)
    if t == 1:
        return shards[0]
    if stride == 1:
        return torch.cat(list(shards), dim=partition_dim)
    chunks = [shard.chunk(stride, dim=partition_dim) for shard in shards]
    # chunk k of the full matrix is sub-chunk k // t of shard k % t
    return torch.cat([chunks[k % t][k // t] for k in range(stride * t)], dim=partition_dim)


def split_tp_shards(full: Tensor, tp_size: int, partition_dim: int, stride: int = 1) -> list[Tensor]:
    """Inverse of ``merge_tp_shards``: shard ``i`` of ``full`` for every TP rank ``i``."""
    _check(partition_dim, stride, tp_size)
    if full.size(partition_dim) % (stride * tp_size):
        raise ValueError(
            f"dim {partition_dim} of a {tuple(full.shape)} matrix does not split into "
            f"{stride}x{tp_size} equal chunks"
        )
    if tp_size == 1:
        return [full]
    chunks = full.chunk(stride * tp_size, dim=partition_dim)
    return [torch.cat([chunks[s * tp_size + i] for s in range(stride)], dim=partition_dim)
            if stride > 1 else chunks[i] for i in range(tp_size)]
