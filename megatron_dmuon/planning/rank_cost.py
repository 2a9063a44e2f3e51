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
* ``shape_shared[s]`` and ``shared_ms``: a step of several shapes does not pay each shape's
  stack whole. Each stack's points hold a part that another shape's work covers (the step's own
  host work, and the launches of a small stack, which run while the GPU is busy with a large one):
  ``shape_shared[s]``; the step then pays ``shared_ms`` once. A rank of several shapes costs
  ``shared_ms + sum(max(0, stack(s) - shape_shared[s]))``, never less than its largest stack
  (a negative part: shapes that slow each other down).
  One constant for every shape (format 1: ``shape_shared`` = ``shared_ms``), from one pair step,
  missed the H100's slowest 4-shape GPUs of the Qwen 4-layer model by -13%..-32%: a 512x3584
  stack beside a 3584x3584 one was covered almost whole (~3 ms), two large stacks shared ~1 ms. Fitted by least squares on steps of several
  shapes (``multi``: all of a layout's shapes at an even share, and each leave-one-out of them).
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

import copy
import dataclasses
from collections import Counter
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .cost_model import CostModel, DeviceSpec, ShapeCost, device_spec, fit_affine, load_config, shape_key

__all__ = ["RankWork", "RankCostModel", "piece_counts", "multi_name", "multi_counts", "FORMAT"]

FORMAT = 2  # 2: shape_shared; format 1 files load as shape_shared = shared_ms
READABLE_FORMATS = (1, 2)
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
    pure Python); a column the earlier ones already explain (no variation of its own, to 1e-9 of
    its norm) gets 0."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    norms = [a[i][i] for i in range(n)]
    for i in range(n):  # Gauss-Jordan with partial pivoting
        p = max(range(i, n), key=lambda r: abs(a[r][i]))
        if abs(a[p][i]) <= 1e-9 * norms[i] or abs(a[p][i]) < 1e-30:
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
    shape_shared: Dict[Key, float] = dataclasses.field(default_factory=dict)  # absent shape: shared_ms

    def __post_init__(self):
        self.stacks = {shape_key(s): sorted((int(k), float(t)) for k, t in pts) for s, pts in self.stacks.items()}
        self.shape_shared = {shape_key(s): float(v) for s, v in self.shape_shared.items()}
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

    def shared_of(self, shape: Sequence[int]) -> float:
        """The part of ``shape``'s stack that another shape's work in the same step covers."""
        return self.shape_shared.get(shape_key(shape), self.shared_ms)

    def muon_ms(self, pieces: Mapping[Sequence[int], int]) -> float:
        parts = {shape_key(s): self.stack_ms(s, k) for s, k in pieces.items() if k > 0}
        if len(parts) <= 1:
            return sum(parts.values())
        paid = self.shared_ms + sum(max(0.0, t - self.shared_of(s)) for s, t in parts.items())
        return max(paid, max(parts.values()))  # more work in a step never makes it faster

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
            mixed: Sequence[Tuple[Key, int, int, int, float]] = (),
            multi: Sequence[Tuple[Mapping[Sequence[int], int], float]] = (), **kw) -> "RankCostModel":
        """From measured steps: ``stacks`` (Muon-only), ``adamw`` (AdamW-only), ``multi`` ({shape:
        k}, ms of a Muon-only step of several shapes: the shared parts; ``pairs`` (a, ka, b, kb,
        ms) are two-shape ones), ``mixed`` (shape, k, AdamW elements, fragments, ms: the hidden
        fraction)."""
        model = cls(dict(stacks), list(adamw), **kw)
        steps = [({a: ka, b: kb}, t) for a, ka, b, kb, t in pairs] + [(dict(c), t) for c, t in multi]
        model.fit_shared(steps)
        hidden = []
        for s, k, e, f, t in mixed:
            muon, adam = model.stack_ms(s, k), model.adamw_ms(e, f)
            if min(muon, adam) > 0:
                hidden.append((muon + adam - t) / min(muon, adam))
        model.hidden = min(1.0, max(0.0, sum(hidden) / len(hidden))) if hidden else 0.0
        model.meta.setdefault("source", "measured")
        model.meta.update(mixed_points=len(hidden))
        return model

    def fit_shared(self, steps: Sequence[Tuple[Mapping[Sequence[int], int], float]], holdout: bool = True) -> None:
        """``shared_ms`` and ``shape_shared`` by least squares on Muon-only steps of several shapes
        ({shape: k}, ms): each gives shared_ms - sum of its shapes' shared parts = ms - sum of its
        stacks. Solved for the step's part and each shape's difference from it: a difference the
        steps cannot tell (two shapes measured only together) stays 0, which with one pair is the
        format-1 constant. A part is negative where a step of several shapes costs more than its
        stacks apart (the H100's Qwen2.5-32B rank: +3 ms on 44, in two runs); the step's part stays
        within +-the cheapest one-matrix stack, a shape's within +-its stack in the steps (no shape
        costs less than nothing, or more than twice its stack)."""
        steps = [({shape_key(s): int(k) for s, k in c.items() if k > 0}, float(t)) for c, t in steps]
        steps = [(c, t) for c, t in steps if len(c) >= 2]
        self.shape_shared = {}
        if not steps:
            self.shared_ms = 0.0
            self.meta.update(multi_points=0)
            return
        shapes = sorted({s for c, _ in steps for s in c})
        # shape s's part = step part + its difference: a step of shapes P gives
        # (1 - |P|) x step part - sum of P's differences = ms - sum of P's stacks
        rows = [[1.0 - len(c)] + [-1.0 if s in c else 0.0 for s in shapes] for c, _ in steps]
        ys = [t - sum(self.stack_ms(s, k) for s, k in c.items()) for c, t in steps]
        step_part, *differences = _least_squares(rows, ys)
        cheapest = min(self.stack_ms(s, 1) for s in shapes)
        bounded = min(max(-cheapest, step_part), cheapest)
        if bounded != step_part:  # at its bound, the differences fitted again around it
            step_part = bounded
            differences = _least_squares([r[1:] for r in rows], [y - r[0] * step_part for r, y in zip(rows, ys)])
        self.shared_ms = step_part
        for s, difference in zip(shapes, differences):
            largest = max(self.stack_ms(s, c[s]) for c, _ in steps if s in c)
            self.shape_shared[s] = min(max(-largest, step_part + difference), largest)
        errors = [self.muon_ms(c) / t - 1.0 for c, t in steps if t > 0]
        self.meta.update(multi_points=len(steps), multi_error=max(map(abs, errors), default=0.0))
        if holdout:  # in-sample error is 0 wherever the steps just determine the parts (the H100's 4-shape
            # profiles: 5 steps, 5 parts), so the model's error is also measured on each step left out
            self.meta["multi_holdout_error"] = self._holdout_error(steps)

    def _holdout_error(self, steps) -> float:
        """The worst miss on a multi-shape step of a model fitted without it (0 with fewer than 2)."""
        worst = 0.0
        for i, (c, t) in enumerate(steps):
            others = steps[:i] + steps[i + 1:]
            if not others or t <= 0:
                continue
            refit = copy.copy(self)
            refit.meta = dict(self.meta)
            refit.fit_shared(others, holdout=False)
            worst = max(worst, abs(refit.muon_ms(c) / t - 1.0))
        return worst

    def to_json(self) -> dict:
        return {"format": FORMAT, "meta": self.meta, "shared_ms": self.shared_ms, "hidden": self.hidden,
                "shape_shared": {f"{m}x{n}": v for (m, n), v in sorted(self.shape_shared.items())},
                "stacks": {f"{m}x{n}": [list(p) for p in pts] for (m, n), pts in sorted(self.stacks.items())},
                "adamw": [list(p) for p in self.adamw_points], "device": self.device.name if self.device else None,
                "muon_ms_per_element": self.muon_ms_per_element, "steps": self.steps, "ns_method": self.ns_method}

    @classmethod
    def from_json(cls, data: dict, config: Optional[dict] = None) -> "RankCostModel":
        if data.get("format") not in READABLE_FORMATS:
            raise ValueError(f"rank cost model format {data.get('format')!r}, expected one of {READABLE_FORMATS} "
                             "(written by another version: measure again)")
        stacks = {_key(key): [(int(k), float(t)) for k, t in pts] for key, pts in data["stacks"].items()}
        device = device_spec(data["device"], config) if data.get("device") else None
        return cls(stacks, [tuple(p) for p in data["adamw"]], float(data["shared_ms"]), float(data["hidden"]),
                   device, dict(data.get("meta", {})), float(data.get("muon_ms_per_element", 0.0)),
                   int(data.get("steps", 5)), data.get("ns_method", "auto"),
                   {_key(key): float(v) for key, v in data.get("shape_shared", {}).items()})

    @classmethod
    def from_calibration(cls, result: dict, device: Optional[DeviceSpec] = None) -> "RankCostModel":
        """From ``bench/rank_balance.py calibrate``'s JSON or the start-up profile's points (its
        ``jobs``: ns|MxN|k, pair|MxN|k|MxN|k, multi|MxN:k|MxN:k|..., adamw|..., mix|...)."""
        stacks: Dict[Key, List[Tuple[int, float]]] = {}
        adamw, pairs, mixed, multi = [], [], [], []
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
            elif kind == "multi":
                multi.append((multi_counts(name), ms))
        return cls.fit(stacks, adamw, pairs, mixed, multi, device=device,
                       meta={"source": "calibration", "device": result.get("device"), "flags": result.get("flags")})


def multi_name(counts: Mapping[Sequence[int], int]) -> str:
    """The job name of a Muon-only step of several shapes: multi|MxN:k|... (shapes sorted)."""
    return "multi|" + "|".join(f"{m}x{n}:{k}" for (m, n), k in sorted((shape_key(s), int(k)) for s, k in counts.items()))


def multi_counts(name: str) -> Dict[Key, int]:
    return {_key(field.split(":")[0]): int(field.split(":")[1]) for field in name.split("|")[1:]}


def _key(text: str) -> Key:
    m, n = (int(v) for v in text.split("x"))
    return shape_key((m, n))
