"""The split layout's exchange: a matrix cut by DP shard boundaries meets at its NS home.

Under the split scheme (planning/split_layout.py) Megatron's equal DP shards cut Muon matrices where
they fall; each rank holding a piece keeps that piece's master and momentum and computes its piece of
the Nesterov update (element-wise, as a whole matrix's). ``to_homes`` sends every piece to the
matrix's NS home, which assembles the whole (TP-local) update in its flattened order; after the NS
``from_homes`` sends each holder its piece of the direction. Messages are point to point and only
between ranks that share a matrix (one send per peer and direction, the pieces of several matrices
concatenated in name order), so the cost does not grow with the DP size. Every rank derives the same
pieces from the one plan, so message sizes are known on both sides without a handshake.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["SplitMatrix", "DPExchange"]


@dataclasses.dataclass(frozen=True)
class SplitMatrix:
    """One matrix of the split layout as the exchange sees it: ``pieces`` = ((DP rank, lo, hi), ...)
    of its flattened (TP-local) elements, in rank order; ``home`` the DP rank that runs its NS."""

    key: str
    home: int
    numel: int
    pieces: Tuple[Tuple[int, int, int], ...]

    def piece_of(self, rank: int) -> Optional[Tuple[int, int]]:
        return next(((lo, hi) for r, lo, hi in self.pieces if r == rank), None)


class DPExchange:
    """Moves update pieces to NS homes and direction pieces back over one DP group."""

    def __init__(self, group=None):
        self.group = group
        self.size = 1 if group is None else torch.distributed.get_world_size(group)
        self.rank = 0 if group is None else torch.distributed.get_rank(group)
        self.bytes_sent = 0  # of the last step (reset by the owner step)

    def _exchange(self, send: Dict[int, List[torch.Tensor]], recv_numel: Dict[int, int],
                  like: torch.Tensor) -> Dict[int, torch.Tensor]:
        """One message to each peer of ``send`` (its tensors concatenated) and one from each peer of
        ``recv_numel``; returns the received flat tensors by peer."""
        received = {peer: like.new_empty(n) for peer, n in recv_numel.items() if n}
        ops = []
        for peer, flat in received.items():
            ops.append(torch.distributed.P2POp(torch.distributed.irecv, flat, group=self.group, group_peer=peer))
        for peer, parts in send.items():
            if not parts:
                continue
            flat = torch.cat([t.reshape(-1) for t in parts]).to(like.dtype)
            self.bytes_sent += flat.numel() * flat.element_size()
            ops.append(torch.distributed.P2POp(torch.distributed.isend, flat, group=self.group, group_peer=peer))
        if ops:
            for request in torch.distributed.batch_isend_irecv(ops):
                request.wait()
        return received

    def to_homes(self, mats: Sequence[SplitMatrix], local: Dict[str, torch.Tensor],
                 like: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The whole flattened update of every matrix of ``mats`` homed on this rank (``local``:
        this rank's piece of every matrix it holds a piece of, flattened)."""
        mats = sorted(mats, key=lambda m: m.key)
        send: Dict[int, List[torch.Tensor]] = {}
        recv: Dict[int, int] = {}
        for m in mats:
            mine = m.piece_of(self.rank)
            if m.home != self.rank:
                if mine is not None:
                    send.setdefault(m.home, []).append(local[m.key])
                continue
            for r, lo, hi in m.pieces:
                if r != self.rank:
                    recv[r] = recv.get(r, 0) + hi - lo
        received = self._exchange(send, recv, like)
        cursor = {peer: 0 for peer in received}
        out = {}
        for m in mats:
            if m.home != self.rank:
                continue
            full = like.new_empty(m.numel)
            for r, lo, hi in m.pieces:
                if r == self.rank:
                    full[lo:hi] = local[m.key].reshape(-1)
                else:
                    full[lo:hi] = received[r][cursor[r]:cursor[r] + hi - lo]
                    cursor[r] += hi - lo
            out[m.key] = full
        return out

    def from_homes(self, mats: Sequence[SplitMatrix], full: Dict[str, torch.Tensor],
                   like: torch.Tensor) -> Dict[str, torch.Tensor]:
        """This rank's piece of every matrix of ``mats`` it holds a piece of (``full``: the whole
        flattened direction of every matrix homed here)."""
        mats = sorted(mats, key=lambda m: m.key)
        send: Dict[int, List[torch.Tensor]] = {}
        recv: Dict[int, int] = {}
        for m in mats:
            mine = m.piece_of(self.rank)
            if m.home == self.rank:
                for r, lo, hi in m.pieces:
                    if r != self.rank:
                        send.setdefault(r, []).append(full[m.key].reshape(-1)[lo:hi])
            elif mine is not None:
                recv[m.home] = recv.get(m.home, 0) + mine[1] - mine[0]
        received = self._exchange(send, recv, like)
        cursor = {peer: 0 for peer in received}
        out = {}
        for m in mats:
            mine = m.piece_of(self.rank)
            if mine is None:
                continue
            lo, hi = mine
            if m.home == self.rank:
                out[m.key] = full[m.key].reshape(-1)[lo:hi]
            else:
                out[m.key] = received[m.home][cursor[m.home]:cursor[m.home] + hi - lo]
                cursor[m.home] += hi - lo
        return out
