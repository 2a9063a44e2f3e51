"""What the owner step costs, per Muon matrix shape: cost(shape, batch) = launch + batch x per-matrix.

An owner orthogonalizes all the matrices of one shape in ONE batched call, so a shape group's time
on a rank is affine in the number of its matrices there: a fixed part (the ~20 kernels of one NS
call, whatever the batch) plus a per-matrix part. One more matrix in a batch is cheaper than a new
launch; the MILP planner (planning/milp.py) uses exactly this.

Two sources, one interface (``CostModel.shape_cost``):

* a **profile** (``CostTable``): measured (batch, ms) points per distinct shape, from the start-up
  profiler on the real GPU (runtime/ns_timing.py) or from the kernel benchmark already in the repo
  (``load_bench_kernels_profile``); each shape's points are fitted by ``fit_affine``;
* the **analytic model** for shapes the profile lacks (or with no profile: on CPU, profiling off):
  FLOPs of the NS method the kernels pick (``params.ns_flops``: symmetric-kernel counts) at the
  device's sustained rate, plus the kernel count x a small-kernel floor. With a profile, the rate is
  re-fitted to the profile's large shapes, so unprofiled shapes are predicted at the measured speed.

Device and cluster parameters live in ``clusters.json`` (next to this file, or a path of yours).
Shapes are orientation-free: NS runs on the wide orientation, so (r, c) and (c, r) cost the same.
"""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from ..algorithms.flops import ns_method_for
from .params import ns_flops

__all__ = [
    "DEFAULT_CONFIG", "DeviceSpec", "Link", "ClusterSpec", "ShapeCost", "CostTable", "CostModel",
    "load_config", "device_spec", "device_spec_for", "elementwise_costs", "cluster_spec", "fit_affine", "ns_kernel_count",
    "SPLIT_EXCHANGE_BYTES", "cluster_for_device", "ExchangeCosts", "exchange_costs",
    "analytic_shape_cost", "load_bench_kernels_profile", "shape_key",
]

DEFAULT_CONFIG = Path(__file__).with_name("clusters.json")
RESTARTS = 1  # gram_newton_schulz's default restart_after=(2,) for 5 steps


def load_config(path=None) -> dict:
    from ..files import read_bounded_text

    return json.loads(read_bounded_text(path or DEFAULT_CONFIG, "the cluster config"))


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    ns_tflops: float  # sustained NS rate, in symmetric-kernel FLOPs (algorithms/flops.py, symmetric=True)
    kernel_floor_us: float  # time of one small kernel of an NS call (launch + tail), whatever the batch
    hbm_gbytes_per_s: float  # effective bandwidth of the element-wise optimizer passes


@dataclasses.dataclass(frozen=True)
class Link:
    """Alpha-beta link: a ring collective over p ranks moving S bytes (the full, gathered buffer)
    costs (p - 1) alpha + (p - 1)/p S / beta, beta the ring's bus bandwidth per GPU."""

    alpha_us: float
    gbytes_per_s: float

    def ring_ms(self, ranks: int, total_bytes: float) -> float:
        if ranks <= 1 or total_bytes <= 0:
            return 0.0
        return (ranks - 1) * self.alpha_us * 1e-3 + (ranks - 1) / ranks * total_bytes / (self.gbytes_per_s * 1e6)


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    name: str
    device: DeviceSpec
    gpus_per_node: int
    intra: Link  # NVLink inside a node
    inter: Link  # InfiniBand between nodes, per GPU


def _entry(config: Optional[dict], section: str, name: str) -> Tuple[dict, dict]:
    config = config or load_config()
    table = config[section]
    if name not in table:
        raise ValueError(f"{section[:-1]} {name!r} not in the cluster config; known: {', '.join(sorted(table))}")
    return config, table[name]


def device_spec(name: str, config: Optional[dict] = None) -> DeviceSpec:
    _, d = _entry(config, "devices", name)
    return DeviceSpec(name, float(d["ns_tflops"]), float(d["kernel_floor_us"]), float(d["hbm_gbytes_per_s"]))


