"""One Muon matrix as the owner step sees it (``MatrixInfo``: its shapes, split rule, TP and DP placement
and the NS each piece runs), and the NS choices of matrices no plan holds (``with_ns_choices``)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from ..planning.ns_choice import NSChoice, stack_ns_choices
from ..planning.params import check_muon_matrix_shape
from .dp_exchange import SplitMatrix
from .muon_settings import MuonSettings
from .tp_exchange import TPMatrix

__all__ = ["MatrixInfo", "with_ns_choices"]


@dataclasses.dataclass
class MatrixInfo:
    """One Muon matrix as this rank sees it.

    ``shape`` is the full logical [rows, cols] matrix NS runs on; ``local_shape`` the part this
    rank holds (its TP shard; = ``shape`` without TP or for a TP-replicated matrix). ``split``
    applies to the full canonical matrix."""

    name: str
    shape: Tuple[int, int]
    split: Optional[object] = None  # algorithms.splitting.SplitRule, or None = whole matrix
    local_shape: Optional[Tuple[int, int]] = None
    partition_dim: Optional[int] = None  # TP: 0 rows split, 1 cols split, None: whole on every TP rank
    partition_stride: int = 1
    tp_owner: int = 0  # TP rank that orthogonalizes this matrix
    tp_method: str = "gather"  # 'gather' to the TP owner, or 'distributed_gram' (planning/tp_cost.py)
    # per piece, the NS its stack runs (planning.ns_choice, decided from the plan before the first
    # step; ``with_ns_choices`` for matrices no plan holds): required to register the matrix
    ns: Tuple[NSChoice, ...] = ()
    # when the next forward needs it: its DDP bucket group's place in the forward (the overlapped
    # step cuts stacks and finishes them in this order; 0 for every matrix otherwise)
    need: int = 0
    # the split layout (planning/split_layout.py): the DP shards cut this matrix; ``dp_split`` says
    # where every piece lies and which DP rank is its NS home, ``dp_piece`` this rank's [lo, hi) of the
    # flattened TP-local matrix (None: this rank holds none of it, or the matrix is whole here)
    dp_split: Optional[SplitMatrix] = None
    dp_piece: Optional[Tuple[int, int]] = None

    def __post_init__(self):
        self.shape = check_muon_matrix_shape(self.name, self.shape)
        self.local_shape = tuple(self.local_shape or self.shape)

    @property
    def held_shape(self) -> Tuple[int, ...]:
        """The shape of what this rank holds: its piece (1-D) under the split layout, else ``local_shape``."""
        return (self.dp_piece[1] - self.dp_piece[0],) if self.dp_piece is not None else self.local_shape

    @classmethod
    def from_record(cls, record, name: Optional[str] = None, ns: Tuple[NSChoice, ...] = (),
                    need: int = 0) -> "MatrixInfo":
        """The owner step's view of a plan record (``planning.plan.MatrixRecord``) and the NS
        choices of its pieces (``planning.ns_choice.plan_ns_choices``)."""
        return cls(name or record.name, record.full_shape, record.split, local_shape=record.local_shape,
                   partition_dim=record.partition_dim, partition_stride=record.partition_stride,
                   tp_owner=record.tp_owner, tp_method=record.tp_method, ns=tuple(ns), need=need)

    def tp_matrix(self) -> TPMatrix:
        return TPMatrix(self.name, self.tp_owner, self.local_shape[0] * self.local_shape[1],
                        self.partition_dim, self.partition_stride)


def with_ns_choices(infos: Sequence[MatrixInfo], settings: MuonSettings, device) -> List[MatrixInfo]:
    """``infos`` with the NS of every piece decided (``MatrixInfo.ns``), as one owner that steps them
    all together stacks them: for an owner step used without a plan (tests, benchmarks, a plain
    torch training loop). A plan's matrices get theirs from ``planning.ns_choice.plan_ns_choices``."""
    def pieces(info):
        return tuple(tuple(s) for s in info.split.piece_shapes(info.shape)) if info.split is not None \
            else (tuple(info.shape),)

    resolver = settings.ns_resolver(device)
    matrices = [(info.tp_owner, pieces(info), [settings.ns_method] * len(pieces(info)),
                 [settings.ns_schedule(*s[-2:]) for s in pieces(info)], info.tp_method) for info in infos]
    return [dataclasses.replace(info, ns=ns) for info, ns in zip(infos, stack_ns_choices(matrices, resolver))]
