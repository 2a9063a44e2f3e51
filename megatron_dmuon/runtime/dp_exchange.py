"""The split layout's exchange: a matrix cut by DP shard boundaries meets at its NS home.

Under the split scheme (planning/split_layout.py) Megatron's equal DP shards cut Muon matrices where
they fall; each rank holding a piece keeps that piece's master and momentum and computes its piece of
the Nesterov update (element-wise, as a whole matrix's). ``to_homes`` sends every piece to the
matrix's NS home, which assembles the whole (TP-local) update in its flattened order; after the NS
``from_homes`` sends each holder its piece of the direction back. Messages are point to point and only
between ranks that share a matrix (one message per peer and round, the pieces of several matrices
concatenated in a fixed order), so the cost does not grow with the DP size. Every rank derives the same
transfers from the one plan, so message sizes are known on both sides without a handshake.

Across nodes a home would receive every piece of a large matrix through its own network link (the
fc1 of Qwen2.5-7B is 543 MB of fp32 from up to 136 ranks at DP 1024). With ``ranks_per_node`` (torchrun's
LOCAL_WORLD_SIZE), a piece bound for another node goes first to the rank of that node with the sender's
local index (a rail-aligned hop: the node's links share the load), which forwards it to the home over
the node's own links; directions come back the same way. Only the route changes: the bytes each home
assembles are the same, so the result is bit-identical (tests/planning/test_split_layout.py).

A matrix whose NS a team of homes shares (planning/split_layout.py: one home per block of its long
side) travels the same way, each holder sending every home its part of that home's block (a contiguous
run of the block's row-major order, ``block_span``; a strided one of its own piece where the blocks are
columns). The homes then run distributed Gram NS together (runtime/team_ns.py).

Directions can come back as 16-bit bits (``narrow``): where the NS returns its 16-bit compute dtype,
a direction is those outputs widened (and, for QKV / head / GLU pieces, each scaled by its piece's lr
multiplier), so the outputs' bits and a small tag saying how to read them carry the whole value in half
the bytes (runtime/owner_step.py encodes and decodes them). The pieces of the updates go to their homes
in the masters' dtype: the CUDA NS normalises in fp32 before its cast, so a narrower update would
change the result.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import torch

from ..planning.split_layout import NARROW_TAG_BYTES, Routes, block_numel, block_span, block_transfers

__all__ = ["SplitMatrix", "DPExchange", "node_of_dp_ranks", "take_block", "put_block"]

_TAG_BYTES = NARROW_TAG_BYTES  # the tag: so that every part of a message starts 8-byte aligned (views of it)


@dataclasses.dataclass(frozen=True)
class SplitMatrix:
    """One matrix of the split layout as the exchange sees it: ``pieces`` = ((DP rank, lo, hi), ...)
    of its flattened (TP-local) elements, in rank order; ``home`` the DP rank that runs its NS. A
    matrix whose NS a team shares: ``shape`` (rows, cols) and ``blocks`` ((home, first, end), ...) of
    its long side (OwnerLayout.homes), ``home`` the first."""

    key: str
    home: int
    numel: int
    pieces: Tuple[Tuple[int, int, int], ...]
    shape: Tuple[int, ...] = ()
    blocks: Tuple[Tuple[int, int, int], ...] = ()

    def piece_of(self, rank: int) -> Optional[Tuple[int, int]]:
        return next(((lo, hi) for r, lo, hi in self.pieces if r == rank), None)

    @property
    def team(self) -> bool:
        return bool(self.blocks)

    def homes(self) -> Tuple[Tuple[int, ...], Tuple[Tuple[int, int, int], ...]]:
        """(shape, blocks) as ``block_span`` reads them: a one-home matrix is one block of a [numel, 1] column."""
        return (tuple(self.shape), self.blocks) if self.blocks else ((self.numel, 1), ((self.home, 0, self.numel),))

    def block_of(self, home: int) -> Tuple[int, int]:
        return next((first, end) for h, first, end in self.homes()[1] if h == home)


Transfer = Tuple[str, int, int, int, int]  # (matrix key, source DP rank, destination DP rank, lo, hi)


def node_of_dp_ranks(group, ranks_per_node: Optional[int] = None) -> List[int]:
    """The node of each DP rank of ``group``: its global rank // the ranks per node (torchrun's
    LOCAL_WORLD_SIZE when not given; one node when neither is known)."""
    if group is None:
        return [0]
    if ranks_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        ranks_per_node = int(local) if local.isdigit() and int(local) > 0 else None
    members = torch.distributed.get_process_group_ranks(group)
    return [g // ranks_per_node if ranks_per_node else 0 for g in members]


class DPExchange:
    """Moves update pieces to NS homes and direction pieces back over one DP group."""

    def __init__(self, group=None, nodes: Optional[Sequence[int]] = None):
        self.group = group
        self.size = 1 if group is None else torch.distributed.get_world_size(group)
        self.rank = 0 if group is None else torch.distributed.get_rank(group)
        self.bytes_sent = 0  # of the last step (reset by the owner step)
        # the node of every DP rank (None: derived at the first exchange, node_of_dp_ranks)
        self._nodes = list(nodes) if nodes is not None else None
        self._plans: Dict[tuple, list] = {}
        self._transfer_lists: Dict[tuple, list] = {}
        self._routes: Optional[Routes] = None
        self._tags: Dict[str, tuple] = {}  # each narrow direction's tag, as its home sent it

    # ------------------------------------------------------------------------------- routing
    @property
    def nodes(self) -> List[int]:
        if self._nodes is None:
            self._nodes = node_of_dp_ranks(self.group) if self.size > 1 else [0]
        return self._nodes

    def _rounds(self, transfers: Sequence[Transfer]):
        """The hops of ``transfers`` in rounds (planning/split_layout.Routes: the rule the planner's
        model of the exchange uses too)."""
        if self._routes is None:
            self._routes = Routes(self.nodes)
        return self._routes.rounds(transfers)

    def _plan(self, key: tuple, transfers: Sequence[Transfer]):
        """This rank's part of every round (sends and receives by peer, in a fixed order), once per
        set of transfers: [([(peer, [transfer])] sent, [(peer, [transfer])] received)] per round."""
        plan = self._plans.get(key)
        if plan is None:
            plan = []
            for hops in self._rounds(sorted(transfers)):
                sends: Dict[int, list] = {}
                recvs: Dict[int, list] = {}
                for t, src, dst in hops:
                    if src == self.rank:
                        sends.setdefault(dst, []).append(t)
                    if dst == self.rank:
                        recvs.setdefault(src, []).append(t)
                plan.append((sorted(sends.items()), sorted(recvs.items())))
            self._plans[key] = plan
        return plan

    def _move(self, key: tuple, transfers: Sequence[Transfer], encode, wire_bytes, device) -> Dict[Transfer, torch.Tensor]:
        """Carry out ``transfers``, each as bytes: ``encode(transfer)`` gives this rank's data of a
        transfer it starts (uint8 parts, ``wire_bytes(transfer)`` in all: both ends know every size from
        the plan). Returns the bytes of every transfer ending on this rank (forwarded ones pass as they came)."""
        held: Dict[Transfer, torch.Tensor] = {}  # arrived here (for this rank, or to forward)
        for sends, recvs in self._plan(key, transfers):
            ops, arriving = [], []
            for peer, ts in recvs:
                flat = torch.empty(sum(wire_bytes(t) for t in ts), dtype=torch.uint8, device=device)
                arriving.append((flat, ts))
                ops.append(torch.distributed.P2POp(torch.distributed.irecv, flat, group=self.group, group_peer=peer))
            for peer, ts in sends:
                flat = torch.cat([part for t in ts for part in ([held.pop(t)] if t in held else encode(t))])  # one copy
                self.bytes_sent += flat.numel()
                ops.append(torch.distributed.P2POp(torch.distributed.isend, flat, group=self.group, group_peer=peer))
            if ops:
                for request in torch.distributed.batch_isend_irecv(ops):
                    request.wait()
            for flat, ts in arriving:
                for t, part in zip(ts, flat.split([wire_bytes(t) for t in ts])):
                    held[t] = part
        return held

    # ------------------------------------------------------------------------------ exchange
    def _transfers(self, mats: Sequence[SplitMatrix]):
        """(matrix key, holder, home, a, b) of every part of a piece bound for another home, [a, b) in
        the home's block order (planning/split_layout.to_home_transfers: the same list); once per set of
        matrices (the plan's: fixed for the run)."""
        key = tuple(sorted(m.key for m in mats))
        cached = self._transfer_lists.get(key)
        if cached is None:
            cached = [t for m in mats for t in block_transfers(m.key, *m.homes(), m.pieces)]
            self._transfer_lists[key] = cached
        return cached

    def to_homes(self, mats: Sequence[SplitMatrix], local: Dict[str, torch.Tensor],
                 like: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The flattened update of every matrix of ``mats`` homed on this rank: the whole, or this
        home's team block in the block's row-major order (``local``: this rank's piece of every matrix
        it holds a piece of, flattened). ``mats``: every split matrix of the optimizer (a rank may
        forward pieces of matrices it neither holds nor homes)."""
        by_key = {m.key: m for m in mats}
        size = like.element_size()

        def mine(key, home):  # this rank's part of ``home``'s block of ``key``, contiguous
            m = by_key[key]
            lo, hi = m.piece_of(self.rank)
            return take_block(local[key].reshape(-1).to(like.dtype), lo, hi, *m.homes()[0], *m.block_of(home))

        arrived = self._move(("to", tuple(sorted(by_key))), self._transfers(mats), lambda t: _bytes_of(mine(t[0], t[2])),
                             lambda t: _aligned((t[4] - t[3]) * size), like.device)
        out = {}
        for m in mats:
            shape, blocks = m.homes()
            for home, first, end in blocks:
                if home != self.rank:
                    continue
                full = like.new_empty(block_numel(shape, first, end))
                for r, lo, hi in m.pieces:
                    a, b = block_span(shape, first, end, lo, hi)
                    if a < b:
                        full[a:b] = (mine(m.key, home) if r == self.rank else
                                     arrived[(m.key, r, home, a, b)][:(b - a) * size].view(like.dtype))
                out[m.key] = full
        return out

    def from_homes(self, mats: Sequence[SplitMatrix], full: Dict[str, object], like: torch.Tensor,
                   narrow: Collection[str] = ()) -> Dict[str, object]:
        """This rank's piece of every matrix of ``mats`` it holds a piece of (``full``: the whole
        flattened direction of every matrix homed here; ``mats`` as for ``to_homes``). ``narrow``: the
        matrices whose direction travels as 16-bit bits (the same list on every rank): for those homed
        here ``full`` holds (bits, tag), the whole flattened direction's bits (int16) and a tuple of up
        to NARROW_TAG_BYTES small ints that says how to read them (runtime/owner_step.py: each NS
        piece's format); for those this rank holds a piece of, the result is (its bits, the tag)."""
        by_key = {m.key: m for m in mats}
        transfers = [(key, home, r, a, b) for key, r, home, a, b in self._transfers(mats)]
        narrow, size = set(narrow), like.element_size()
        if any(by_key[k].team for k in narrow if k in by_key):
            raise ValueError("DMuon: a team-shared matrix's direction comes back in the masters' dtype, not as 16-bit bits")

        def wire_bytes(t):
            return _aligned(2 * (t[4] - t[3])) + _TAG_BYTES if t[0] in narrow else _aligned((t[4] - t[3]) * size)

        tags = {k: torch.tensor(list(full[k][1]) + [0] * (_TAG_BYTES - len(full[k][1])), dtype=torch.uint8).to(
            full[k][0].device, non_blocking=True) for k in narrow if k in full}  # (one per homed matrix, not per piece)

        def encode(t):
            if t[0] not in narrow:
                return _bytes_of(full[t[0]].reshape(-1)[t[3]:t[4]].to(like.dtype))
            return _bytes_of(full[t[0]][0].reshape(-1)[t[3]:t[4]]) + [tags[t[0]]]

        arrived = self._move(("from", tuple(sorted(by_key))), transfers, encode, wire_bytes, like.device)
        mine = {m.key: (m, m.piece_of(self.rank)) for m in mats if m.piece_of(self.rank) is not None}
        unread = [k for k, (m, _) in mine.items() if k in narrow and m.home != self.rank and k not in self._tags]
        if unread:  # what a home's tag says is fixed for the run (its plan's NS choices): read once
            tags = torch.stack([arrived[(k, mine[k][0].home, self.rank, *mine[k][1])][-_TAG_BYTES:] for k in unread])
            self._tags.update(zip(unread, map(tuple, tags.tolist())))
        out = {}
        for key, (m, (lo, hi)) in mine.items():
            if key in narrow:
                if m.home == self.rank:
                    out[key] = (full[key][0].reshape(-1)[lo:hi], tuple(full[key][1]))
                else:
                    out[key] = (arrived[(key, m.home, self.rank, lo, hi)][:2 * (hi - lo)].view(torch.int16), self._tags[key])
                continue
            shape, blocks = m.homes()
            parts = []  # (block, this piece's part of the block's direction)
            for home, first, end in blocks:
                a, b = block_span(shape, first, end, lo, hi)
                if a < b:
                    parts.append(((first, end), full[key].reshape(-1)[a:b] if home == self.rank else
                                  arrived[(key, home, self.rank, a, b)][:(b - a) * size].view(like.dtype)))
            if not m.team:  # (one block: the piece itself)
                out[key] = parts[0][1]
                continue
            piece = like.new_empty(hi - lo)
            for block, part in parts:
                put_block(piece, lo, hi, *shape, *block, part)
            out[key] = piece
        return out


def _block_views(flat: torch.Tensor, lo: int, hi: int, rows: int, cols: int, first: int, end: int) -> List[torch.Tensor]:
    """Views into ``flat`` (a piece: the flattened elements ``[lo, hi)`` of a rows x cols matrix) of the
    elements in the long-side block ``[first, end)``, in the block's row-major order: one run of a
    row block; for a column block, a partial first row, the whole rows between (one strided view), a
    partial last row."""
    if rows >= cols:
        s, e = min(max(lo, first * cols), end * cols), min(max(hi, first * cols), end * cols)
        return [flat[s - lo:e - lo]] if s < e else []
    views, x = [], lo
    if x % cols:
        row = x // cols
        row_end = min(hi, (row + 1) * cols)
        s, e = max(x, row * cols + first), min(row_end, row * cols + end)
        if s < e:
            views.append(flat[s - lo:e - lo])
        x = row_end
    whole_end = hi // cols * cols
    if whole_end > x:
        views.append(flat[x - lo:whole_end - lo].view((whole_end - x) // cols, cols)[:, first:end])
        x = whole_end
    if x < hi and x + first < min(hi, x + end):
        views.append(flat[x + first - lo:min(hi, x + end) - lo])
    return views


def take_block(flat: torch.Tensor, lo: int, hi: int, rows: int, cols: int, first: int, end: int) -> torch.Tensor:
    """The elements of piece ``flat`` (flattened ``[lo, hi)``) in block ``[first, end)``, contiguous."""
    views = _block_views(flat, lo, hi, rows, cols, first, end)
    if len(views) == 1 and views[0].is_contiguous():
        return views[0].reshape(-1)
    return torch.cat([v.reshape(-1) for v in views]) if views else flat.new_empty(0)


def put_block(flat: torch.Tensor, lo: int, hi: int, rows: int, cols: int, first: int, end: int,
              values: torch.Tensor) -> None:
    """Write ``values`` (``take_block``'s order) into piece ``flat`` where block ``[first, end)`` lies."""
    offset = 0
    for view in _block_views(flat, lo, hi, rows, cols, first, end):
        view.copy_(values[offset:offset + view.numel()].view(view.shape))
        offset += view.numel()


def _aligned(nbytes: int) -> int:
    """Every part of a message starts 8-byte aligned, so each can be viewed in its own dtype."""
    return -(-nbytes // 8) * 8


def _bytes_of(t: torch.Tensor) -> List[torch.Tensor]:
    """``t``'s bytes and the padding to ``_aligned``: the parts of one transfer (a message concatenates them)."""
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    pad = _aligned(raw.numel()) - raw.numel()
    return [raw, raw.new_zeros(pad)] if pad else [raw]
