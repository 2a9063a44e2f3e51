"""Error metrics for orthogonalization results (used by tests, docs and kernel checks).

NS does not produce the exact polar factor: it applies a fixed polynomial schedule to each
singular value, which (a) lands converged values in a band around 1 whose width depends on the
coefficient set and (b) leaves values far below 1 unconverged. So one number is not enough:

``fro``    ``‖Y − UVᵀ‖_F / ‖UVᵀ‖_F`` — distance to the exact polar factor, whole matrix.
``wc``     ``‖U_kᵀ Y V_k − I_k‖_2`` over the *well-conditioned* singular pairs,
           ``s_i ≥ wc_threshold·‖x‖_F`` (default 0.01: every named set lifts these into its
           final band within 5 steps). Captures band width plus rounding noise there.
``round``  ``‖Y − NS_exact(x)‖_F / ‖NS_exact(x)‖_F`` — pure rounding error, against the same
           polynomial schedule applied to the exact singular values in float64.
``band``   the exact-arithmetic ``wc`` of the schedule: ``max |p_T(s) − 1|`` over the
           normalised singular values above the threshold.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .coefficients import CoefficientSpec, get_coefficients
from .newton_schulz import NS_EPS

__all__ = [
    "orthogonalization_errors",
    "schedule_map",
    "ill_conditioned_matrix",
    "heavy_tailed_matrix",
    "scale_bias",
    "DOCUMENTED_BOUNDS",
    "documented_bound",
    "schedule_peak",
    "orthogonality_overshoot",
]

# Asserted error bounds per (method, compute dtype), 5 steps, safety 1.01; valid for every named
# coefficient set. ``wc_excess``: allowed ``wc − band`` (rounding on top of the schedule's own
# band); ``round_gauss`` / ``round_cond``: ``round`` on Gaussian / cond-1e4 matrices. Each is
# about 1.5–3× the worst value measured by bench/ns.py accuracy (docs/algorithms.md lists them).
DOCUMENTED_BOUNDS: dict[tuple[str, str], dict[str, float]] = {
    ("standard", "float64"): {"wc_excess": 1e-10, "round_gauss": 1e-12, "round_cond": 1e-12},
    ("gram", "float64"): {"wc_excess": 1e-10, "round_gauss": 1e-11, "round_cond": 1e-11},
    ("standard", "float32"): {"wc_excess": 1e-4, "round_gauss": 2e-5, "round_cond": 2e-5},
    ("gram", "float32"): {"wc_excess": 1e-3, "round_gauss": 3e-4, "round_cond": 3e-4},
    ("standard", "bfloat16"): {"wc_excess": 0.01, "round_gauss": 0.04, "round_cond": 0.3},
    ("gram", "bfloat16"): {"wc_excess": 0.06, "round_gauss": 0.2, "round_cond": 0.5},
    ("standard", "float16"): {"wc_excess": 0.002, "round_gauss": 0.005, "round_cond": 0.03},
    ("gram", "float16"): {"wc_excess": 0.01, "round_gauss": 0.03, "round_cond": 0.06},
}


def documented_bound(method: str, dtype: torch.dtype, key: str) -> float:
    """Look up ``DOCUMENTED_BOUNDS`` by torch dtype (e.g. ``torch.bfloat16``)."""
    return DOCUMENTED_BOUNDS[(method, str(dtype).removeprefix("torch."))][key]


def schedule_map(s: Tensor, coefficients: CoefficientSpec = "keller", steps: int = 5,
                 safety: float = 1.01) -> Tensor:
    """Apply the NS polynomial schedule to (normalised) singular values ``s``."""
    for a, b, c in get_coefficients(coefficients, steps, safety):
        s2 = s * s
        s = s * (a + s2 * (b + c * s2))
    return s


def orthogonalization_errors(
    x: Tensor,
    y: Tensor,
    coefficients: CoefficientSpec = "keller",
    steps: int = 5,
    safety: float = 1.01,
    eps: float = NS_EPS,
    wc_threshold: float = 0.01,
) -> dict[str, float]:
    """Metrics of ``y ≈ NS(x)`` for one matrix ``x`` (see module docstring); worst case over a
    stack if ``x`` is ``[..., r, c]``."""
    if x.shape != y.shape or x.ndim < 2:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be same-shape matrices")
    x64 = x.to(torch.float64).reshape(-1, *x.shape[-2:])
    y64 = y.to(torch.float64).reshape(-1, *y.shape[-2:])
    U, S, Vh = torch.linalg.svd(x64, full_matrices=False)
    norm = torch.linalg.matrix_norm(x64).clamp(min=eps).unsqueeze(-1)
    s = S / norm
    mapped = schedule_map(s, coefficients, steps, safety)
    keep = S > max(x.shape[-2:]) * torch.finfo(torch.float64).eps * S[:, :1]
    polar = (U * keep.unsqueeze(-2)) @ Vh
    exact = (U * mapped.unsqueeze(-2)) @ Vh
    out = {"fro": 0.0, "wc": 0.0, "round": 0.0, "band": 0.0}
    for i in range(x64.size(0)):
        out["fro"] = max(out["fro"], float((y64[i] - polar[i]).norm() / polar[i].norm().clamp(min=1e-300)))
        out["round"] = max(out["round"], float((y64[i] - exact[i]).norm() / exact[i].norm().clamp(min=1e-300)))
        k = int((s[i] >= wc_threshold).sum())
        if k:
            block = U[i, :, :k].mT @ y64[i] @ Vh[i, :k].mT
            eye = torch.eye(k, dtype=torch.float64)
            out["wc"] = max(out["wc"], float(torch.linalg.matrix_norm(block - eye, ord=2)))
            out["band"] = max(out["band"], float((mapped[i, :k] - 1).abs().max()))
    return out


def ill_conditioned_matrix(rows: int, cols: int, cond: float,
                           generator: torch.Generator | None = None) -> Tensor:
    """``U diag(s) Vᵀ`` (float64) with Haar-random ``U, V`` and ``s`` geometric from 1 to 1/cond."""
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=generator))
    V, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=generator))
    s = torch.logspace(0.0, -float(torch.log10(torch.tensor(float(cond)))), k, dtype=torch.float64)
    return (U * s) @ V.T


def heavy_tailed_matrix(rows: int, cols: int, seed: int, spikes: int = 0, scale: float = 1.0,
                        device="cpu") -> Tensor:
    """``U diag(σ) Vᵀ`` (float32) shaped like real Nesterov momenta: σ_i = scale·(1 + (i−1)/3)^−1.6
    (σ_2 ≈ 0.6, 10th percentile 0.08, median 0.015 of σ_1), the first ``spikes`` values 30x larger."""
    g = torch.Generator(device=device).manual_seed(seed)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64, device=device))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64, device=device))
    sigma = (1 + torch.arange(k, dtype=torch.float64, device=device) / 3) ** -1.6
    sigma[:spikes] *= 30
    return ((U * (scale * sigma)) @ V.T).float()


def scale_bias(out: Tensor, exact: Tensor) -> float:
    """⟨Y, Y_exact⟩ / ‖Y_exact‖² − 1: a lean of the whole result that unbiased rounding would not give."""
    return float((out * exact).sum() / (exact * exact).sum() - 1)


def schedule_peak(coefficients: CoefficientSpec = "keller", steps: int = 5, safety: float = 1.01) -> float:
    """The largest singular value the schedule can give in exact arithmetic: the maximum of its
    composed polynomial over normalised singular values in [0, 1] (every normalisation puts them
    there). Keller's set: 1.20; 'you': 1.15; Polar Express: 1.12; the adaptive 4-step set: 1.01."""
    s = torch.linspace(0.0, 1.0, 100001, dtype=torch.float64)
    return float(schedule_map(s, coefficients, steps, safety).max())


