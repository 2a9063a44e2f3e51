"""Owner plan + owner-aligned buffer layout (pure data, deterministic, serializable).

A Megatron buffer is cut into buckets; each bucket is reduce-scattered in D equal shards, shard r
going to DP rank r. DMuon lays a bucket out so that every Muon matrix lies wholly inside the shard
of the rank that owns it: the reduce-scatter then *is* reduce-to-owner, and the all-gather of
params is the owner's publish. Element-wise (AdamW) params fill the space around the owned
matrices and may straddle shard boundaries, exactly as in Megatron's DistributedOptimizer, which
keeps padding (and so bytes on the wire) close to AdamW-ZeRO's.

Ownership balances predicted Newton–Schulz cost (not numel) globally across buckets, subject to
each rank's owned numel in a bucket fitting its shard.

Tensor parallelism: every TP rank has the same buffer layout (its shards of the same matrices,
same shapes), so one plan serves the whole TP group. A matrix gets a DP owner (where its shards
sit in the reduce-scatter) and a TP owner (which TP rank at that DP index runs NS on the merged
full matrix); cost is balanced over all DP x TP cells, so no two ranks orthogonalize the same
matrix and the heaviest cell is kept light.

How owners are placed (``LayoutOptions.balance``): what each method runs, here, in the one place
that compares their names (``BalanceMethod``; as planning/overlap_mode.py for the overlapped step).

* 'cost' (the default): the greedy on predicted cost, heaviest matrix first to the least-loaded
  cell, element-wise work counted;
* 'numel_lpt' (Megatron 0.19 LayerWise's rule: largest numel first to the cell with the least
  numel), 'megatron_lpt' (Megatron-LM main's layer-sharded Muon, PR #6379: LPT on
  max(m, n) * min(m, n)^2 of each matrix) and 'round_robin' (buffer order, cells in turn): baselines;
* 'milp': an MILP on who owns what, one of two, named apart:
  - the *rank MILP* (planning/rank_milp.py ``plan_rank_owner_layout``) on a rank cost model of the
    whole owner step (``RankCostModel``: NS pieces and AdamW shards), warm-started by the greedy plans.
    A run whose costs are a rank cost model takes it: the main job's and the hook's ``milp`` (the
    start-up rank profile, ``LayoutOptions.profile``), or a ``cost_model_fn`` returning one;
  - the *matrix MILP* (planning/milp.py ``solve_owner_milp``; ``plan_owner_layout``'s rule
    'matrix_milp') on per-matrix costs (NS FLOPs, or a per-matrix cost model's ms with batched-launch
    costs), globally over the buckets: 'milp' without a rank cost model, and ``dmuon plan``'s
    ``milp`` planner.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable, Dict, List, Literal, Optional, Sequence, Tuple, get_args

from .buckets import megatron_bucket_size, split_buckets  # noqa: F401 (megatron_bucket_size: public here too)
from .dp_shards import shard_overlap, shard_range
from .placement import least_loaded_cell

SCHEMES = ("whole", "split")  # OwnerLayout.scheme
# LayoutOptions.dp_layout: a scheme, or the planner's choice per buffer
DpLayout = Literal["auto", "whole", "split"]
DP_LAYOUTS: tuple = get_args(DpLayout)
PARAM_ALIGN = 64  # Megatron aligns param starts to 64 elements; keeps matrix views GEMM-friendly.

# the config's methods (the order of the flag's choices)
Balance = Literal["cost", "round_robin", "numel_lpt", "megatron_lpt", "milp"]
BALANCE: tuple = get_args(Balance)
DEFAULT_BALANCE: str = BALANCE[0]
# plan_owner_layout's rules: the config's, its MILP being the matrix MILP
LayoutRule = Literal["cost", "round_robin", "numel_lpt", "megatron_lpt", "matrix_milp"]
LAYOUT_RULES: tuple = get_args(LayoutRule)


def _max_min_squared(item) -> float:
    """Megatron's layer-sharded Muon's cost of a matrix: max(m, n) * min(m, n)^2 of its shape."""
    dims = [int(d) for d in item.shape_key.split("x")] if item.shape_key else []
    if len(dims) != 2:
        return float(item.numel)
    m, n = dims
    return float(max(m, n) * min(m, n) ** 2)


# the baselines' LPT costs: (item) -> the cost their rule balances (loads start at zero: no element-wise work)
_LPT_COSTS = {"numel_lpt": lambda item: float(item.numel), "megatron_lpt": _max_min_squared}


@dataclasses.dataclass(frozen=True)
class BalanceMethod:
    name: str = "cost"

    def __post_init__(self):
        if self.name not in BALANCE + LAYOUT_RULES:
            raise ValueError(f"balance {self.name!r} unknown; valid: {', '.join(dict.fromkeys(BALANCE + LAYOUT_RULES))}")

    @property
    def solves_milp(self) -> bool:
        """An MILP places the owners (the rank MILP or the matrix MILP: ``layout_rule``)."""
        return self.name in ("milp", "matrix_milp")

    def layout_rule(self, rank_model: bool) -> Optional[str]:
        """The ``plan_owner_layout`` rule that places the owners; None where the rank MILP does
        ('milp' on a rank cost model: ``rank_model``)."""
        if self.name == "milp":
            return None if rank_model else "matrix_milp"
        return self.name

    @property
    def profiles(self) -> bool:
        """'milp' as the flags set it: the rank MILP, on the rank cost model the start-up profile of this
        GPU gives (``LayoutOptions.profile``, with the plan budget and cache)."""
        return self.name == "milp"

    @property
    def lpt_cost(self) -> Optional[Callable]:
        """A baseline LPT rule's cost of an item (its loads start at zero, no element-wise work)."""
        return _LPT_COSTS.get(self.name)

    @property
    def counts_elementwise(self) -> bool:
        """The greedy on predicted cost: element-wise work counted in its loads."""
        return self.name == "cost"

    @property
    def in_turn(self) -> bool:
        """Matrices in buffer order to the cells in turn (round robin)."""
        return self.name == "round_robin"


