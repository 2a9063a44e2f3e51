"""What one rank's whole owner step costs: the model the owner MILP minimises the slowest rank of.

A rank's owner step (runtime/owner_step.py) runs, in one ``step()``: the momentum pass of every
matrix it owns, one batched NS stack per distinct piece shape (all stacks in one CUDA graph), the
apply pass; and torch's fused AdamW over the element-wise fragments inside its shards, on a side
stream. The per-matrix NS cost model (planning/cost_model.py) predicts only the NS, shape by shape,
and missed the measured slowest rank by 10-30% on the emulated layouts (docs/load_balancing.md).
This model predicts the step from measurements of the step itself:

* ``stacks[s]``: (k, ms) points of a Muon-only step of k matrices of piece shape s (momentum, NS
  and apply of the stack together, as the runtime batches it). Between points the time is
  interpolated linearly, past the last one extrapolated along the last segment: the stack cost
  against its count is what it measures, wave quantisation and launch amortisation included.
* ``shared_ms``: the part of a step every shape's points contain once, but a rank with several
  shapes pays once (the step's own host work and synchronisation): the measured
  t(a) + t(b) - t(a and b) of a two-shape step.
* ``adamw``: (elements, fragments, ms) points of an AdamW-only step, fitted to
  ``a0 + a1 x elements + a2 x fragments``.
* ``hidden``: the fraction of the shorter of the two (Muon, AdamW) that runs under the longer one
  (the side stream beside the NS), measured on mixed steps. A rank then costs
  ``muon + adamw - hidden x min(muon, adamw)``.

``RankCostModel.analytic`` builds the same model from the cluster config when nothing was measured
(CPU, profiling off): NS from ``CostModel``'s analytic costs plus Muon's element-wise bytes, AdamW
from its bytes at the HBM rate, nothing hidden. Pure data: the measurements come from
runtime/rank_profile.py (start-up) or bench/rank_balance.py (calibration).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .cost_model import CostModel, DeviceSpec, ShapeCost, device_spec, fit_affine, load_config, shape_key

__all__ = ["RankWork", "RankCostModel", "piece_counts", "analytic_rank_model", "FORMAT"]

FORMAT = 1
Key = Tuple[int, int]


def piece_counts(pieces: Iterable[Sequence[int]]) -> Counter:
    """Matrices per piece shape (orientation-free) of NS pieces: a 2-D piece is one matrix, a
    [heads, rows, cols] piece ``heads`` of them."""
    out: Counter = Counter()
    for p in pieces:
        out[shape_key(p[-2:])] += int(p[0]) if len(p) == 3 else 1
    return out


@dataclasses.dataclass
class RankWork:
    """One rank's owner step: NS matrices per piece shape, its AdamW elements and fragments."""

    pieces: Counter = dataclasses.field(default_factory=Counter)
    adamw_elements: int = 0
    fragments: int = 0

    def add_matrix(self, pieces: Iterable[Sequence[int]]) -> None:
        self.pieces.update(piece_counts(pieces))

    def add_fragments(self, sizes: Iterable[int]) -> None:
        for n in sizes:
            self.adamw_elements += int(n)
            self.fragments += 1


def _interpolate(points: Sequence[Tuple[int, float]], k: float) -> float:
    """Piecewise-linear through (0, 0) and ``points`` (sorted by k); past the last point along the
    last segment (never decreasing)."""
    if k <= 0:
        return 0.0
    pts = [(0.0, 0.0)] + [(float(a), float(b)) for a, b in points]
    for (k0, t0), (k1, t1) in zip(pts, pts[1:]):
        if k <= k1:
            return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
    (k0, t0), (k1, t1) = pts[-2], pts[-1]
    return t1 + max(0.0, (t1 - t0) / (k1 - k0)) * (k - k1)


