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
the pieces it lacks (``move_cost`` per element, in the same units as the NS cost); the other holders
are charged the moving of their pieces. A holder of the biggest piece wins ties, so a matrix stays
where most of it is unless that rank is busy.

**Shared NS** (the layout option ``ns_teams``; ``shared_ns`` here). Megatron shards every bucket over
all DP ranks, so at DP 128 and past a large matrix's pieces lie on most ranks, and one home receives the
whole matrix through its node's network links and runs its NS alone (Qwen2.5-7B's fc1: 543 MB of fp32,
~8 ms of NS on one H100). A matrix with one NS piece and aspect >= 2 (an NS that may run Gram) whose
pieces lie on several nodes can instead get a **team** of homes on different nodes, each with a block of
the long side: per node (``long_side_blocks``: a tall matrix's rows by the node holding each row's first
element, so the way in stays on the node's own links; a wide one's equal column blocks, so it spreads
over the nodes), or fewer, each block then a run of consecutive nodes (``team_groups``), running
distributed Gram NS with the others (runtime/team_ns.py: the m x m Gram matrices of the blocks summed
across the team, the TP path's ``gram_newton_schulz_sharded``). A home's block costs its share of the
m x n products plus the whole m x m iteration (``team_block_cost``) and the team's reductions over its
own link (``team_reduce_elements``), so the best team size depends on the matrix and on how loaded the
ranks already are: per matrix the planner takes the team size (``team_sizes``) whose busiest home is
least loaded, and a team only where that home is less loaded than the best single home. A greedy choice
per matrix can overdo teams (each puts the m x m iteration on all its homes), so the whole layout is
planned once per rule of ``TEAM_SIZE_RULES`` (one home per node, at most 2, 4 or 8 homes, any) and
once without teams, and the least loaded busiest cell wins, teams only ``TEAM_MIN_GAIN`` below none.
"""
from __future__ import annotations

import bisect
from typing import Collection, Dict, Iterable, List, Literal, Optional, Sequence, Set, Tuple, get_args

from ..algorithms.flops import newton_schulz_flops
from .cost_model import SPLIT_EXCHANGE_BYTES
from .owner_layout import PARAM_ALIGN, BucketLayout, OwnerLayout, ParamItem, align_up, check_plan_inputs

__all__ = ["megatron_buckets", "block_span", "block_numel", "NsTeams", "NS_TEAMS", "shares_ns", "team_eligible",
           "team_block_cost", "TEAM_MXM_WEIGHT", "team_reduce_elements", "team_reduce_ms", "long_side_blocks",
           "team_groups", "team_sizes", "TEAM_SIZE_RULES", "TEAM_MIN_GAIN", "block_transfers", "plan_split_layout",
           "bucket_end_divisor", "exchange_bytes", "exchange_bytes_sent", "exchange_ways_ms", "exchange_ms", "Routes",
           "dp_nodes", "to_home_transfers", "narrow_directions", "NARROW_TAG_BYTES"]


def block_span(shape: Sequence[int], first: int, end: int, lo: int, hi: int) -> Tuple[int, int]:
    """The elements ``[lo, hi)`` of a flattened ``shape`` matrix that lie in its long-side block
    ``[first, end)`` (rows of a tall matrix, columns of a wide one), as a range of the block's own
    row-major order (a flat range holds a contiguous run of any such block)."""
    rows, cols = shape
    if rows >= cols:
        return (min(max(lo, first * cols), end * cols) - first * cols,
                min(max(hi, first * cols), end * cols) - first * cols)
    width = end - first

    def before(x):  # the block's elements at flat positions < x
        r, c = divmod(x, cols)
        return r * width + min(max(c - first, 0), width)

    return before(lo), before(hi)


def block_numel(shape: Sequence[int], first: int, end: int) -> int:
    return (end - first) * min(shape)


def _pieces_in_block(shape: Sequence[int], first: int, end: int, pieces: Sequence[Tuple[int, int, int]],
                     his: Sequence[int]) -> Sequence[Tuple[int, int, int]]:
    """The pieces (DP rank, lo, hi; ordered by ``lo``, ``his`` their ends) that may hold elements of the
    long-side block ``[first, end)``: of a tall matrix the run that overlaps its rows, of a wide one all."""
    rows, cols = shape
    if rows < cols:
        return pieces
    return pieces[bisect.bisect_right(his, first * cols):bisect.bisect_left(his, end * cols) + 1]


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
                      elementwise: Optional[Tuple[float, float]] = None, move_cost: float = 0.0,
                      ranks_per_node: Optional[int] = None, node_move_cost: float = 0.0,
                      shared_ns: bool = False) -> OwnerLayout:
    """The split-scheme layout of one buffer: Megatron's own buckets and shards, and each matrix's
    NS home (``OwnerLayout.owners`` / ``tp_owners``, scheme 'split').

    ``rank_cost`` (one entry per DP x TP cell) carries the loads of buffers planned before and
    receives this one's; ``elementwise = (adamw, muon)``: the element-wise work per element of each
    optimizer, charged to every cell of the DP row whose shard holds the element (as the run steps
    it); ``move_cost``: moving one matrix element into its home and its direction back over the
    home's own links, ``node_move_cost``: its way in from another node, shared by the node's links
    (``ranks_per_node`` DP ranks a node, numbered node-major), both in the NS cost's units
    (planning/cost_model.py ``exchange_costs``). A node's incoming pieces are charged to every cell of
    the node (each forwards its share), so homes of large matrices spread over the nodes.
    ``shared_ns``: a matrix whose pieces span nodes may get a team of homes on different nodes (module
    docstring; ``team_eligible``), where that loads its busiest home less than one home would; of the
    passes with each team size rule (``TEAM_SIZE_RULES``) and the one without teams the least loaded
    busiest cell wins, teams only ``TEAM_MIN_GAIN`` below none (each team puts the m x m iteration on
    all its homes, which a greedy choice per matrix can overdo)."""
    rank_cost = check_plan_inputs(items, world_size, tp_size, rank_cost, elementwise)
    args = (items, world_size, bucket_size, tp_size, elementwise, move_cost, ranks_per_node, node_move_cost)
    if not shared_ns or tp_size != 1:
        return _plan_split(*args, rank_cost, None)
    loads = list(rank_cost)
    layout = _plan_split(*args, loads, None)
    alone = (max(loads), loads, layout)
    shared = []  # (its busiest cell's load, its loads, the layout) of each team size rule that made teams
    known: dict = {}
    for rule in TEAM_SIZE_RULES:
        loads = list(rank_cost)
        layout = _plan_split(*args, loads, rule, known)
        if layout.teams:
            shared.append((max(loads), loads, layout))
    best = min(shared, key=lambda p: p[0], default=alone)  # (the first of equals)
    _, loads, layout = best if best[0] < (1.0 - TEAM_MIN_GAIN) * alone[0] else alone
    rank_cost[:] = loads
    return layout


def _plan_split(items, world_size, bucket_size, tp_size, elementwise, move_cost, ranks_per_node, node_move_cost,
                rank_cost, team_rule, known=None) -> OwnerLayout:
    """One greedy pass (``plan_split_layout``); ``team_rule``: None, one home per matrix, else the team
    sizes tried (``team_sizes``); ``known``: ``_plan_team``'s, shared by the passes."""
    known = {} if known is None else known
    ranges, buckets = megatron_buckets(items, bucket_size, world_size)
    nodes = dp_nodes(world_size, ranks_per_node)
    members: Dict[int, List[int]] = {}  # the DP ranks of each node
    for r, node in enumerate(nodes):
        members.setdefault(node, []).append(r)
    if elementwise:
        adamw, muon = elementwise
        for it in items:
            for r, n in _pieces(ranges, buckets, world_size, it.name):
                for c in range(r * tp_size, (r + 1) * tp_size):
                    rank_cost[c] += (muon if it.is_matrix else adamw) * n
    owners: Dict[str, int] = {}
    tp_owners: Dict[str, int] = {}
    teams: Dict[str, dict] = {}
    node_in: Dict[int, float] = {}  # elements coming into each node from others
    for it in sorted((it for it in items if it.is_matrix), key=lambda it: (-it.cost, -it.numel, it.name)):
        held = dict(_pieces(ranges, buckets, world_size, it.name))
        on_node: Dict[int, int] = {}
        for r, n in held.items():
            on_node[nodes[r]] = on_node.get(nodes[r], 0) + n

        def load_after(cell: int) -> float:
            dp = cell // tp_size
            node = nodes[dp]
            incoming = node_in.get(node, 0.0) + it.numel - on_node.get(node, 0)
            return (rank_cost[cell] + it.cost + move_cost * (it.numel - held.get(dp, 0))
                    + node_move_cost * incoming)

        cell = min(range(world_size * tp_size), key=lambda c: (load_after(c), -held.get(c // tp_size, 0), c))
        team = (_plan_team(it, ranges, buckets, world_size, nodes, members, rank_cost, move_cost, node_move_cost,
                           team_rule, known) if team_rule is not None and tp_size == 1 and team_eligible(it) else None)
        if team is not None and max(load for _, load, _ in team[0]) < load_after(cell):
            team, pieces = team
            _take_team(it, team, pieces, nodes, rank_cost, move_cost, node_in)
            teams[it.name] = {"shape": list(it.pieces[0]), "blocks": [[home, a, b] for home, _, (a, b) in team]}
            owners[it.name], tp_owners[it.name] = team[0][0], 0
            continue
        home, tp_owners[it.name] = divmod(cell, tp_size)
        rank_cost[cell] += it.cost + move_cost * (it.numel - held.get(home, 0))
        owners[it.name] = home
        node_in[nodes[home]] = node_in.get(nodes[home], 0.0) + it.numel - on_node.get(nodes[home], 0)
        for r, n in held.items():  # every other holder sends its piece and receives the direction's back
            if r != home:
                for c in range(r * tp_size, (r + 1) * tp_size):
                    rank_cost[c] += move_cost * n
    for r in range(world_size):  # each rank of a node carries its share of what comes into the node
        for c in range(r * tp_size, (r + 1) * tp_size):
            rank_cost[c] += node_move_cost * node_in.get(nodes[r], 0.0)
    layout = OwnerLayout(world_size, ranges, owners, buckets, list(rank_cost), tp_size, tp_owners, scheme="split",
                         teams=teams)
    layout.validate(items)
    return layout


NsTeams = Literal["off", "auto"]  # no teams, or teams where the planner's cost model finds them better
NS_TEAMS: tuple = get_args(NsTeams)

# the rules plan_split_layout tries (``team_sizes``), the first kept on a tie
TEAM_SIZE_RULES = ("nodes", 2, 4, 8, "any")
# teams are kept only where they load the busiest cell this much less than one home per matrix: within the
# cost model's error (~6%, docs/load_balancing.md) one home, which reduces nothing across nodes, stays
TEAM_MIN_GAIN = 0.05


def shares_ns(ns_method: str, overlapped_step: bool) -> bool:
    """Whether a run's split layout may give a matrix a team of NS homes: its NS may run Gram (the team
    runs distributed Gram NS; an explicit standard NS keeps one home per matrix) and its step is not
    overlapped (the overlapped step's ways back run per need group, the teams' reductions are not built there)."""
    return ns_method in ("gram", "auto") and not overlapped_step


def team_eligible(it: ParamItem) -> bool:
    """Whether matrix ``it`` can share its NS over a team: one NS piece (no split rule) with aspect
    >= 2 (Gram NS runs there, algorithms/gram_newton_schulz.gram_applies; blocks of its long side are
    column blocks of the wide orientation, as distributed Gram NS needs)."""
    if not it.is_matrix or len(it.pieces) != 1 or len(it.pieces[0]) != 2:
        return False
    rows, cols = it.pieces[0]
    return rows * cols == it.numel and max(rows, cols) >= 2 * min(rows, cols)


def _gram_flops(m: int, n: int) -> float:
    return newton_schulz_flops(m, n, 5, "gram", symmetric=True, min_aspect_ratio=1.0)


# the m x m iteration's weight against its FLOPs in a team home's NS: it runs as smaller products and
# element-wise steps, below the m x n products' rate. Measured on one H100 (bench/team_block_cost.py,
# docs/results/dp_layouts/team_block_cost_h100_2026-12-07.md): with 2 the model's share of one home's NS
# is never below the measured one for Qwen2.5-7B's and 32B's fc1 and fc2 at 2-16 homes (no team taken where
# it would not gain) and at most 0.11 above it (0.04 for 7B's fc1)
TEAM_MXM_WEIGHT = 2.0


def team_block_cost(it: ParamItem, long_part: int) -> float:
    """One team home's NS cost, in ``it.cost``'s units: its block's share (``long_part`` of the long
    side) of the m x n products, and the whole m x m iteration (every home runs it on the summed Gram),
    weighed ``TEAM_MXM_WEIGHT`` times its FLOPs; the whole long side costs ``it.cost``."""
    m, n = sorted(it.pieces[0])
    full = _gram_flops(m, n)
    per_long = (_gram_flops(m, 2 * n) - full) / n  # the m x n products grow with the long side, the rest not
    square = TEAM_MXM_WEIGHT * (full - per_long * n)
    return it.cost * (per_long * long_part + square) / (per_long * n + square)


def team_reduce_elements(it: ParamItem, team_size: int, segments: int = 2) -> float:
    """Elements (of the masters' 4 bytes) each home of a ``team_size`` team receives in its Gram
    reductions: one ring all-reduce of the m x m Gram matrix (16-bit) per Gram segment."""
    m = min(it.pieces[0])
    return segments * (team_size - 1) / team_size * m * m


def team_reduce_ms(layout: OwnerLayout, items: Sequence[ParamItem], link) -> List[float]:
    """Each DP rank's time in its teams' Gram reductions (runtime/dp_exchange.TeamReduce: a ring
    all-reduce per Gram segment, 2 (k - 1) rounds, ``team_reduce_elements`` at 4 bytes each), over
    ``link`` (cost_model.Link; the inter-node one: a team's homes lie on different nodes)."""
    ms = [0.0] * layout.world_size
    for it in items:
        if it.name in layout.teams:
            blocks = layout.homes(it.name)[1]
            k = len(blocks)
            one = (4 * 2 * (k - 1) * link.alpha_us * 1e-3
                   + team_reduce_elements(it, k) * 4 / (link.gbytes_per_s * 1e6))
            for home, _, _ in blocks:
                ms[home] += one
    return ms


def long_side_blocks(shape: Sequence[int], pieces: Sequence[Tuple[int, int, int]],
                     nodes: Sequence[int]) -> List[Tuple[int, int, int]]:
    """``[(node, first, end)]``: the team blocks of a matrix of ``shape`` whose pieces (DP rank, lo, hi;
    rank order) lie on several nodes. Tall: its rows by the node that holds each row's first element
    (each home gathers from its own node). Wide (a node holds whole rows, not columns): as many equal
    column blocks as nodes holding it, one per node (homes spread the way in over the nodes' links)."""
    rows, cols = shape
    if rows >= cols:
        out: List[List[int]] = []
        for r, lo, hi in pieces:
            first, end = -(-lo // cols), -(-hi // cols)
            if end <= first:
                continue
            if out and out[-1][0] == nodes[r]:
                out[-1][2] = end
            else:
                out.append([nodes[r], first, end])
        return [tuple(b) for b in out]
    holding = sorted({nodes[r] for r, _, _ in pieces})
    k = min(len(holding), cols)
    cuts = [cols * i // k for i in range(k + 1)]
    return [(node, cuts[i], cuts[i + 1]) for i, node in enumerate(holding[:k])]


def team_groups(shape: Sequence[int], blocks: Sequence[Tuple[int, int, int]],
                size: int) -> List[Tuple[Tuple[int, ...], int, int]]:
    """``[(nodes, first, end)]``: ``long_side_blocks``' per-node ``blocks`` of a matrix of ``shape`` as a team
    of ``size`` homes, each block one run of consecutive nodes. Tall: the node blocks joined where the rows
    cut most evenly (each home's rows still come from its own nodes). Wide: ``size`` equal column blocks,
    each homed on a run of the holding nodes."""
    size = max(1, min(size, len(blocks)))
    if shape[0] >= shape[1]:
        total = blocks[-1][2] - blocks[0][1]
        cuts, i = [0], 0
        for g in range(1, size):  # the block boundary nearest to g / size of the rows, one block a group at least
            target = blocks[0][1] + total * g / size
            i = max(i + 1, min(range(i + 1, len(blocks) - (size - g) + 1), key=lambda j: abs(blocks[j][1] - target)))
            cuts.append(i)
        cuts.append(len(blocks))
        return [(tuple(b[0] for b in blocks[a:z]), blocks[a][1], blocks[z - 1][2]) for a, z in zip(cuts, cuts[1:])]
    cols, holding = shape[1], [b[0] for b in blocks]
    edges = [cols * g // size for g in range(size + 1)]
    spread = [len(holding) * g // size for g in range(size + 1)]
    return [(tuple(holding[spread[g]:spread[g + 1]]), edges[g], edges[g + 1]) for g in range(size)]


def team_sizes(nodes_spanned: int, rule="nodes") -> List[int]:
    """The team sizes the planner tries for a matrix whose pieces lie on ``nodes_spanned`` nodes under
    ``rule``: 'nodes', one home per node; an int, the powers of two up to it; 'any', the powers of two and
    the node count."""
    if rule == "nodes":
        return [nodes_spanned]
    top = nodes_spanned if rule == "any" else min(nodes_spanned, rule)
    powers = {k for k in (2 ** e for e in range(1, top.bit_length())) if k <= top}
    return sorted(powers | ({top} if rule == "any" else set()))


def _plan_team(it, ranges, buckets, world_size, nodes, members, rank_cost, move_cost, node_move_cost, rule, known):
    """([(home, its load after, (first, end))], the pieces) of the best team for ``it`` (``team_groups`` of
    each of ``team_sizes``, each home the least loaded rank of its nodes; the team whose busiest home is
    least loaded, the smaller on a tie), or None where its pieces lie on one node. ``members``: the DP
    ranks of each node; ``known``: what does not depend on the loads (pieces, blocks, each size's groups
    and who holds what of them), kept across the passes of ``plan_split_layout``."""
    if it.name not in known:
        pieces = OwnerLayout(world_size, ranges, {}, buckets, [], scheme="split").pieces(it.name)
        known[it.name] = (pieces, long_side_blocks(it.pieces[0], pieces, nodes), {})
    pieces, blocks, sizes = known[it.name]
    if len(blocks) < 2:
        return None
    best = None
    for size in team_sizes(len(blocks), rule):
        if size not in sizes:
            sizes[size] = _team_parts(it, pieces, blocks, size, nodes, members)
        # the reductions run over each home's own network link, not shared by its node's: per element,
        # ``node_move_cost`` (an exchanged element's bytes into a node over its links) x the node's links x
        # 4 bytes / the exchanged element's bytes
        reduce = node_move_cost * len(members[blocks[0][0]]) * 4 / SPLIT_EXCHANGE_BYTES \
            * team_reduce_elements(it, size)
        team = []
        for candidates, first, end, numel, mine, on_node in sizes[size]:
            base = team_block_cost(it, end - first) + reduce

            def load(r):  # (what comes into the home's node from other nodes: the forwarding share of its node-mates)
                return (rank_cost[r] + base + node_move_cost * (numel - on_node.get(nodes[r], 0))
                        + move_cost * (numel - mine.get(r, 0)))

            home = min(candidates, key=lambda r: (load(r), -mine.get(r, 0), r))
            team.append((home, load(home), (first, end)))
        if best is None or max(x[1] for x in team) < max(x[1] for x in best):
            best = team
    return best, pieces


def _team_parts(it, pieces, blocks, size, nodes, members):
    """Per block of a ``size`` team (``team_groups``): (the ranks of its nodes, first, end, its elements,
    the elements each holder holds of it, the elements each node holds of it)."""
    shape = it.pieces[0]
    his = [hi for _, _, hi in pieces]
    parts = []
    for group, first, end in team_groups(shape, blocks, size):
        mine: Dict[int, int] = {}
        on_node: Dict[int, int] = {}
        for r, lo, hi in _pieces_in_block(shape, first, end, pieces, his):
            a, b = block_span(shape, first, end, lo, hi)
            if b > a:
                mine[r] = b - a
                on_node[nodes[r]] = on_node.get(nodes[r], 0) + b - a
        parts.append(([r for node in group for r in members[node]], first, end, block_numel(shape, first, end),
                      mine, on_node))
    return parts


def _take_team(it, team, pieces, nodes, rank_cost, move_cost, node_in) -> None:
    """Charge a team's loads: each home its block and reductions; each holder the moving of what it
    holds of other homes' blocks; each node what comes into it from other nodes."""
    shape = it.pieces[0]
    his = [hi for _, _, hi in pieces]
    for home, load, (first, end) in team:
        rank_cost[home] = load
        for r, lo, hi in _pieces_in_block(shape, first, end, pieces, his):
            a, b = block_span(shape, first, end, lo, hi)
            if b > a and r != home:
                rank_cost[r] += move_cost * (b - a)
                if nodes[r] != nodes[home]:
                    node_in[nodes[home]] = node_in.get(nodes[home], 0.0) + b - a


class Routes:
    """Where a piece bound for another node goes first (runtime/dp_exchange.py): to the node-mate of its
    destination with the sender's local index, a rail-aligned hop, so that a home's incoming pieces
    share its node's links; that rank forwards it over the node's own links. ``nodes``: the node of
    each DP rank."""

    def __init__(self, nodes: Sequence[int]):
        self.nodes = list(nodes)
        self.mates: Dict[int, List[int]] = {}
        for r, node in enumerate(self.nodes):
            self.mates.setdefault(node, []).append(r)
        self.local_index = [self.mates[node].index(r) for r, node in enumerate(self.nodes)]

    def proxy(self, src: int, dst: int) -> Optional[int]:
        """The rank between ``src`` and ``dst`` (None: same node, or the rank would be ``dst`` itself)."""
        if self.nodes[src] == self.nodes[dst]:
            return None
        mates = self.mates[self.nodes[dst]]
        proxy = mates[self.local_index[src] % len(mates)]
        return None if proxy == dst else proxy

    def rounds(self, transfers):
        """``transfers`` ((key, source, destination, lo, hi)) as rounds of hops (transfer, from, to): the
        direct transfers and first hops, then the forwarding hops."""
        first, second = [], []
        for t in transfers:
            proxy = self.proxy(t[1], t[2])
            if proxy is None:
                first.append((t, t[1], t[2]))
            else:
                first.append((t, t[1], proxy))
                second.append((t, proxy, t[2]))
        return [first, second] if second else [first]


def dp_nodes(world_size: int, ranks_per_node: Optional[int]) -> List[int]:
    """The node of each of ``world_size`` DP ranks numbered node-major, ``ranks_per_node`` DP ranks a
    node (None or 0: one node)."""
    return [r // ranks_per_node if ranks_per_node else 0 for r in range(world_size)]


def to_home_transfers(layout: OwnerLayout) -> list:
    """(matrix, holder, home, lo, hi) of every piece that is not on its home, or of each part of it in
    a team block homed elsewhere (``lo, hi``: in the block's own order, OwnerLayout.homes; the directions
    go back the other way)."""
    return [t for name in sorted(layout.owners)
            for t in block_transfers(name, *layout.homes(name), layout.pieces(name))]


def block_transfers(key, shape, blocks, pieces) -> list:
    """(key, holder, home, a, b) of every part of a piece (DP rank, lo, hi) that lies in a block (home,
    first, end) homed elsewhere, [a, b) in that block's order (``block_span``): the planner's model and
    the runtime's exchange (runtime/dp_exchange.py) list the same transfers."""
    out = []
    for home, first, end in blocks:
        for r, lo, hi in pieces:
            a, b = block_span(shape, first, end, lo, hi)
            if r != home and a < b:
                out.append((key, r, home, a, b))
    return out


NARROW_TAG_BYTES = 8  # what a direction in 16 bits carries besides its elements, per message part


def narrow_directions(matrices: Iterable[str], tp_size: int, ns_bytes: int = 2, master_bytes: int = 4) -> Set[str]:
    """The split matrices whose direction comes back as its NS outputs' 16-bit bits (runtime/
    narrow_directions.py, where the NS returns its compute dtype, as on CUDA): every one of
    ``matrices``, but none under TP, with a wider NS or with 16-bit masters."""
    if tp_size != 1 or ns_bytes != 2 or master_bytes <= 2:
        return set()
    return set(matrices)


def _back_bytes(narrow: Collection[str], bytes_each_way: int):
    return lambda t: (2 * (t[4] - t[3]) + NARROW_TAG_BYTES) if t[0] in narrow else (t[4] - t[3]) * bytes_each_way


def exchange_ms(layout: OwnerLayout, intra, inter, ranks_per_node: Optional[int] = None,
                bytes_each_way: int = 4, narrow: Collection[str] = ()) -> List[float]:
    """Each DP rank's time in the split layout's exchange: the pieces of the updates to their homes,
    then the directions back, each as the rounds ``Routes`` gives (direct and first hops, then the
    forwarding hops inside the home's node). ``intra`` / ``inter``: the links inside a node and between
    nodes (cost_model.Link: alpha_us, gbytes_per_s); a rank sends and receives at once (full duplex) and
    uses both links at once, so a round takes, per link, the larger of what it sends and receives
    there. The way back takes the way there's rounds the other way, ``bytes_each_way`` an element
    (the masters' fp32) but for the ``narrow`` matrices (``narrow_directions``): 2 and a tag."""
    there, back = exchange_ways_ms(layout, intra, inter, ranks_per_node, bytes_each_way, narrow)
    return [a + b for a, b in zip(there, back)]


def exchange_ways_ms(layout: OwnerLayout, intra, inter, ranks_per_node: Optional[int] = None,
                     bytes_each_way: int = 4, narrow: Collection[str] = (),
                     matrices: Optional[Collection[str]] = None) -> Tuple[List[float], List[float]]:
    """``exchange_ms``'s two ways apart, (there, back) per DP rank, of the exchange of ``matrices``
    alone (None: all; the overlapped step exchanges each need group's matrices on their own)."""
    nodes = dp_nodes(layout.world_size, ranks_per_node)
    ms = {"there": [0.0] * layout.world_size, "back": [0.0] * layout.world_size}
    if layout.scheme != "split":
        return ms["there"], ms["back"]
    back = _back_bytes(narrow, bytes_each_way)
    transfers = [t for t in to_home_transfers(layout) if matrices is None or t[0] in matrices]
    for hops in Routes(nodes).rounds(transfers):
        for way in ("there", "back"):
            moved = {}  # (rank, link is inter, sends) -> bytes
            for t, src, dst in hops:
                far = nodes[src] != nodes[dst]
                sender, receiver, n = (src, dst, (t[4] - t[3]) * bytes_each_way) if way == "there" else (dst, src, back(t))
                moved[(sender, far, True)] = moved.get((sender, far, True), 0.0) + n
                moved[(receiver, far, False)] = moved.get((receiver, far, False), 0.0) + n
            for r in range(layout.world_size):
                times = [link.alpha_us * 1e-3 + max(moved.get((r, far, True), 0.0), moved.get((r, far, False), 0.0))
                         / (link.gbytes_per_s * 1e6) for far, link in ((False, intra), (True, inter))
                         if moved.get((r, far, True)) or moved.get((r, far, False))]
                ms[way][r] += max(times, default=0.0)
    return ms["there"], ms["back"]


def exchange_bytes(layout: OwnerLayout, nodes: Optional[Sequence[int]] = None,
                   bytes_each_way: int = 4, narrow: Collection[str] = ()) -> Tuple[List[float], List[float]]:
    """(sent, received): bytes each DP rank sends and receives per step in the split layout's exchange
    (runtime/dp_exchange.py), both ways (the pieces of the updates to their homes, the directions' back)
    along ``Routes(nodes)`` (a forwarding rank counts what it forwards; None: one node, no forwarding),
    ``bytes_each_way`` per element (the masters' fp32), the ``narrow`` matrices' directions in 16 bits
    and a tag. Zeros for a whole-matrix layout."""
    sent = [0.0] * layout.world_size
    received = [0.0] * layout.world_size
    if layout.scheme != "split":
        return sent, received
    back = _back_bytes(narrow, bytes_each_way)
    for hops in Routes(nodes or [0] * layout.world_size).rounds(to_home_transfers(layout)):
        for t, src, dst in hops:
            there = (t[4] - t[3]) * bytes_each_way
            sent[src] += there
            received[dst] += there
            sent[dst] += back(t)  # the same hop the other way
            received[src] += back(t)
    return sent, received


def exchange_bytes_sent(layout: OwnerLayout, nodes: Optional[Sequence[int]] = None,
                        bytes_each_way: int = 4, narrow: Collection[str] = ()) -> List[float]:
    """The bytes each DP rank sends per step in the split layout's exchange (``exchange_bytes``)."""
    return exchange_bytes(layout, nodes, bytes_each_way, narrow)[0]