def orthogonality_overshoot(orthogonalized: Tensor, probes: int = 2, iterations: int = 8,
                            generator: torch.Generator | None = None) -> Tensor:
    """Per matrix of ``orthogonalized`` ([..., m, n]), a random-probe estimate of the top eigenvalue
    of ``OᵀO − I`` (= σ_max(O)² − 1): ``probes`` random vectors, ``iterations`` steps of block power
    iteration on ``O Oᵀ`` in the small dimension, the largest Rayleigh quotient kept. The estimate
    never exceeds the true value (a Rayleigh quotient), and a blown-up direction, the failure of a
    half-precision NS, dominates the iteration within a few steps. The negative side of
    ``OᵀO − I`` (singular values NS has not lifted to 1 yet) is NS's own in exact arithmetic too and
    not measured. Costs ``4·iterations·probes·m·n`` FLOPs per matrix, in float32."""
    O = orthogonalized.reshape(-1, orthogonalized.size(-2), orthogonalized.size(-1)).float()
    if O.size(-2) > O.size(-1):
        O = O.mT
    if O.numel() == 0:
        return torch.zeros(orthogonalized.shape[:-2], dtype=torch.float32, device=orthogonalized.device)
    # probes drawn on the CPU (a CPU generator, or torch's default one): the same on every device
    v = torch.randn(O.size(0), O.size(-2), probes, dtype=torch.float32, generator=generator).to(O.device)
    top = torch.zeros(O.size(0), device=O.device)
    for _ in range(iterations):
        v = v / v.norm(dim=-2, keepdim=True).clamp(min=1e-30)
        w = O @ (O.mT @ v)  # (O Oᵀ) v
        quotient = torch.nan_to_num((v * w).sum(-2).amax(-1), nan=float("inf"))  # NaN output: unbounded
        top = torch.maximum(top, quotient)  # Rayleigh quotients of unit probes
        v = torch.nan_to_num(w, nan=0.0, posinf=1e30, neginf=-1e30)
    return (top - 1.0).reshape(orthogonalized.shape[:-2])
