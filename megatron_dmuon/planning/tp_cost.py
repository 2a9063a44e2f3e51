"""How a TP-sharded Muon matrix is orthogonalized: gathered to its TP owner, or distributed Gram NS
across the TP group (each rank keeps its shard; only Gram matrices and a norm travel).

Distributed Gram applies when the shards are column blocks of the wide orientation (the matrix is
sharded along its long dim: column-parallel tall or row-parallel wide matrices), the matrix is not
split into pieces, and Gram NS runs for it at all (``ns_method`` gram/auto, aspect >= 2, as in
``gram_newton_schulz``). The choice per shape minimises a simple time model per rank:
FLOPs / peak + bytes / link bandwidth; with the compute equal either way it comes down to bytes:
distributed Gram wins when n/m > segments x t / 2 (e.g. Qwen2.5-7B's fc2, n/m = 5.3, up to
TP=5 with one restart). Both ways give the same matrix in exact arithmetic.
"""
from __future__ import annotations

from typing import Literal, get_args

from ..algorithms.flops import newton_schulz_flops
from ..algorithms.gram_newton_schulz import GRAM_MIN_ASPECT_RATIO, gram_applies

__all__ = ["TP_METHODS", "distributed_gram_eligible", "tp_method_costs", "choose_tp_method"]

TPMethod = Literal["auto", "gather", "distributed_gram"]
TP_METHODS: tuple = get_args(TPMethod)
PEAK_FLOPS = 4.0e14  # sustained half-precision GEMM rate of an H100/H200-class GPU
LINK_BYTES_PER_S = 1.0e11  # effective intra-node (NVLink) bandwidth per GPU for these collectives


def distributed_gram_eligible(shape, partition_dim, split, ns_method: str,
                              min_aspect_ratio: float = GRAM_MIN_ASPECT_RATIO) -> bool:
    rows, cols = int(shape[0]), int(shape[1])
    if partition_dim is None or split is not None or ns_method not in ("gram", "auto"):
        return False
    long_dim = 0 if rows >= cols else 1
    return partition_dim == long_dim and gram_applies(rows, cols, min_aspect_ratio)


def tp_method_costs(shape, tp_size: int, steps: int = 5, restarts: int = 1, master_bytes: int = 4,
                    gram_bytes: int = 2) -> dict:
    """Predicted seconds per TP rank for one matrix, amortized over a layer's worth of matrices
    (owners spread evenly over the TP group). Compute is the same either way (gather: the owner
    runs all of it, 1/t of the matrices; distributed Gram: every rank runs its 1/t of the m x n
    products, owners the m x m iteration of 1/t of the matrices); the bytes differ: gather moves
    each shard to the owner and its direction back (fp32 masters), distributed Gram reduces R and
    broadcasts Q (m x m, compute dtype) once per segment."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    t, segments = tp_size, restarts + 1
    compute = newton_schulz_flops(m, n, steps, method="gram", restarts=restarts, min_aspect_ratio=1.0) / t / PEAK_FLOPS
    gather_bytes = 2 * (t - 1) * m * n * master_bytes / (t * t)
    gram_bytes_per_rank = segments * 2 * (t - 1) / t * m * m * gram_bytes
    return {"gather": compute + gather_bytes / LINK_BYTES_PER_S,
            "distributed_gram": compute + gram_bytes_per_rank / LINK_BYTES_PER_S}


def choose_tp_method(shape, tp_size: int, partition_dim, split, ns_method: str, setting: str = "auto",
                     steps: int = 5) -> str:
    """'gather' or 'distributed_gram' for one matrix (``setting`` forces a way where it applies)."""
    if setting not in TP_METHODS:
        raise ValueError(f"TP method {setting!r} unknown; valid: {', '.join(TP_METHODS)}")
    if tp_size <= 1 or not distributed_gram_eligible(shape, partition_dim, split, ns_method):
        return "gather"
    if setting != "auto":
        return setting
    costs = tp_method_costs(shape, tp_size, steps)
    return min(costs, key=costs.get)