def align_up(x: int, a: int = PARAM_ALIGN) -> int:
    return (x + a - 1) // a * a


@dataclasses.dataclass(frozen=True)
class ParamItem:
    """One parameter of a buffer, in the buffer's parameter order."""

    name: str
    numel: int
    is_matrix: bool  # handled by Muon (owned whole by one rank)
    cost: float = 0.0  # predicted NS cost (FLOPs or seconds) of the FULL matrix; only for matrices
    shape_key: str = ""  # matrices with equal keys can be batched in one NS call
    own_bucket: bool = False  # e.g. Megatron's shared embedding: bucket of its own
    launch_cost: float = 0.0  # fixed cost of one batched NS call of this shape on a rank ('milp' uses it)
    pieces: Tuple[Tuple[int, ...], ...] = ()  # the NS pieces the owner step cuts it into (empty: the whole matrix)


@dataclasses.dataclass
class BucketLayout:
    start: int
    end: int  # padded end; (end - start) % world_size == 0
    numel_unpadded: int
    shard_size: int


@dataclasses.dataclass
class OwnerLayout:
    """Where each param sits in the buffer, which rank owns each matrix, and the buckets."""

    world_size: int  # DP size (reduce-scatter shards per bucket)
    param_ranges: Dict[str, Tuple[int, int, int]]  # name -> (start, end, bucket_id)
    owners: Dict[str, int]  # matrix name -> owning DP rank
    buckets: List[BucketLayout]
    rank_cost: List[float]  # per DP x TP cell, index dp_rank * tp_size + tp_rank
    tp_size: int = 1
    tp_owners: Dict[str, int] = dataclasses.field(default_factory=dict)  # matrix name -> TP rank running NS
    # 'whole': every matrix lies inside its owner's shard (the reduce-scatter is reduce-to-owner);
    # 'split' (planning/split_layout.py): Megatron's equal shards cut matrices where they fall, each
    # rank keeps the state of its pieces, and ``owners`` names each matrix's NS home, which the pieces
    # travel to and from (runtime/dp_exchange.py)
    scheme: str = "whole"
    # the split layout's shared NS (planning/split_layout.py): a matrix whose NS a team of homes shares,
    # each running distributed Gram NS on its block of the long side: name -> {'shape': [rows, cols],
    # 'blocks': [[home DP rank, first, end], ...]} (rows of a tall matrix, columns of a wide one, in
    # order; ``owners`` names the first home)
    teams: Dict[str, dict] = dataclasses.field(default_factory=dict)

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def numel_unpadded(self) -> int:
        return sum(b.numel_unpadded for b in self.buckets)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "OwnerLayout":
        d = json.loads(text)
        return cls(
            world_size=d["world_size"],
            param_ranges={k: tuple(v) for k, v in d["param_ranges"].items()},
            owners=d["owners"],
            buckets=[BucketLayout(**b) for b in d["buckets"]],
            rank_cost=d["rank_cost"],
            tp_size=d.get("tp_size", 1),
            tp_owners=d.get("tp_owners", {}),
            scheme=d.get("scheme", "whole"),
            teams={k: {"shape": list(v["shape"]), "blocks": [list(b) for b in v["blocks"]]}
                   for k, v in d.get("teams", {}).items()},
        )

    def homes(self, name: str) -> Tuple[Tuple[int, int], List[Tuple[int, int, int]]]:
        """(shape, ``[(DP rank, first, end)]``): where the NS of matrix ``name`` runs and on which block
        of its long side (split_layout.block_span reads them): its team's blocks, or its one home on the whole
        (then as a [numel, 1] column, whose blocks are flat ranges)."""
        if name in self.teams:
            team = self.teams[name]
            return tuple(team["shape"]), [tuple(b) for b in team["blocks"]]
        start, end, _ = self.param_ranges[name]
        return (end - start, 1), [(self.owners[name], 0, end - start)]

    def pieces(self, name: str) -> List[Tuple[int, int, int]]:
        """``[(DP rank, lo, hi)]``: the part ``[lo, hi)`` of parameter ``name`` (offsets into its
        flattened elements) inside each DP rank's shard that holds some of it, in rank order."""
        start, end, b = self.param_ranges[name]
        bucket = self.buckets[b]
        first = max(0, (start - bucket.start) // bucket.shard_size)
        last = min(self.world_size - 1, (end - 1 - bucket.start) // bucket.shard_size)
        out = []
        for r in range(first, last + 1):
            lo, hi = shard_overlap(start, end, r, bucket.shard_size, bucket.start)
            if hi > lo:
                out.append((r, lo - start, hi - start))
        return out

    def validate(self, items: Sequence[ParamItem]) -> None:
        """Check the invariants the optimizer relies on (also under ``python -O``)."""

        def require(ok, msg):
            if not ok:
                raise ValueError(f"DMuon owner layout is inconsistent: {msg}")

        require(self.scheme in SCHEMES, f"scheme {self.scheme!r} is not one of {', '.join(SCHEMES)}")
        spans = sorted((s, e, n) for n, (s, e, _) in self.param_ranges.items())
        for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
            require(e0 <= s1, f"params {n0} and {n1} overlap in the buffer")
        for it in items:
            s, e, b = self.param_ranges[it.name]
            require(e - s == it.numel, f"{it.name} spans {e - s} elements, has {it.numel}")
            bucket = self.buckets[b]
            require(bucket.start <= s and e <= bucket.end, f"{it.name} runs past its bucket")
            if it.is_matrix:
                r = self.owners[it.name]
                require(0 <= r < self.world_size, f"owner {r} of {it.name} is not a rank of {self.world_size}")
                lo, hi = shard_range(r, bucket.shard_size, bucket.start)
                require(self.scheme == "split" or (lo <= s and e <= hi), f"matrix {it.name} crosses its owner's shard")
                require(0 <= self.tp_owners.get(it.name, 0) < self.tp_size, f"TP owner of {it.name} out of range")
                if it.name in self.teams:
                    (rows, cols), blocks = self.homes(it.name)
                    require(self.scheme == "split" and self.tp_size == 1, f"{it.name}: a shared NS outside the split layout")
                    require(rows * cols == it.numel and blocks[0][1] == 0 and blocks[-1][2] == max(rows, cols)
                            and blocks[0][0] == r and all(a[2] == b[1] for a, b in zip(blocks, blocks[1:]))
                            and all(lo < hi for _, lo, hi in blocks), f"{it.name}: team blocks {blocks} do not tile it")
                    require(len({h for h, _, _ in blocks}) == len(blocks)
                            and all(0 <= h < self.world_size for h, _, _ in blocks), f"{it.name}: team homes {blocks}")
        for bucket in self.buckets:
            require(bucket.end - bucket.start == bucket.shard_size * self.world_size,
                    f"bucket [{bucket.start}, {bucket.end}) is not {self.world_size} shards of {bucket.shard_size}")


def min_shard(items, members, world_size) -> int:
    """A bucket's smallest shard: 1/D of its elements, and at least its biggest matrix."""
    total = sum(items[i].numel for i in members)
    return max(math.ceil(total / world_size), max((items[i].numel for i in members if items[i].is_matrix), default=0))


def _elementwise_term(items, bucket_members, world_size, elementwise) -> float:
    """Change of a DP rank's element-wise work per element of a matrix it owns in this bucket.

    Every rank's shard of a bucket has the same size S, so an owned matrix element displaces
    whatever else would sit in the shard: an AdamW element (saving ``adamw - muon``) or padding
    (costing ``muon``). The share of AdamW in the shards' free space, phi = F / (D x S - M) (F the
    bucket's element-wise numel, M its matrices'), weighs the two: ``muon - phi x adamw``."""
    if not elementwise:
        return 0.0
    adamw, muon = elementwise
    total = sum(items[i].numel for i in bucket_members)
    matrices = sum(items[i].numel for i in bucket_members if items[i].is_matrix)
    free = world_size * min_shard(items, bucket_members, world_size) - matrices
    phi = min(1.0, (total - matrices) / free) if free > 0 else 1.0
    return muon - phi * adamw


def _assign_owners(items, bucket_members, world_size, rank_cost, tp_size=1, in_turn=False, assigned=0,
                   elementwise=None):
    """Cost-aware greedy: heaviest matrix first to the least-loaded DP x TP cell whose DP
    shard still fits it. ``in_turn`` (round robin): matrices in buffer order to the cells in turn
    (the turn continues from the ``assigned`` matrices of earlier buckets).

    ``elementwise = (adamw, muon)``: element-wise cost per element of each optimizer, in the
    costs' units. Owning a matrix changes its DP row's element-wise work by
    ``_elementwise_term`` per element on every cell of the row (each TP rank steps its shard);
    the NS cell pays ``cost``. Matrices that lower their row's load (cheap NS, much AdamW
    displaced) go to the most loaded DP row that fits them.
    Returns ({name: dp rank}, {name: tp rank})."""
    if in_turn:
        owners, tp_owners = {}, {}
        for k, i in enumerate(i for i in bucket_members if items[i].is_matrix):
            c = (assigned + k) % (world_size * tp_size)
            owners[items[i].name], tp_owners[items[i].name] = divmod(c, tp_size)
            rank_cost[c] += items[i].cost
        return owners, tp_owners
    per_element = _elementwise_term(items, bucket_members, world_size, elementwise)

    def net(i):  # NS cost plus the change of the row's element-wise work
        return items[i].cost + per_element * items[i].numel

    # heaviest first; then the ones that lower their row's load, most lowering first
    mats = sorted((i for i in bucket_members if items[i].is_matrix),
                  key=lambda i: (net(i) < 0, -abs(net(i)), -items[i].numel, items[i].name))
    shard = min_shard(items, bucket_members, world_size)
    owned_numel = [0] * world_size
    owners, tp_owners = {}, {}
    cells = range(world_size * tp_size)
    for i in mats:
        it = items[i]
        def has_room(d):
            return owned_numel[d] + align_up(it.numel) <= shard + PARAM_ALIGN

        fits = [c for c in cells if has_room(c // tp_size)]
        pool = cells
        if fits and net(i) < 0:
            def row_load(d):
                return max(rank_cost[d * tp_size:(d + 1) * tp_size])

            heaviest = max((c // tp_size for c in fits), key=lambda d: (row_load(d), -d))
            pool = [c for c in fits if c // tp_size == heaviest]
        c = least_loaded_cell(pool, tp_size, has_room, rank_cost.__getitem__, owned_numel.__getitem__)
        owners[it.name], tp_owners[it.name] = divmod(c, tp_size)
        owned_numel[c // tp_size] += align_up(it.numel)
        rank_cost[c] += it.cost
        if per_element:
            dp = c // tp_size
            for cell in range(dp * tp_size, (dp + 1) * tp_size):
                rank_cost[cell] += per_element * it.numel
    return owners, tp_owners


def _bucket_loads(items, members, owners, tp_owners, world_size, tp_size, base, elementwise, start):
    """Cell loads after one bucket, as its layout (placed from buffer offset ``start``, as
    ``plan_layout_once`` will place it) holds them: ``base`` + the NS cost of the matrices each cell owns +
    on every cell of DP row r ``muon x (r's owned matrix elements) + adamw x (element-wise
    elements in r's shard)`` (straddling params by overlap). Returns (loads, placement, shard),
    the placement being ``_place_bucket``'s, which ``plan_layout_once`` then keeps."""
    adamw, muon = elementwise
    loads = list(base)
    mats = [i for i in members if items[i].is_matrix]
    pos, shard = _place_bucket(items, members, {items[i].name: owners[items[i].name] for i in mats}, world_size,
                               start)
    owned = [0] * world_size
    for i in mats:
        name = items[i].name
        loads[owners[name] * tp_size + tp_owners[name]] += items[i].cost
        owned[owners[name]] += items[i].numel
    for r in range(world_size):
        steps = sum(hi - lo for lo, hi in (shard_overlap(*pos[items[i].name], r, shard, start)
                                           for i in members if not items[i].is_matrix))
        for cell in range(r * tp_size, (r + 1) * tp_size):
            loads[cell] += muon * owned[r] + adamw * steps
    return loads, pos, shard


def _milp_owners(items, buckets, world_size, rank_cost, tp_size, max_bucket_padding, options, info,
                 elementwise=None):
    """Owners of every matrix of every bucket from one MILP (planning/milp.py), warm-started with
    the greedy plan; each DP rank's owned numel in a bucket must fit its shard, which may grow up
    to ``max_bucket_padding`` (or as far as the greedy needed) at a padding cost.

    With ``elementwise``, the per-bucket element-wise term (``_elementwise_term``) changes each
    matrix's cost on its NS cell, floored at 0 (the MILP needs non-negative costs); at TP > 1 the
    other cells of the DP row do not see it. (Counting only Muon's element-wise work, without
    the displaced AdamW, gave slower plans in all three emulated layouts: docs/load_balancing.md.)"""
    from .milp import OwnerProblem, solve_owner_milp

    options = dict(options or {})
    padding_weight = options.pop("padding_weight", 0.0)
    mats, adjusted, greedy_cells, shard_min, shard_max = [], [], [], [], []
    greedy_cost = list(rank_cost)
    for b, members in enumerate(buckets):
        in_bucket = [i for i in members if items[i].is_matrix]
        lo = min_shard(items, members, world_size)
        owners, tp_owners = _assign_owners(items, members, world_size, greedy_cost, tp_size, elementwise=elementwise)
        used = [0] * world_size
        for i in in_bucket:
            used[owners[items[i].name]] += align_up(items[i].numel)
        shard_min.append(lo)
        shard_max.append(max(int(lo * (1.0 + max_bucket_padding)), max(used) - PARAM_ALIGN, lo))
        per_element = _elementwise_term(items, members, world_size, elementwise)
        for i in in_bucket:
            mats.append((i, b))
            adjusted.append(max(items[i].cost + per_element * items[i].numel, 0.0))
            greedy_cells.append(owners[items[i].name] * tp_size + tp_owners[items[i].name])
    groups = [items[i].shape_key or items[i].name for i, _ in mats]
    launch: Dict[str, float] = {}
    for (i, _), g in zip(mats, groups):
        launch[g] = max(launch.get(g, 0.0), items[i].launch_cost)
    problem = OwnerProblem(
        per_matrix=adjusted,
        numel=[align_up(items[i].numel) for i, _ in mats],
        group=groups, bucket=[b for _, b in mats], launch=launch, dp_size=world_size, tp_size=tp_size,
        shard_min=shard_min, shard_max=shard_max, slack=PARAM_ALIGN, base=list(rank_cost),
        padding_weight=padding_weight)
    solution = solve_owner_milp(problem, warm_starts=[greedy_cells], **options)
    if info is not None:
        info.update(backend=solution.backend, status=solution.status, makespan=solution.makespan,
                    lower_bound=solution.lower_bound, seconds=solution.seconds, note=solution.note)
    rank_cost[:] = solution.loads
    owners, tp_owners = {}, {}
    for (i, _), c in zip(mats, solution.cells):
        owners[items[i].name], tp_owners[items[i].name] = divmod(c, tp_size)
    return owners, tp_owners


def _place_bucket(items, members, owners, world_size, start) -> Tuple[Dict[str, Tuple[int, int]], int]:
    """Lay out one bucket; returns ({name: (start, end)}, shard_size)."""
    mats_of = [[] for _ in range(world_size)]
    fillers = []
    for i in members:
        (mats_of[owners[items[i].name]] if items[i].is_matrix else fillers).append(i)
    block = [sum(align_up(items[i].numel) for i in m) for m in mats_of]
    total = sum(items[i].numel for i in members)
    shard = align_up(max(math.ceil(total / world_size), max(block)), 1)
    while True:
        placed = _try_pour(items, mats_of, block, fillers, world_size, start, shard)
        if placed is not None:
            return placed, shard
        shard += max(PARAM_ALIGN, shard // 64)  # grow a little and retry


def _try_pour(items, mats_of, block, fillers, world_size, start, shard):
    """Pour filler params in order through the buffer; place each rank's matrix block inside its
    shard as soon as the next filler would no longer leave room for it."""
    pos: Dict[str, Tuple[int, int]] = {}
    cursor = start
    f = 0
    for r in range(world_size):
        lo, hi = shard_range(r, shard, start)
        # fillers that fit before this rank's block
        while f < len(fillers):
            n = items[fillers[f]].numel
            s = align_up(cursor) if cursor > lo or r == 0 else cursor
            s = max(s, cursor)
            if s + n + (block[r] + (PARAM_ALIGN if block[r] else 0)) <= hi:
                pos[items[fillers[f]].name] = (s, s + n)
                cursor = s + n
                f += 1
            else:
                break
        if block[r]:
            s = max(align_up(cursor), lo)
            for i in mats_of[r]:
                pos[items[i].name] = (s, s + items[i].numel)
                s = align_up(s + items[i].numel)
            cursor = s
            if cursor > hi:
                return None
    # remaining fillers go at the end (the last shard) if room is left
    while f < len(fillers):
        n = items[fillers[f]].numel
        s = cursor
        if s + n > start + world_size * shard:
            return None
        pos[items[fillers[f]].name] = (s, s + n)
        cursor = s + n
        f += 1
    return pos


def plan_owner_layout(
    items: Sequence[ParamItem],
    world_size: int,
    bucket_size: Optional[int] = None,
    max_bucket_padding: float = 0.02,
    rank_cost: Optional[List[float]] = None,
    tp_size: int = 1,
    balance: str = "cost",  # planning/balance.py LAYOUT_RULES
    milp_options: Optional[dict] = None,
    info: Optional[dict] = None,
    elementwise: Optional[Tuple[float, float]] = None,
) -> OwnerLayout:
    """Compute the owner plan and owner-aligned layout of one buffer.

    `rank_cost` (one entry per DP x TP cell) carries load across buffers (several buffers share
    the same ranks' NS time). Items are this TP rank's shards; their `cost` is the full matrix's.
    `milp_options` go to ``planning.milp.solve_owner_milp`` (backend, time_limit_s, max_variables)
    plus ``padding_weight`` (cost per element of shard growth); `info`, if given, receives the
    MILP's backend, status, makespan, lower bound and solve time. Element-wise params over half a
    shard that leave a bucket padded by more than half get buckets of their own when that pads
    less (``_oversized_fillers``). `elementwise = (adamw, muon)`: element-wise optimizer work per
    parameter element of each, in `cost`'s units (None: NS cost only;
    ``planning.cost_model.elementwise_costs``); the greedy's loads in `rank_cost` then include
    every rank's element-wise work as its layout holds it (``_bucket_loads``). `balance`: one of
    planning/balance.py's ``LAYOUT_RULES`` ('matrix_milp': the matrix MILP, planning/milp.py; the
    rank MILP is planning/rank_milp.py's ``plan_rank_owner_layout``).
    """
    if balance not in LAYOUT_RULES:
        raise ValueError(f"balance {balance!r} unknown; valid: {', '.join(LAYOUT_RULES)}")
    rank_cost = check_plan_inputs(items, world_size, tp_size, rank_cost, elementwise)
    args = (world_size, bucket_size, max_bucket_padding, tp_size, balance, milp_options, elementwise)
    carried = list(rank_cost)
    layout = plan_layout_once(items, rank_cost, info, *args)
    # A huge element-wise param (a 152k-row embedding) fits only between two owners' matrix
    # blocks, so the shard grows until the gap holds it (x2.8 the buffer for Qwen2.5-7B at DP=64).
    # Where that pads a bucket by more than half, such params get buckets of their own (if that
    # pads less; layouts padded less are left as they are).
    big = _oversized_fillers(items, layout)
    if big:
        alone = [dataclasses.replace(it, own_bucket=True) if it.name in big else it for it in items]
        cost, alone_info = list(carried), {}
        split = plan_layout_once(alone, cost, alone_info, *args)
        if split.numel < layout.numel:
            layout = split
            rank_cost[:] = cost
            if info is not None:
                info.update(alone_info)
    return layout


def check_plan_inputs(items, world_size, tp_size, rank_cost, elementwise) -> List[float]:
    """Refuse what no plan can be made of; returns ``rank_cost`` (zeros per cell when None)."""
    if elementwise is not None and (len(elementwise) != 2 or min(elementwise) < 0):
        raise ValueError(f"elementwise must be (adamw, muon) costs per element, both >= 0; got {elementwise}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    names = [it.name for it in items]
    if len(set(names)) != len(names):
        raise ValueError("parameter names in a buffer must be unique")
    for it in items:
        if it.numel <= 0:
            raise ValueError(f"parameter {it.name} has numel {it.numel}; expected > 0")
    rank_cost = rank_cost if rank_cost is not None else [0.0] * (world_size * tp_size)
    if len(rank_cost) != world_size * tp_size:
        raise ValueError(f"rank_cost has {len(rank_cost)} entries, expected world_size x tp_size = {world_size * tp_size}")
    return rank_cost


def own_bucket_items(items, world_size, bucket_size, max_bucket_padding, tp_size, rank_cost, elementwise):
    """``items`` with the element-wise params that pad a bucket by more than half (a 152k-row
    embedding at large DP) in buckets of their own, where the greedy's layouts pad less that way
    (the rule ``plan_owner_layout`` applies after planning, decided here before: for a planner
    that spends its time limit once)."""
    greedy = (world_size, bucket_size, max_bucket_padding, tp_size, "cost", None, elementwise)
    together = plan_layout_once(items, list(rank_cost), None, *greedy)
    big = _oversized_fillers(items, together)
    if not big:
        return items
    alone = [dataclasses.replace(it, own_bucket=True) if it.name in big else it for it in items]
    return alone if plan_layout_once(alone, list(rank_cost), None, *greedy).numel < together.numel else items


def _oversized_fillers(items, layout, pad_limit=0.5):
    """Element-wise params over half a shard in buckets padded by more than ``pad_limit``."""
    out = set()
    for it in items:
        if it.is_matrix or it.own_bucket:
            continue
        b = layout.buckets[layout.param_ranges[it.name][2]]
        if it.numel > b.shard_size // 2 and b.end - b.start > (1 + pad_limit) * b.numel_unpadded:
            out.add(it.name)
    return out


def plan_layout_once(items, rank_cost, info, world_size, bucket_size, max_bucket_padding, tp_size, balance,
                     milp_options, elementwise):
    """One pass of ``plan_owner_layout``: buckets, owners under ``balance`` and the assembled layout
    (``plan_owner_layout`` may run it twice, with oversized element-wise params in buckets of their
    own; planning/rank_milp.py runs it for each greedy warm start)."""
    owners: Dict[str, int] = {}
    tp_owners: Dict[str, int] = {}
    buckets_members = split_buckets(items, bucket_size, world_size, max_bucket_padding)
    placed: Dict[int, tuple] = {}  # bucket -> (placement, shard) already made while planning
    method = BalanceMethod(balance)
    if method.solves_milp:  # the matrix MILP (planning/balance.py)
        owners, tp_owners = _milp_owners(items, buckets_members, world_size, rank_cost, tp_size, max_bucket_padding,
                                         milp_options, info, elementwise)
    else:
        rule = method.lpt_cost
        assign_items = [dataclasses.replace(it, cost=rule(it)) for it in items] if rule else items
        load = [0.0] * len(rank_cost) if rule else rank_cost
        counted = elementwise if method.counts_elementwise else None
        offset = 0
        for b, members in enumerate(buckets_members):
            base = list(load)
            bucket_owners, bucket_tp_owners = _assign_owners(
                assign_items, members, world_size, load, tp_size, method.in_turn,
                assigned=len(owners), elementwise=counted)
            if counted:  # the loads this bucket's layout really gives, for the next buckets
                loads, pos, shard = _bucket_loads(items, members, bucket_owners, bucket_tp_owners, world_size, tp_size,
                                                  base, counted, offset)
                rank_cost[:], placed[b] = loads, (pos, shard)
                offset += shard * world_size
            owners.update(bucket_owners)
            tp_owners.update(bucket_tp_owners)
        if rule:  # the loads the plan really gives, in the run's own costs
            for it in items:
                if it.is_matrix:
                    rank_cost[owners[it.name] * tp_size + tp_owners[it.name]] += it.cost
    return assemble_layout(items, buckets_members, owners, tp_owners, world_size, tp_size, rank_cost, placed)


def assemble_layout(items, buckets_members, owners, tp_owners, world_size, tp_size, rank_cost, placed=None,
                    validate=True):
    """The owner-aligned layout of ``owners`` (each bucket placed by ``_place_bucket`` unless
    ``placed`` holds its placement already), validated unless ``validate`` is False (a trial the
    caller will not keep)."""
    buckets: List[BucketLayout] = []
    param_ranges: Dict[str, Tuple[int, int, int]] = {}
    start = 0
    for b, members in enumerate(buckets_members):
        bucket_owners = {items[i].name: owners[items[i].name] for i in members if items[i].is_matrix}
        pos, shard = (placed or {}).get(b) or _place_bucket(items, members, bucket_owners, world_size, start)
        for name, (s, e) in pos.items():
            param_ranges[name] = (s, e, b)
        end = start + shard * world_size
        buckets.append(BucketLayout(start=start, end=end, numel_unpadded=sum(items[i].numel for i in members), shard_size=shard))
        start = end
    layout = OwnerLayout(world_size, param_ranges, owners, buckets, list(rank_cost), tp_size, tp_owners)
    if validate:
        layout.validate(items)
    return layout