def _least_squares(rows: List[List[float]], ys: List[float]) -> List[float]:
    """Solve the normal equations of a small dense least-squares problem (no numpy: planning is
    pure Python); columns with no variation get 0."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    for i in range(n):  # Gauss-Jordan with partial pivoting
        p = max(range(i, n), key=lambda r: abs(a[r][i]))
        if abs(a[p][i]) < 1e-30:
            a[i] = [0.0] * n
            a[i][i], b[i] = 1.0, 0.0
            continue
        a[i], a[p], b[i], b[p] = a[p], a[i], b[p], b[i]
        for r in range(n):
            if r != i and a[r][i]:
                f = a[r][i] / a[i][i]
                a[r] = [x - f * y for x, y in zip(a[r], a[i])]
                b[r] -= f * b[i]
    return [b[i] / a[i][i] for i in range(n)]


@dataclasses.dataclass
class RankCostModel:
    """Predicted owner-step ms of a rank from its ``RankWork`` (see the module docstring)."""

    stacks: Dict[Key, List[Tuple[int, float]]]
    adamw_points: List[Tuple[int, int, float]]
    shared_ms: float = 0.0
    hidden: float = 0.0
    device: Optional[DeviceSpec] = None  # rates for shapes and passes nothing measured
    meta: Dict[str, object] = dataclasses.field(default_factory=dict)
    muon_ms_per_element: float = 0.0  # analytic Muon element-wise pass (unmeasured shapes only)
    steps: int = 5
    ns_method: str = "auto"

    def __post_init__(self):
        self.stacks = {shape_key(s): sorted((int(k), float(t)) for k, t in pts) for s, pts in self.stacks.items()}
        if not 0.0 <= self.hidden <= 1.0:
            raise ValueError(f"hidden must be in [0, 1], got {self.hidden}")
        self.adamw_fit = self._fit_adamw()
        self._ns = CostModel(self.device, None, self.steps, self.ns_method) if self.device is not None else None
        self._rate = self._measured_rate()

    # -- fits --------------------------------------------------------------------------------
    def _fit_adamw(self) -> Tuple[float, float, float]:
        pts = [(float(e), float(f), float(t)) for e, f, t in self.adamw_points]
        if not pts:
            if self.device is None:
                return (0.0, 0.0, 0.0)
            per = load_config()["optimizer"]["adamw_bytes_per_param"] / (self.device.hbm_gbytes_per_s * 1e9) * 1e3
            return (0.0, per, 0.0)
        rows = [[1.0, e, f] for e, f, _ in pts]
        a0, a1, a2 = _least_squares(rows, [t for *_, t in pts])
        return (max(a0, 0.0), max(a1, 0.0), max(a2, 0.0))

    def _measured_rate(self) -> Optional[float]:
        """ms per NS FLOP of the measured stacks' largest points (for unmeasured shapes)."""
        from .params import ns_flops

        flops = ms = 0.0
        for (m, n), pts in self.stacks.items():
            k, t = pts[-1]
            flops += k * ns_flops(m, n, self.steps, self.ns_method)
            ms += t
        return ms / flops if flops else None

    # -- predictions -------------------------------------------------------------------------
    def stack_ms(self, shape: Sequence[int], k: int) -> float:
        """A Muon-only step of ``k`` matrices of ``shape`` (shared part included)."""
        key = shape_key(shape)
        if k <= 0:
            return 0.0
        pts = self.stacks.get(key)
        if pts:
            return _interpolate(pts, k)
        return self._unmeasured_stack_ms(key, k)

    def _unmeasured_stack_ms(self, key: Key, k: int) -> float:
        from .params import ns_flops

        elements = k * key[0] * key[1]
        if self._rate is not None:  # at the measured stacks' rate
            return self.shared_ms + k * ns_flops(*key, self.steps, self.ns_method) * self._rate \
                + elements * self.muon_ms_per_element
        if self._ns is None:
            raise ValueError(f"the rank cost model has no points for shape {key} and no device to predict it")
        return self.shared_ms + self._ns.time_ms(key, k) + elements * self.muon_ms_per_element

    def adamw_ms(self, elements: int, fragments: int) -> float:
        if elements <= 0 and fragments <= 0:
            return 0.0
        a0, a1, a2 = self.adamw_fit
        return a0 + a1 * elements + a2 * fragments

    def muon_ms(self, pieces: Mapping[Sequence[int], int]) -> float:
        parts = [self.stack_ms(s, k) for s, k in pieces.items() if k > 0]
        if not parts:
            return 0.0
        return sum(parts) - self.shared_ms * (len(parts) - 1)

    def rank_ms(self, work: RankWork) -> float:
        muon = self.muon_ms(work.pieces)
        adamw = self.adamw_ms(work.adamw_elements, work.fragments)
        return muon + adamw - self.hidden * min(muon, adamw)

    def shape_cost(self, shape: Sequence[int]) -> ShapeCost:
        """An affine (launch + k x per-matrix) view of one shape's stack, for planners that take
        per-matrix costs (the greedy; ``CostModel``'s interface)."""
        key = shape_key(shape)
        pts = self.stacks.get(key) or [(k, self._unmeasured_stack_ms(key, k)) for k in (1, 2)]  # affine there
        return fit_affine(pts, 0.0)

    def per_matrix_ms(self, shape) -> float:
        return self.shape_cost(shape).per_matrix_ms

    def launch_ms(self, shape) -> float:
        return self.shape_cost(shape).launch_ms

    def time_ms(self, shape, batch: int) -> float:
        return self.stack_ms(shape, batch)

    def source(self, shape) -> str:
        return "profile" if shape_key(shape) in self.stacks else "analytic"

    def unmeasured(self, shapes: Iterable[Sequence[int]], adamw: bool) -> List[str]:
        """What a measured model lacks for a plan of these piece shapes (and AdamW fragments, if
        ``adamw``): shapes without a point, AdamW without one. An analytic model lacks nothing
        (it measures nothing by design)."""
        if self.meta.get("source") == "analytic":
            return []
        gaps = sorted({f"{m}x{n}" for m, n in map(shape_key, shapes) if (m, n) not in self.stacks})
        return gaps + (["AdamW"] if adamw and not self.adamw_points else [])

    def elementwise_ms(self) -> Tuple[float, float]:
        """(AdamW, Muon) ms per element as the greedy weighs them (``plan_owner_layout``'s
        ``elementwise``): AdamW's fitted rate less the part hidden beside the NS; Muon's passes
        are inside the measured stacks, so 0 here."""
        return (self.adamw_fit[1] * (1.0 - self.hidden), 0.0)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def analytic(cls, device: DeviceSpec, steps: int = 5, ns_method: str = "auto",
                 config: Optional[dict] = None) -> "RankCostModel":
        opt = (config or load_config())["optimizer"]
        muon = opt["muon_bytes_per_param"] / (device.hbm_gbytes_per_s * 1e9) * 1e3
        return cls({}, [], device=device, muon_ms_per_element=muon, steps=steps, ns_method=ns_method,
                   meta={"source": "analytic", "device": device.name})

    @classmethod
    def fit(cls, stacks: Mapping[Sequence[int], Sequence[Tuple[int, float]]],
            adamw: Sequence[Tuple[int, int, float]], pairs: Sequence[Tuple[Key, int, Key, int, float]] = (),
            mixed: Sequence[Tuple[Key, int, int, int, float]] = (), **kw) -> "RankCostModel":
        """From measured steps: ``stacks`` (Muon-only), ``adamw`` (AdamW-only), ``pairs`` (a, ka,
        b, kb, ms of a two-shape step: the shared part), ``mixed`` (shape, k, AdamW elements,
        fragments, ms: the hidden fraction)."""
        model = cls(dict(stacks), list(adamw), **kw)
        shared = [model.stack_ms(a, ka) + model.stack_ms(b, kb) - t for a, ka, b, kb, t in pairs]
        model.shared_ms = max(0.0, sum(shared) / len(shared)) if shared else 0.0
        hidden = []
        for s, k, e, f, t in mixed:
            muon, adam = model.stack_ms(s, k), model.adamw_ms(e, f)
            if min(muon, adam) > 0:
                hidden.append((muon + adam - t) / min(muon, adam))
        model.hidden = min(1.0, max(0.0, sum(hidden) / len(hidden))) if hidden else 0.0
        model.meta.setdefault("source", "measured")
        model.meta.update(shared_points=len(shared), mixed_points=len(hidden))
        return model

    def to_json(self) -> dict:
        return {"format": FORMAT, "meta": self.meta, "shared_ms": self.shared_ms, "hidden": self.hidden,
                "stacks": {f"{m}x{n}": [list(p) for p in pts] for (m, n), pts in sorted(self.stacks.items())},
                "adamw": [list(p) for p in self.adamw_points], "device": self.device.name if self.device else None,
                "muon_ms_per_element": self.muon_ms_per_element, "steps": self.steps, "ns_method": self.ns_method}

    @classmethod
    def from_json(cls, data: dict, config: Optional[dict] = None) -> "RankCostModel":
        if data.get("format") != FORMAT:
            raise ValueError(f"rank cost model format {data.get('format')!r}, expected {FORMAT}")
        stacks = {tuple(int(v) for v in key.split("x")): [(int(k), float(t)) for k, t in pts]
                  for key, pts in data["stacks"].items()}
        device = device_spec(data["device"], config) if data.get("device") else None
        return cls(stacks, [tuple(p) for p in data["adamw"]], float(data["shared_ms"]), float(data["hidden"]),
                   device, dict(data.get("meta", {})), float(data.get("muon_ms_per_element", 0.0)),
                   int(data.get("steps", 5)), data.get("ns_method", "auto"))

    @classmethod
    def from_calibration(cls, result: dict, device: Optional[DeviceSpec] = None) -> "RankCostModel":
        """From ``bench/rank_balance.py calibrate``'s JSON (its ``jobs``: ns|MxN|k, pair|..., adamw|...,
        mix|...)."""
        stacks: Dict[Key, List[Tuple[int, float]]] = {}
        adamw, pairs, mixed = [], [], []
        for name, job in result["jobs"].items():
            kind, *fields = name.split("|")
            ms = float(job["ms"])
            if kind == "ns":
                stacks.setdefault(_key(fields[0]), []).append((int(fields[1]), ms))
            elif kind == "adamw":
                adamw.append((int(job["adamw_elements"]), int(job["fragments"]), ms))
            elif kind == "pair":
                pairs.append((_key(fields[0]), int(fields[1]), _key(fields[2]), int(fields[3]), ms))
            elif kind == "mix":
                mixed.append((_key(fields[0]), int(fields[1]), int(job["adamw_elements"]), int(job["fragments"]), ms))
        return cls.fit(stacks, adamw, pairs, mixed, device=device,
                       meta={"source": "calibration", "device": result.get("device"), "flags": result.get("flags")})


def _key(text: str) -> Key:
    m, n = (int(v) for v in text.split("x"))
    return shape_key((m, n))


def analytic_rank_model(device_name: str = "H200", steps: int = 5, ns_method: str = "auto") -> RankCostModel:
    return RankCostModel.analytic(device_spec(device_name), steps, ns_method)
