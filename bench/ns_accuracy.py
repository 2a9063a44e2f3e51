"""Measure NS / Gram NS accuracy per coefficient set and compute dtype (not a test).

Prints JSON (one record per set × dtype × method with the maxima of the metrics of
``megatron_dmuon.algorithms.ns_metrics.orthogonalization_errors`` over the matrices) and a
markdown table. This produced the bound table in docs/algorithms.md.

    python bench/ns_accuracy.py [--seeds 3] [--steps 5]
"""
from __future__ import annotations

import argparse
import json

import torch

from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
from megatron_dmuon.algorithms.newton_schulz import newton_schulz
from megatron_dmuon.algorithms.ns_metrics import ill_conditioned_matrix, orthogonalization_errors

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
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
