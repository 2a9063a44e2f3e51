"""Tensor parallelism for the owner step: shards of a Muon update go to the matrix's TP owner,
the owner's orthogonalized direction comes back as shards (two all-to-alls per step).

Under TP every Muon matrix is split over the t ranks of a TP group (same DP index, so after
the DP reduce-scatter each TP rank holds its shard of the reduced gradient). Momentum is
element-wise, so every rank keeps it for its own shard. Newton–Schulz is not: the TP owner
merges the shards into the canonical full matrix (``algorithms.tp_shards``), orthogonalizes it
once, and returns each rank its shard of the direction. A matrix replicated on every TP rank
(``partition_dim=None``, e.g. a router) is orthogonalized by its owner alone and the full
direction is sent to the others. All ranks of the group see the same matrix list (one plan),
so message sizes are known everywhere without a handshake.

The alternative for matrices sharded along their long dim is distributed Gram NS
(``gram_orthogonalize``): every rank keeps its shard, the m x m Gram matrix is reduced to the
matrix's TP owner once per restart segment, the owner runs the Gram-space iteration alone and
broadcasts Q, and each rank multiplies its own shard (planning/tp_cost.py chooses per shape).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from ..algorithms.gram_newton_schulz import gram_newton_schulz_sharded, gram_space_polynomial
from ..algorithms.tp_shards import merge_tp_shards, split_tp_shards
from ..kernels.ns_driver import sharded_gram_ops

__all__ = ["TPMatrix", "TPExchange"]


@dataclasses.dataclass(frozen=True)
class TPMatrix:
    key: str
    owner: int  # TP rank that runs NS on the full matrix
    local_numel: int
    partition_dim: Optional[int]  # 0 / 1: sharded along that dim; None: replicated on every TP rank
    stride: int = 1

    @property
    def sharded(self) -> bool:
        return self.partition_dim is not None


class TPExchange:
    """Moves update shards to owners and direction shards back over one TP group."""

    def __init__(self, group=None):
        self.group = group
        self.size = 1 if group is None else torch.distributed.get_world_size(group)
        self.rank = 0 if group is None else torch.distributed.get_rank(group)
        self.bytes_sent = 0  # of the last step, all TP traffic (reset by the owner step)

    def owned(self, mats: Sequence[TPMatrix]) -> List[TPMatrix]:
        return [m for m in mats if m.owner == self.rank]

    def _all_to_all(self, send: List[List[torch.Tensor]], recv_numel: List[int], like: torch.Tensor) -> List[torch.Tensor]:
        in_splits = [sum(t.numel() for t in parts) for parts in send]
        flat = [t.reshape(-1) for parts in send for t in parts]
        inp = torch.cat(flat) if flat else like.new_empty(0)
        out = like.new_empty(sum(recv_numel))
        torch.distributed.all_to_all_single(out, inp, recv_numel, in_splits, group=self.group)
        self.bytes_sent += inp.numel() * inp.element_size()
        return list(out.split(recv_numel))

    def to_owners(self, mats: Sequence[TPMatrix], local: Dict[str, torch.Tensor],
                  full_shapes: Dict[str, Sequence[int]], like: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """Full canonical update of every matrix this rank owns (``local``: this rank's shard
        of every sharded matrix, and of every replicated matrix it owns)."""
        self.bytes_sent = 0
        mine = self.owned(mats)
        if self.size == 1 or not mats:
            return {m.key: local[m.key].reshape(full_shapes[m.key]) for m in mine}
        like = like if like is not None else next(iter(local.values()))  # dtype/device of the messages
        send = [[local[m.key] for m in mats if m.sharded and m.owner == dst and dst != self.rank]
                for dst in range(self.size)]
        per_source = sum(m.local_numel for m in mine if m.sharded)
        recv_numel = [0 if src == self.rank else per_source for src in range(self.size)]
        received = self._all_to_all(send, recv_numel, like)
        shards_from = [None if src == self.rank else received[src].split([m.local_numel for m in mine if m.sharded])
                       for src in range(self.size)]
        full, i = {}, 0
        for m in mine:
            if not m.sharded:
                full[m.key] = local[m.key].reshape(full_shapes[m.key])
                continue
            local_shape = local[m.key].shape
            shards = [local[m.key] if src == self.rank else shards_from[src][i].view(local_shape)
                      for src in range(self.size)]
            full[m.key] = merge_tp_shards(shards, m.partition_dim, m.stride)
            i += 1
        return full

    def from_owners(self, mats: Sequence[TPMatrix], directions: Dict[str, torch.Tensor],
                    local_shapes: Dict[str, Sequence[int]], like: torch.Tensor) -> Dict[str, torch.Tensor]:
        """This rank's shard of every matrix's direction (``directions``: full directions of the
        matrices this rank owns)."""
        mine = self.owned(mats)
        if self.size == 1 or not mats:
            return {m.key: directions[m.key] for m in mine}
        pieces = {m.key: (split_tp_shards(directions[m.key], self.size, m.partition_dim, m.stride)
                          if m.sharded else None) for m in mine}

        def part_for(m, dst):
            return pieces[m.key][dst] if m.sharded else directions[m.key]

        send = [[] if dst == self.rank else [part_for(m, dst) for m in mine] for dst in range(self.size)]

        def numel_from(m):
            return m.local_numel if m.sharded else int(torch.Size(local_shapes[m.key]).numel())

        others = [[m for m in mats if m.owner == src] for src in range(self.size)]
        recv_numel = [0 if src == self.rank else sum(numel_from(m) for m in others[src]) for src in range(self.size)]
        received = self._all_to_all(send, recv_numel, like)
        out = {m.key: part_for(m, self.rank) for m in mine}
        for src in range(self.size):
            if src == self.rank or not others[src]:
                continue
            for m, flat in zip(others[src], received[src].split([numel_from(m) for m in others[src]])):
                out[m.key] = flat.view(local_shapes[m.key])
        return out

    def gram_orthogonalize(self, local: torch.Tensor, owner: int, **gram_kwargs) -> torch.Tensor:
        """Distributed Gram NS of a stack of matrices whose column blocks (wide orientation) are
        spread over the TP group; ``owner`` runs the m x m iteration. Returns this rank's block."""
        group = self.group
        owner_global = torch.distributed.get_global_rank(group, owner)

        def sum_over_shards(t, op=torch.distributed.ReduceOp.SUM):
            torch.distributed.all_reduce(t, op=op, group=group)
            self.bytes_sent += t.numel() * t.element_size()
            return t

        def max_over_shards(t):
            return sum_over_shards(t, torch.distributed.ReduceOp.MAX)

        # the symmetric kernels where they run for this stack (the same choice on every TP rank: one
        # shape, one autotune cache), else torch's products
        ops = sharded_gram_ops(local if local.dim() == 3 else local.unsqueeze(0),
                               gram_kwargs.get("compute_dtype", torch.float16))
        gram, segment_q = ops if ops is not None else (None, gram_space_polynomial)

        def gram_to_q(partial, segment, normalise):
            partial = partial.contiguous()
            torch.distributed.reduce(partial, dst=owner_global, group=group)
            q = segment_q(partial, segment, normalise).contiguous() if self.rank == owner else torch.empty_like(partial)
            torch.distributed.broadcast(q, src=owner_global, group=group)
            nbytes = partial.numel() * partial.element_size()
            self.bytes_sent += nbytes * ((self.size - 1) if self.rank == owner else 1)
            return q

        return gram_newton_schulz_sharded(local, sum_over_shards, gram_to_q, max_over_shards=max_over_shards,
                                          gram=gram, **gram_kwargs)
