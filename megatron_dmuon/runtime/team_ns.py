"""A matrix whose NS a team of homes shares (planning/split_layout.py; the layout option ns_teams): each home
holds a block of the matrix's long side, a column block of its wide orientation; they run distributed Gram
NS together (the TP path's ``gram_newton_schulz_sharded``), the m x m Gram matrices of their blocks (and
the norm) summed over the team (``TeamReduce``), the m x m iteration on every home alike."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from ..algorithms.gram_newton_schulz import gram_newton_schulz_sharded, gram_space_polynomial
from ..algorithms.muon import muon_direction
from ..kernels.ns_driver import sharded_gram_ops

__all__ = ["TeamReduce", "team_orthogonalize", "team_directions"]


class TeamReduce:
    """Sums (or maxes) a tensor over the homes of one team (``members``: DP ranks in block order), point
    to point over the DP group: a ring all-reduce (each home sends and receives 2 (k-1)/k of the tensor,
    what the planner costs: split_layout.team_reduce_elements), or for a tensor of fewer elements than
    homes every home's whole tensor to every other, summed in member order. Every home ends with the
    same bits: each chunk is reduced once, in a fixed order, and copied to the others."""

    def __init__(self, exchange, members: Sequence[int]):
        self.exchange = exchange
        self.members = list(members)
        self.index = self.members.index(exchange.rank)

    def _swap(self, send: Optional[torch.Tensor], to: int, recv: Optional[torch.Tensor], frm: int) -> None:
        ex = self.exchange
        ops = []
        if recv is not None:
            ops.append(torch.distributed.P2POp(torch.distributed.irecv, recv, group=ex.group, group_peer=frm))
        if send is not None:
            ops.append(torch.distributed.P2POp(torch.distributed.isend, send, group=ex.group, group_peer=to))
            ex.bytes_sent += send.numel() * send.element_size()
        for request in torch.distributed.batch_isend_irecv(ops):
            request.wait()

    def __call__(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        k, i = len(self.members), self.index
        combine = torch.add if op == "sum" else torch.maximum
        flat = t.contiguous().reshape(-1).clone()
        if k == 1:
            return flat.view(t.shape)
        if flat.numel() < k:
            whole = [flat if j == i else torch.empty_like(flat) for j in range(k)]
            for step in range(1, k):  # every home's tensor to every other, one peer pair per round
                to, frm = self.members[(i + step) % k], self.members[(i - step) % k]
                self._swap(flat, to, whole[(i - step) % k], frm)
            out = whole[0]
            for other in whole[1:]:
                out = combine(out, other)
            return out.view(t.shape)
        chunks = list(flat.tensor_split(k))
        nxt, prev = self.members[(i + 1) % k], self.members[(i - 1) % k]
        for step in range(k - 1):  # reduce-scatter: home i ends with chunk (i + 1) % k summed
            c_send, c_recv = (i - step) % k, (i - step - 1) % k
            incoming = torch.empty_like(chunks[c_recv])
            self._swap(chunks[c_send], nxt, incoming, prev)
            chunks[c_recv].copy_(combine(incoming, chunks[c_recv]))
        for step in range(k - 1):  # all-gather of the summed chunks
            c_send, c_recv = (i + 1 - step) % k, (i - step) % k
            self._swap(chunks[c_send], nxt, chunks[c_recv], prev)
        return flat.view(t.shape)


def team_orthogonalize(local: torch.Tensor, reduce, choice) -> torch.Tensor:
    """This home's column block of a team-shared matrix's NS (``local``: its block of the wide
    orientation, [m, n_block]): distributed Gram NS (``choice``: the Gram NSChoice of the whole matrix),
    the Gram matrices and the norm summed by ``reduce`` (``TeamReduce``; an identity gives one home's
    compute alone, as bench/rank_balance.py times it), the m x m iteration on every home, on the symmetric
    kernels where they run for this block (as the TP path's distributed Gram)."""
    ops = sharded_gram_ops(local.unsqueeze(0), choice.compute_dtype)
    gram, segment_q = ops if ops is not None else (None, gram_space_polynomial)

    def gram_to_q(partial, segment, normalise):
        return segment_q(reduce(partial), segment, normalise)

    return gram_newton_schulz_sharded(local, reduce, gram_to_q, max_over_shards=lambda t: reduce(t, "max"), gram=gram,
                                      **dict(choice.schedule, compute_dtype=choice.compute_dtype))


def team_directions(step, infos, blocks, like) -> Dict[str, torch.Tensor]:
    """This home's block of the direction of each team-shared matrix of ``infos`` (the owner ``step``'s,
    in name order on every home: the teams' point-to-point rounds then meet in one order; ``blocks``: this
    home's block of each update, flattened in the block's order), by ``team_orthogonalize`` over the team."""
    s = step.muon
    out = {}
    for info in infos:
        split = info.dp_split
        (rows, cols), team = split.homes()
        first, end = split.block_of(step.dp.rank)
        tall = rows >= cols
        block = blocks[info.name].view(end - first, cols) if tall else blocks[info.name].view(rows, end - first)
        choice = step.muon.ns_resolver(like.device).choice(rows, cols, 1, requested="gram")
        result = team_orthogonalize(block.mT if tall else block, TeamReduce(step.dp, [h for h, _, _ in team]),
                                    choice)
        direction = muon_direction([result.mT if tall else result], None, shape=info.shape, scale_mode=s.scale_mode,
                                   extra_scale=s.extra_scale, dtype=like.dtype)[0]
        out[info.name] = direction.reshape(-1)
        if team[0][0] == step.dp.rank:  # (counted once, on the team's first home)
            step.stats["ns_matrices"] += 1
    return out
