"""Measure NS / Gram NS accuracy per coefficient set and compute dtype (not a test).

Prints JSON (one record per set × dtype × method with the maxima of the metrics of
``megatron_dmuon.algorithms.ns_metrics.orthogonalization_errors`` over the matrices) and a
markdown table. This produced the bound table in docs/algorithms.md.

    python bench/ns_accuracy.py [--seeds 3] [--steps 5]
    python bench/ns_accuracy.py --heavy-tailed 512x3584 3584x18944 [--device cuda]

``--heavy-tailed`` instead runs each NS path an optimizer can take (ours in torch and, on CUDA, in
the kernels; Megatron's emerging_optimizers NS at its 'medium' and 'high' precisions) with the
quintic schedule on matrices shaped like real momenta (σ_i ∝ (1 + (i−1)/3)^−1.6, optionally 4 spikes
30x larger) at the given shapes, and reports each path's rounding error against float64 NS and its
scale bias ⟨Y, Y_exact⟩/‖Y_exact‖² − 1 (a systematic lean that rounding noise alone would not give).
"""
from __future__ import annotations

import argparse
import json

import torch

from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
from megatron_dmuon.algorithms.newton_schulz import newton_schulz
from megatron_dmuon.algorithms.ns_metrics import (heavy_tailed_matrix, ill_conditioned_matrix, orthogonalization_errors,
                                                  scale_bias)

SETS = ("keller", "polar_express", "you")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def matrices(seeds):
    out = []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        for shape in ((96, 160), (160, 96), (128, 128), (64, 256)):
            out.append((f"gauss{shape[0]}x{shape[1]}", torch.randn(*shape, dtype=torch.float64, generator=g)))
        out.append(("cond1e4_96x192", ill_conditioned_matrix(96, 192, 1e4, g)))
        out.append(("cond1e4_192x96", ill_conditioned_matrix(192, 96, 1e4, g)))
    return out


def ns_paths(device) -> dict:
    """name -> f(x float32) for every NS path of the quintic schedule ('you' = Megatron's 'quintic')."""
    kw = dict(coefficients="you", steps=5)
    paths = {
        "ours torch standard fp32": lambda x: newton_schulz(x, compute_dtype=torch.float32, **kw),
        "ours torch standard bf16": lambda x: newton_schulz(x, compute_dtype=torch.bfloat16, **kw),
        "ours torch gram fp16": lambda x: gram_newton_schulz(x, compute_dtype=torch.float16, **kw),
    }
    if torch.device(device).type == "cuda":
        from megatron_dmuon.kernels.ns_driver import gram_newton_schulz_fast, newton_schulz_fast
        paths["ours kernels standard bf16"] = lambda x: newton_schulz_fast(x, "you", steps=5, compute_dtype=torch.bfloat16)
        paths["ours kernels gram fp16"] = lambda x: gram_newton_schulz_fast(x, "you", steps=5, compute_dtype=torch.float16)
    try:
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz as megatron_ns
    except ImportError:
        return paths

    def megatron(precision):
        def run(x):
            before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(precision)
            try:
                return megatron_ns(x, steps=5, coefficient_type="quintic")
            finally:
                torch.set_float32_matmul_precision(before)
        return run
    paths["Megatron medium (bf16)"] = megatron("medium")
    paths["Megatron high (TF32 on CUDA)"] = megatron("high")
    return paths


def sigma_max(y: torch.Tensor) -> float:
    """Largest singular value through the short side's Gram matrix (an SVD of the long side is slow)."""
    gram = y @ y.mT if y.size(-2) <= y.size(-1) else y.mT @ y
    return float(torch.linalg.eigvalsh(gram).max().clamp_min(0).sqrt())


def heavy_tailed_report(shapes, device, seeds: int) -> list:
    records = []
    paths = ns_paths(device)
    for shape in shapes:
        rows, cols = (int(v) for v in shape.lower().split("x"))
        for spikes in (0, 4):
            for seed in range(seeds):
                x = heavy_tailed_matrix(rows, cols, seed, spikes=spikes, device=device)
                exact = newton_schulz(x.double(), "you", steps=5, compute_dtype=torch.float64)
                for name, f in paths.items():
                    y = f(x).double()
                    records.append({"shape": shape, "spikes": spikes, "seed": seed, "path": name,
                                    "round": float((y - exact).norm() / exact.norm()),
                                    "scale_bias": scale_bias(y, exact),
                                    "sigma_max": sigma_max(y), "sigma_max_exact": sigma_max(exact)})
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--heavy-tailed", nargs="+", default=None, metavar="ROWSxCOLS")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.heavy_tailed:
        records = heavy_tailed_report(args.heavy_tailed, args.device, args.seeds)
        print(json.dumps(records, indent=1))
        print("\n| shape | spikes | path | round error vs float64 NS (max over seeds) | scale bias (mean) | σ_max (exact) |")
        print("|---|---:|---|---:|---:|---:|")
        keys = dict.fromkeys((r["shape"], r["spikes"], r["path"]) for r in records)
        for shape, spikes, path in keys:
            rs = [r for r in records if (r["shape"], r["spikes"], r["path"]) == (shape, spikes, path)]
            print(f"| {shape} | {spikes} | {path} | {max(r['round'] for r in rs):.4f} | "
                  f"{sum(r['scale_bias'] for r in rs) / len(rs):+.2e} | {max(r['sigma_max'] for r in rs):.4f} "
                  f"({max(r['sigma_max_exact'] for r in rs):.4f}) |")
        return
    mats = matrices(args.seeds)
    records = []
    for cs in SETS:
        for dname, dtype in DTYPES.items():
            for method in ("standard", "gram"):
                worst = {}
                for kind in ("gauss", "cond"):
                    agg = {"fro": 0.0, "wc": 0.0, "round": 0.0, "band": 0.0}
                    for name, x in mats:
                        if not name.startswith(kind):
                            continue
                        if method == "standard":
                            y = newton_schulz(x, cs, steps=args.steps, compute_dtype=dtype)
                        else:
                            y = gram_newton_schulz(x, cs, steps=args.steps, compute_dtype=dtype, min_aspect_ratio=1.0)
                        e = orthogonalization_errors(x, y, cs, steps=args.steps)
                        agg = {k: max(agg[k], e[k]) for k in agg}
                    worst[kind] = agg
                records.append({"set": cs, "dtype": dname, "method": method, "steps": args.steps, **{
                    f"{kind}_{k}": v for kind, agg in worst.items() for k, v in agg.items()}})
    print(json.dumps(records, indent=1))
    print()
    print("| set | dtype | method | band | wc gauss | wc cond | round gauss | round cond | fro gauss | fro cond |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['set']} | {r['dtype']} | {r['method']} | {r['gauss_band']:.3g} | {r['gauss_wc']:.3g} | "
              f"{r['cond_wc']:.3g} | {r['gauss_round']:.2g} | {r['cond_round']:.2g} | {r['gauss_fro']:.3g} | "
              f"{r['cond_fro']:.3g} |")


if __name__ == "__main__":
    main()
