"""What each update rule of the owners (``MuonSettings.update``) needs, in the one place that compares
its names.

'muon' is algorithms/muon.py's rule; 'normuon' and 'dion3' are the row rules of algorithms/dion3.py
(run by runtime/row_update_step.py). Every other module asks an ``UpdateRule`` instead of comparing
the strings (tests/test_layers.py keeps it so), as planning/overlap_mode.py does for the overlapped
step.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, get_args

UpdateRuleName = Literal["muon", "normuon", "dion3"]
UPDATE_RULES: tuple[str, ...] = get_args(UpdateRuleName)
# Dion3's share of rows when none is given (microsoft/dion's NorDion2 default)
DEFAULT_DION3_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    name: str = "muon"

    def __post_init__(self):
        if self.name not in UPDATE_RULES:
            raise ValueError(f"update rule {self.name!r} unknown; valid: {', '.join(UPDATE_RULES)}")

    @property
    def by_rows(self) -> bool:
        """A row rule (NorMuon, Dion3): each matrix's rows are selected and normalized whole, with one
        second moment per row (``row_beta2``), so the matrix must be whole on its owner (no TP shards,
        no split layout, no per-group overlapped step) and its momentum stays in the param dtype."""
        return self.name != "muon"

    @property
    def selects_fraction(self) -> bool:
        """Orthogonalizes a fraction of each matrix's rows (Dion3): ``fraction`` and ``fraction_lr``
        apply; its momentum is M + G with error feedback, which has no Nesterov form."""
        return self.name == "dion3"

    @property
    def default_fraction(self) -> float:
        """The share of rows orthogonalized per step when none is given."""
        return DEFAULT_DION3_FRACTION if self.selects_fraction else 1.0
