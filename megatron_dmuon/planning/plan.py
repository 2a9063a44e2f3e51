"""The DMuon plan: every per-matrix decision of a run, made once, frozen, and read by everything else.

``DMuonPlan`` holds one ``MatrixRecord`` per trainable parameter of a DDP-wrapped model chunk
(Muon or AdamW and why, full and local shape, the pieces NS runs on, DP and TP owner, TP method,
NS method and schedule per piece, predicted cost) and the owner-aligned bucket layout of each
buffer (``OwnerLayout``). The Megatron glue builds it (``megatron/ddp.py``), the DDP carries
it as its only DMuon object, and the optimizer builder, the owner step's registration,
checkpoints, FP8 publish and the planner CLI read it. Plain data: serialisable to JSON (what
checkpoints record and ``dmuon-plan`` prints) and validated on construction.
"""
from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Dict, Mapping, Optional, Sequence, Tuple

from ..algorithms.splitting import SplitRule
from .owner_layout import OwnerLayout, ParamItem

PLAN_FORMAT = 1


def _shape(values) -> Tuple[int, ...]:
    return tuple(int(v) for v in values)


@dataclasses.dataclass(frozen=True)
class MatrixRecord:
    """One trainable parameter of the plan: how DMuon treats it, decided once."""

    name: str  # the parameter's name in its model chunk
    buffer: str  # the DDP buffer holding it (``BufferKey`` as a string)
    expert: bool  # in an expert-parallel buffer (expert-DP x expert-TP owners)
    numel: int  # elements this rank holds (its TP shard)
    local_shape: Tuple[int, ...]
    full_shape: Tuple[int, ...]  # the whole matrix (TP shards merged)
    use_muon: bool
    reason: str  # why Muon or AdamW (``planning.params.muon_routing``)
    own_bucket: bool = False  # e.g. Megatron's shared embedding: a bucket of its own
    # Muon matrices only ------------------------------------------------------------------
    split: Optional[SplitRule] = None  # how the full matrix is cut before NS (None: whole)
    pieces: Tuple[Tuple[int, ...], ...] = ()  # the shapes NS runs on
    ns_methods: Tuple[str, ...] = ()  # per piece: the requested method ('auto' resolves per device)
    schedules: Tuple[dict, ...] = ()  # per piece: NS coefficients / steps / normalisation
    partition_dim: Optional[int] = None  # TP: 0 rows split, 1 cols split, None: whole on every TP rank
    partition_stride: int = 1
    # DP rank that runs its NS: under the 'whole' layout its shard holds the whole matrix, under the
    # 'split' layout (planning/split_layout.py) it is the matrix's NS home
    dp_owner: Optional[int] = None
    tp_owner: int = 0  # TP rank that orthogonalizes it
    tp_method: str = ""  # 'gather' or 'distributed_gram' (planning/tp_cost.py)
    cost: float = 0.0  # predicted NS cost of the full matrix (FLOPs, or ms when profiled)
    launch_cost: float = 0.0

    @property
    def shape_key(self) -> str:
        """Matrices with equal keys batch in one NS call (the owner batches full matrices)."""
        return "x".join(map(str, self.full_shape))

    def param_item(self) -> ParamItem:
        """The owner planner's view of this record."""
        return ParamItem(name=self.name, numel=self.numel, is_matrix=self.use_muon, cost=self.cost,
                         shape_key=self.shape_key, own_bucket=self.own_bucket, launch_cost=self.launch_cost,
                         pieces=tuple(tuple(p) for p in self.pieces) if self.use_muon else ())

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["split"] = dataclasses.asdict(self.split) if self.split is not None else None
        return _jsonable(d)

    @classmethod
    def from_dict(cls, d: dict) -> "MatrixRecord":
        d = dict(d)
        d["split"] = SplitRule(**d["split"]) if d.get("split") else None
        d["local_shape"], d["full_shape"] = _shape(d["local_shape"]), _shape(d["full_shape"])
        d["pieces"] = tuple(_shape(p) for p in d.get("pieces", ()))
        d["ns_methods"] = tuple(d.get("ns_methods", ()))
        d["schedules"] = tuple(_frozen(s) for s in d.get("schedules", ()))
        return cls(**d)