def device_spec_for(name: str, config: Optional[dict] = None, warn: bool = True) -> DeviceSpec:
    """The config's device named in ``name`` (e.g. 'H200' in 'NVIDIA H200'), else the first one
    (with a warning when ``warn``)."""
    config = config or load_config()
    for known in config["devices"]:
        if known.lower() in name.lower():
            return device_spec(known, config)
    fallback = next(iter(config["devices"]))
    if warn:
        warnings.warn(f"no cluster-config device matches {name!r}; the analytic part of the cost model uses {fallback}'s",
                      RuntimeWarning)
    return device_spec(fallback, config)


def elementwise_costs(device: DeviceSpec, unit: str = "flops", config: Optional[dict] = None) -> Tuple[float, float]:
    """(AdamW, Muon) element-wise optimizer work per parameter element (the config's
    ``optimizer`` bytes per param at the device's HBM rate), in the planner's cost units:
    ``'flops'`` (NS FLOPs at the device's NS rate) or ``'ms'``; ``plan_owner_layout``'s
    ``elementwise``."""
    opt = (config or load_config())["optimizer"]
    scale = {"flops": device.ns_tflops * 1e12, "ms": 1e3}.get(unit)
    if scale is None:
        raise ValueError(f"unit must be 'flops' or 'ms', got {unit!r}")
    per_byte = scale / (device.hbm_gbytes_per_s * 1e9)
    return opt["adamw_bytes_per_param"] * per_byte, opt["muon_bytes_per_param"] * per_byte


def cluster_spec(name: str, config: Optional[dict] = None) -> ClusterSpec:
    config, c = _entry(config, "clusters", name)
    links = [Link(float(c[k]["alpha_us"]), float(c[k]["gbytes_per_s"])) for k in ("intra", "inter")]
    return ClusterSpec(name, device_spec(c["device"], config), int(c["gpus_per_node"]), *links)


# a split-layout matrix element moved to its NS home (its fp32 Nesterov update) and back (the fp32
# direction): runtime/dp_exchange.py
SPLIT_EXCHANGE_BYTES = 8


def cluster_for_device(device: DeviceSpec, config: Optional[dict] = None) -> ClusterSpec:
    """The config's cluster of ``device`` (the first cluster when none has it)."""
    config = config or load_config()
    name = next((k for k, c in config["clusters"].items() if c["device"] == device.name), next(iter(config["clusters"])))
    return cluster_spec(name, config)


class ExchangeCosts(NamedTuple):
    """Per element, in the planner's units: ``move`` a split-layout matrix element into its NS home and
    its direction back over the home's own links (NVLink: inside its node, or the forwarding hop of a
    piece from another node); ``node_move`` the same element's way into the home's node from another
    node, shared by that node's links (each piece's first hop goes to the home's node-mate on the
    sender's rail, runtime/dp_exchange.py); ``collective`` an element of a padded buffer through the
    param all-gather that publishes the step (the config's param bytes; two-level rings, as
    planning/simulate.collective_ms: inside the node, then across nodes with 1/L of the bytes). The grad
    reduce-scatter runs in the backward and is left out."""

    move: float
    node_move: float
    collective: float  # per element of the whole (padded) buffer: the all-gather that publishes the step


