"""Which NS schedule, how many steps: errors vs the exact polar factor on gradient-like spectra.

    python bench/ns_schedules.py [--out-dir docs/results/ns_schedules] [--gpu] [--reps 20]

Part 1 (CPU, float64, exact arithmetic: ``algorithms.schedules.spectrum_error``): for the
Qwen2.5-7B shapes and five spectrum families, the error ``‖NS(X) − U Vᵀ‖_F / ‖U Vᵀ‖_F`` of the
Frobenius schedules (published 5-step Polar Express, the 6-step continued design) and of the
quartic-normalised per-shape schedules (``schedule_for_shape``). Families: ``gauss`` (the
singular values of a Gaussian matrix of that shape), ``pow0.5`` / ``pow1`` (σᵢ ∝ i^-0.5, i^-1: the
second is a stress case), ``spike3`` / ``spike30`` (a rank-32 signal 3x / 30x above a Gaussian
bulk, the shape of a noisy gradient with a few strong directions).

Part 2 (``--gpu``): the same matrices built as ``U diag(σ) Vᵀ`` in float32 (so ``U Vᵀ`` is known
exactly), orthogonalized by the kernels in fp16 (Gram NS for aspect ≥ 2, standard below), with
the Frobenius schedules and with the quartic ones with and without the Gram restart; error and
median time of one batch of 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dmuon.algorithms.coefficients import get_coefficients  # noqa: E402
from megatron_dmuon.algorithms.schedules import POLAR_EXPRESS_6, schedule_for_shape, spectrum_error  # noqa: E402

SHAPES = {"q/o": (3584, 3584), "k/v": (512, 3584), "gate/up, down": (3584, 18944)}
FAMILIES = ("gauss", "pow0.5", "spike3", "spike30", "pow1")


def spectra(m: int, n: int, device) -> dict[str, torch.Tensor]:
    """Singular values (descending, float64) of each family for an m x n (m <= n) matrix."""
    g = torch.Generator(device=device).manual_seed(m * 7 + n)
    x = torch.randn(m, n, dtype=torch.float64, device=device, generator=g)
    gauss = torch.linalg.eigvalsh(x @ x.T).clamp(min=0).sqrt().flip(0).cpu()
    i = torch.arange(1, m + 1, dtype=torch.float64)
    out = {"gauss": gauss, "pow0.5": i ** -0.5, "pow1": i ** -1.0}
    for ratio in (3, 30):
        s = gauss / gauss[0]
        s[:32] = (ratio * torch.arange(1, 33, dtype=torch.float64) ** -0.5).clamp(min=1.0)
        out[f"spike{ratio}"] = s.sort(descending=True).values
    return out


def frobenius_schedule(m: int, n: int) -> dict:
    """What 'adaptive' was before the quartic normalisation: 6 designed steps near square, else 5."""
    if max(m, n) / min(m, n) < 1.05:
        return {"coefficients": POLAR_EXPRESS_6, "steps": 6, "normalisation": "frobenius"}
    return {"coefficients": get_coefficients("polar_express", 5), "steps": 5, "normalisation": "frobenius"}


def exact_table(device) -> list[dict]:
    rows = []
    for name, (m, n) in SHAPES.items():
        fams = spectra(m, n, device)
        for label, sched in (("frobenius (PE 5, or 6 near square)", frobenius_schedule(m, n)),
                             ("published PE 5, frobenius", {"coefficients": get_coefficients("polar_express", 5),
                                                             "steps": 5, "normalisation": "frobenius"}),
                             ("quartic (adaptive)", schedule_for_shape(m, n))):
            coeffs = get_coefficients(sched["coefficients"], sched["steps"])
            errs = {f: spectrum_error(fams[f], coeffs, sched["normalisation"]) for f in FAMILIES}
            rows.append({"shape": name, "schedule": label, "steps": sched["steps"], **errs})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def gpu_table(reps: int) -> list[dict]:
    from megatron_dmuon.kernels import orthogonalize_batched
    from megatron_dmuon.kernels.autotune import time_cuda_ms

    dev = torch.device("cuda")
    rows = []
    for name, (m, n) in SHAPES.items():
        fams = spectra(m, n, dev)
        g = torch.Generator(device=dev).manual_seed(1)
        U = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, device=dev, generator=g))[0]
        V = torch.linalg.qr(torch.randn(n, m, dtype=torch.float64, device=dev, generator=g))[0]
        polar = (U @ V.T).float()
        method = "gram" if n / m >= 2 else "standard"
        variants = {"frobenius": dict(frobenius_schedule(m, n)),
                    "quartic": dict(schedule_for_shape(m, n))}
        if method == "gram":
            variants["frobenius"]["restart_after"] = (2,)
            variants["quartic_restart2"] = dict(schedule_for_shape(m, n), restart_after=(2,))
            variants["quartic_no_restart"] = dict(schedule_for_shape(m, n), restart_after=())
            del variants["quartic"]
        for fam in FAMILIES:
            s = fams[fam].to(dev)
            x = ((U * s) @ V.T).float()
            stack = torch.stack([x, x])
            for label, kw in variants.items():
                out = orthogonalize_batched(stack, method, compute_dtype=torch.float16, **kw)
                err = float((out[0].double() - polar.double()).norm() / polar.double().norm())
                ms = time_cuda_ms(lambda: orthogonalize_batched(stack, method, compute_dtype=torch.float16, **kw),
                                  min_reps=reps, max_reps=reps)
                rows.append({"shape": name, "family": fam, "variant": label, "method": method, "steps": kw["steps"],
                             "rel_err": err, "exact_arith_err": spectrum_error(fams[fam], get_coefficients(kw["coefficients"], kw["steps"]), kw["normalisation"]),
                             "finite": bool(torch.isfinite(out).all()), "ms_batch2": ms})
                print(json.dumps(rows[-1]), flush=True)
        del U, V, polar
        torch.cuda.empty_cache()
    return rows


def markdown(report: dict) -> str:
    lines = ["## Exact arithmetic (float64 spectra)", "",
             "| shape | schedule | steps | " + " | ".join(FAMILIES) + " |", "|---|---|---:|" + "---:|" * len(FAMILIES)]
    for r in report["exact"]:
        lines.append(f"| {r['shape']} | {r['schedule']} | {r['steps']} | " + " | ".join(f"{r[f]:.3f}" for f in FAMILIES) + " |")
    if report.get("gpu"):
        lines += ["", f"## fp16 kernels on {report.get('device', 'GPU')} (batch of 2; error of matrix 0)", "",
                  "| shape | family | variant | steps | error | exact-arithmetic | ms |", "|---|---|---|---:|---:|---:|---:|"]
        for r in report["gpu"]:
            lines.append(f"| {r['shape']} | {r['family']} | {r['variant']} | {r['steps']} | {r['rel_err']:.4f} | "
                         f"{r['exact_arith_err']:.4f} | {r['ms_batch2']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda" if args.gpu else "cpu")
    report = {"exact": exact_table(device)}
    if args.gpu:
        report["device"] = torch.cuda.get_device_name()
        report["gpu"] = gpu_table(args.reps)
    text = markdown(report)
    print(text)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = "ns_schedules_gpu" if args.gpu else "ns_schedules"
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
        (out / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