def _jsonable(value):
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _frozen(value):
    if isinstance(value, Mapping):
        return {k: _frozen(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class DMuonPlan:
    """Every per-matrix decision and the bucket layout of one DDP-wrapped model chunk."""

    records: Tuple[MatrixRecord, ...]
    layouts: Mapping[str, OwnerLayout]  # buffer -> owner-aligned layout (owners, ranges, buckets)
    settings: Mapping  # the DMuonConfig summary the plan was made from (``DMuonConfig.plan_summary``)
    ranks_per_node: int = 0  # > 0: two-level reduce/publish with node-striped owners
    publish_dtype: str = "param"  # how the param all-gather publishes Muon matrices
    format: int = PLAN_FORMAT
    # the complete DMuonConfig the plan was made from, in this process (not serialised: a plan
    # read back from JSON has None); the optimizer builds from it, so the run parses flags once
    config: object = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "records", tuple(self.records))
        object.__setattr__(self, "layouts", MappingProxyType(dict(self.layouts)))
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        self.validate()

    # ------------------------------------------------------------------------------ views
    def record(self, name: str) -> MatrixRecord:
        return self._by_name()[name]

    def _by_name(self) -> Dict[str, MatrixRecord]:
        cached = self.__dict__.get("_names")
        if cached is None:
            cached = {r.name: r for r in self.records}
            object.__setattr__(self, "_names", cached)
        return cached

    def matrices(self) -> Tuple[MatrixRecord, ...]:
        """The Muon matrices, in buffer order."""
        return tuple(r for r in self.records if r.use_muon)

    def buffer_records(self, buffer: str) -> Tuple[MatrixRecord, ...]:
        return tuple(r for r in self.records if r.buffer == buffer)

    # ------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """The invariants every reader relies on (also under ``python -O``)."""

        def require(ok, msg):
            if not ok:
                raise ValueError(f"DMuon plan is inconsistent: {msg}")

        names = [r.name for r in self.records]
        require(len(set(names)) == len(names), "parameter names repeat")
        require(set(r.buffer for r in self.records) <= set(self.layouts), "a record names an unknown buffer")
        for key, layout in self.layouts.items():
            records = self.buffer_records(key)
            layout.validate([r.param_item() for r in records])
            require(set(layout.param_ranges) == {r.name for r in records}, f"buffer {key}: layout and records differ")
            for r in records:
                if r.use_muon:
                    require(layout.owners.get(r.name) == r.dp_owner, f"{r.name}: DP owner differs from the layout")
                    require(layout.tp_owners.get(r.name, 0) == r.tp_owner, f"{r.name}: TP owner differs from the layout")
                    require(len(r.pieces) == len(r.ns_methods) == len(r.schedules) >= 1,
                            f"{r.name}: pieces, NS methods and schedules do not match")
                    require(r.tp_method in ("gather", "distributed_gram"), f"{r.name}: TP method {r.tp_method!r}")
                else:
                    require(r.dp_owner is None and not r.pieces, f"{r.name}: an AdamW param with Muon decisions")
        require(self.publish_dtype in ("param", "fp8_e4m3", "fp8_e5m2"), f"publish dtype {self.publish_dtype!r}")
        require(self.ranks_per_node >= 0, "ranks_per_node < 0")

    # ---------------------------------------------------------------------- serialisation
    def to_json(self) -> str:
        return json.dumps({
            "format": self.format, "settings": _jsonable(dict(self.settings)),
            "ranks_per_node": self.ranks_per_node, "publish_dtype": self.publish_dtype,
            "records": [r.to_dict() for r in self.records],
            "layouts": {k: json.loads(v.to_json()) for k, v in self.layouts.items()},
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DMuonPlan":
        d = json.loads(text)
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"DMuon plan format {d.get('format')!r} is not {PLAN_FORMAT} (written by another version)")
        return cls(records=tuple(MatrixRecord.from_dict(r) for r in d["records"]),
                   layouts={k: OwnerLayout.from_json(json.dumps(v)) for k, v in d["layouts"].items()},
                   settings=d["settings"], ranks_per_node=d["ranks_per_node"], publish_dtype=d["publish_dtype"])

    def routing_summary(self) -> str:
        """One line: how many matrices and elements go to Muon and to AdamW, by the rule that sent
        them there (``planning.params.muon_routing``), so no fallback goes unseen."""
        groups: Dict[Tuple[bool, str], list] = {}
        for r in self.records:
            groups.setdefault((r.use_muon, r.reason), []).append(r.numel)
        parts = []
        for use_muon in (True, False):
            rules = sorted((k[1], v) for k, v in groups.items() if k[0] == use_muon)
            if rules:
                total = sum(len(v) for _, v in rules)
                detail = "; ".join(f"{len(v)} {why} ({sum(v):,} elements)" for why, v in rules)
                parts.append(f"{total} params to {'Muon' if use_muon else 'AdamW'}: {detail}")
        return "DMuon routing: " + " | ".join(parts)

    def layout_summary(self) -> str:
        """One line: each buffer's DP layout (whole / split, planning/split_layout.py), with how many
        matrices the split layout cuts and on how many ranks their NS homes are."""
        parts = []
        for key, layout in sorted(self.layouts.items()):
            matrices = [n for n in layout.owners]
            if layout.scheme == "split":
                cut = sum(len(layout.pieces(n)) > 1 for n in matrices)
                homes = len(set(layout.owners.values()))
                parts.append(f"{key}: split over {layout.world_size} DP ranks ({cut} of {len(matrices)} matrices cut, "
                             f"NS homes on {homes} ranks)")
            else:
                parts.append(f"{key}: whole matrices on {len(set(layout.owners.values()))} of {layout.world_size} "
                             "DP ranks")
        return "DMuon DP layout: " + "; ".join(parts)

    def describe(self) -> str:
        """One line per Muon matrix, then a summary: what ``dmuon-plan`` prints for a built model."""
        lines = []
        for r in self.records:
            if not r.use_muon:
                continue
            pieces = ", ".join("x".join(map(str, p)) for p in r.pieces)
            lines.append(f"{r.name}: {'x'.join(map(str, r.full_shape))} -> [{pieces}] DP owner {r.dp_owner} "
                         f"TP owner {r.tp_owner} ({r.tp_method}) NS {'/'.join(sorted(set(r.ns_methods)))}")
        adam = sum(not r.use_muon for r in self.records)
        lines.append(f"{len(self.matrices())} Muon matrices, {adam} AdamW params, {len(self.layouts)} buffers")
        return "\n".join(lines)


def merged_records(records: Sequence[MatrixRecord], layouts: Mapping[str, OwnerLayout]) -> Tuple[MatrixRecord, ...]:
    """``records`` with each Muon matrix's DP and TP owner filled in from its buffer's layout."""
    out = []
    for r in records:
        if r.use_muon:
            layout = layouts[r.buffer]
            r = dataclasses.replace(r, dp_owner=layout.owners[r.name], tp_owner=layout.tp_owners.get(r.name, 0))
        out.append(r)
    return tuple(out)