def exchange_costs(device: DeviceSpec, cluster: ClusterSpec, dp: int, tp: int, unit: str = "flops",
                   config: Optional[dict] = None) -> ExchangeCosts:
    """``ExchangeCosts`` for a DP group of ``dp`` ranks at TP ``tp`` on ``cluster`` (``SPLIT_EXCHANGE_BYTES``
    per moved element; the config's grad + param bytes per buffer element)."""
    opt = (config or load_config())["optimizer"]
    scale = {"flops": device.ns_tflops * 1e12, "ms": 1e3}.get(unit)
    if scale is None:
        raise ValueError(f"unit must be 'flops' or 'ms', got {unit!r}")
    per_node = max(cluster.gpus_per_node // tp, 1)  # DP ranks a node
    spans_nodes = dp > per_node
    node_rate = per_node * cluster.inter.gbytes_per_s * 1e9
    local, nodes = min(dp, per_node), -(-dp // per_node)
    ring_per_byte = ((local - 1) / local / (cluster.intra.gbytes_per_s * 1e9)
                     + ((nodes - 1) / nodes / local / (cluster.inter.gbytes_per_s * 1e9) if spans_nodes else 0.0))
    return ExchangeCosts(SPLIT_EXCHANGE_BYTES * scale / (cluster.intra.gbytes_per_s * 1e9),
                         SPLIT_EXCHANGE_BYTES * scale / node_rate if spans_nodes else 0.0,
                         opt["param_bytes"] * scale * ring_per_byte)


@dataclasses.dataclass(frozen=True)
class ShapeCost:
    """Time of k same-shape matrices in one batched NS call on one rank: launch + k x per-matrix."""

    launch_ms: float
    per_matrix_ms: float

    def time_ms(self, k: int) -> float:
        return 0.0 if k <= 0 else self.launch_ms + k * self.per_matrix_ms


def shape_key(shape: Sequence[int]) -> Tuple[int, int]:
    """Orientation-free key (min, max) of a matrix shape."""
    r, c = int(shape[0]), int(shape[1])
    return (min(r, c), max(r, c))


def ns_kernel_count(method: str, steps: int = 5, restarts: int = RESTARTS) -> int:
    """Kernels of one batched NS call (the measured breakdown of
    docs/results/kernels/bench_kernels_h200_2026-11-30.md):
    standard: prep + 3 products per step + cast; Gram: prep, one SYRK per segment, 4T - 3(r+1)
    m x m products, Q X per restart, the final Q X."""
    if method == "standard":
        return 3 * steps + 2
    return 1 + (restarts + 1) + (4 * steps - 3 * (restarts + 1)) + restarts + 1


def analytic_shape_cost(shape: Sequence[int], device: DeviceSpec, steps: int = 5, ns_method: str = "auto",
                        tflops: Optional[float] = None) -> ShapeCost:
    rows, cols = int(shape[0]), int(shape[1])
    method = ns_method_for(rows, cols, steps, ns_method)
    rate = (tflops or device.ns_tflops) * 1e12
    return ShapeCost(launch_ms=ns_kernel_count(method, steps) * device.kernel_floor_us * 1e-3,
                     per_matrix_ms=ns_flops(rows, cols, steps, ns_method, restarts=RESTARTS) / rate * 1e3)


def fit_affine(points: Iterable[Sequence[float]], min_per_matrix_ms: float = 0.0) -> ShapeCost:
    """Least-squares t = a + b k over (k, t) points with a >= 0 and b >= ``min_per_matrix_ms``
    (a floor such as the FLOP time at peak rate: noisy small-shape timings must not make
    matrices free). One distinct batch size: a = 0, b = mean(t / k)."""
    pts = [(float(k), float(t)) for k, t in points]
    if not pts:
        raise ValueError("fit_affine needs at least one (batch, ms) point")
    if any(k < 1 or t < 0 or not math.isfinite(t) for k, t in pts):
        raise ValueError(f"profile points must have batch >= 1 and a finite time >= 0: {pts}")
    n = len(pts)
    mk = sum(k for k, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    var = sum((k - mk) ** 2 for k, _ in pts)
    if var == 0:
        b = max(mt / mk, min_per_matrix_ms)
        return ShapeCost(0.0, b)
    b = sum((k - mk) * (t - mt) for k, t in pts) / var
    b = max(b, min_per_matrix_ms)
    a = mt - b * mk
    if a < 0:  # refit through the origin
        a = 0.0
        b = max(sum(k * t for k, t in pts) / sum(k * k for k, _ in pts), min_per_matrix_ms)
    return ShapeCost(a, b)


@dataclasses.dataclass
class CostTable:
    """Measured NS times: ``points[(m, n)] = [(batch, ms), ...]`` (m <= n) and where they come
    from (``meta``: device, dtype, software versions, NS settings, source). Plain data."""

    meta: Dict[str, object]
    points: Dict[Tuple[int, int], List[Tuple[int, float]]]

    def to_json(self) -> dict:
        return {"meta": self.meta,
                "points": {f"{m}x{n}": [list(p) for p in pts] for (m, n), pts in sorted(self.points.items())}}

    @classmethod
    def from_json(cls, data: dict) -> "CostTable":
        points = {}
        for key, pts in data["points"].items():
            m, n = (int(v) for v in key.split("x"))
            points[shape_key((m, n))] = [(int(k), float(t)) for k, t in pts]
        return cls(dict(data["meta"]), points)

    def add(self, shape, batch: int, ms: float) -> None:
        self.points.setdefault(shape_key(shape), []).append((int(batch), float(ms)))


class CostModel:
    """cost(shape, batch) for one device and NS setting: profile fit where measured, analytic
    (at the profile's measured rate, if any) elsewhere. ``per_matrix_ms`` / ``launch_ms`` are the
    planner's ``ParamItem.cost`` / ``launch_cost``."""

    def __init__(self, device: DeviceSpec, table: Optional[CostTable] = None, steps: int = 5,
                 ns_method: str = "auto"):
        self.device, self.table, self.steps, self.ns_method = device, table, steps, ns_method
        self._fits: Dict[Tuple[int, int], ShapeCost] = {}
        self.tflops = device.ns_tflops
        if table is not None:
            for key, pts in table.points.items():
                floor = ns_flops(*key, steps, ns_method, restarts=RESTARTS) / (2 * device.ns_tflops * 1e12) * 1e3  # half the FLOP time
                self._fits[key] = fit_affine(pts, min_per_matrix_ms=floor)
            self.tflops = self._measured_rate() or device.ns_tflops

    def _measured_rate(self) -> Optional[float]:
        """TFLOP/s of the profile's compute-bound shapes (per-matrix time >= the fixed part)."""
        flops = ms = 0.0
        for key, fit in self._fits.items():
            if fit.per_matrix_ms >= fit.launch_ms:
                flops += ns_flops(*key, self.steps, self.ns_method, restarts=RESTARTS)
                ms += fit.per_matrix_ms
        return flops / (ms * 1e-3) / 1e12 if ms > 0 else None

    def shape_cost(self, shape: Sequence[int]) -> ShapeCost:
        key = shape_key(shape)
        fit = self._fits.get(key)
        if fit is not None:
            return fit
        return analytic_shape_cost(key, self.device, self.steps, self.ns_method, tflops=self.tflops)

    def source(self, shape: Sequence[int]) -> str:
        return "profile" if shape_key(shape) in self._fits else "analytic"

    def per_matrix_ms(self, shape: Sequence[int]) -> float:
        return self.shape_cost(shape).per_matrix_ms

    def launch_ms(self, shape: Sequence[int]) -> float:
        return self.shape_cost(shape).launch_ms

    def time_ms(self, shape: Sequence[int], batch: int) -> float:
        return self.shape_cost(shape).time_ms(batch)


def load_bench_kernels_profile(path, steps: int = 5) -> CostTable:
    """A ``CostTable`` from the kernel benchmark's JSON (``bench/kernels.py``, e.g.
    docs/results/kernels/bench_kernels_h200_2026-11-30.json), our production NS path only:

    * ``autotune`` ``method|...`` entries: the time of the chosen method of one shape group at its
      batch (q,o 3584x3584 b2; k,v 512x3584 b2; gate,up,down 3584x18944 b3);
    * ``shapes``: ``ours_auto_fp16_adaptive`` at batch 8 per shape;
    * ``kv_batch``: 512x3584 at batch 8 (batched) and batch 1 (the looped time / 8).

    Times measured at another step count (the adaptive schedule runs 6 steps on square shapes)
    are scaled to ``steps`` (NS time is linear in the step count)."""
    from ..files import read_bounded_text

    data = json.loads(read_bounded_text(path, "the kernel benchmark JSON"))
    table = CostTable(meta={"device": data.get("device"), "torch": data.get("torch"), "triton": data.get("triton"),
                            "dtype": "float16", "steps": steps, "source": str(path)}, points={})
    for key, entry in data.get("autotune", {}).items():
        if not key.startswith("method|"):
            continue
        fields = key.split("|")  # method|device|sm|MxN|bB|dtype|TS
        m, n = (int(v) for v in fields[3].split("x"))
        batch, entry_steps = int(fields[4][1:]), int(fields[6][1:])
        table.add((m, n), batch, entry["time_ms"][entry["method"]] * steps / entry_steps)
    for row in data.get("shapes", []):
        if row.get("method") == "ours_auto_fp16_adaptive":
            table.add((row["rows"], row["cols"]), row["batch"], row["ms"] * steps / row["steps"])
    kv = data.get("kv_batch", {})
    if "ours_auto_fp16_adaptive" in kv:
        shape, batch, t = (kv["rows"], kv["cols"]), kv["batch"], kv["ours_auto_fp16_adaptive"]
        table.add(shape, batch, t["batched_ms"])
        table.add(shape, 1, t["looped_ms"] / batch)
    return table
