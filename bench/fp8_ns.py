"""[fp8-ns] one-layer measurement: can Newton–Schulz with FP8 products pay on Hopper?

    python bench/fp8_ns.py --device cuda --out docs/results/fp8_ns/fp8_ns_h100     # GPU
    python bench/fp8_ns.py --device cpu --tiny --out /tmp/fp8_tiny                 # smoke

Sections (each with its own time budget, so a lent GPU call ends in time and writes what it has):

* ``products``: the raw products of a Qwen2.5-7B layer's NS (X Xᵀ 3584x18944x3584, B X / Q X
  3584x3584x18944, 3584³) in bf16 (torch.mm) against ``torch._scaled_mm`` e4m3 (GEMM alone on
  pre-quantized operands; per tensor / per row / 1x128 blocks; fast accumulation off and on) and the
  whole ``scaled_fp8_matmul`` (quantization passes included): the ceiling an FP8 NS could reach.
* ``numerics``: every variant on the recorded momenta (tests/data/momenta_tiny_it20.pt) and, on the
  GPU, on low-rank + noise inputs of the real shapes: σ range of the output and relative Frobenius
  distance to float32 NS of the same schedule (the algorithms' torch path).
* ``speed``: one layer's NS (q, o 3584²; k, v 512x3584; gate, up 18944x3584; down 3584x18944, stacked
  by shape as the owner step stacks them; and four layers), interleaved medians (CUDA events,
  ``runtime.ns_timing.time_steps``): the project's default path (``MuonSettings(ns_method='auto',
  coefficients='adaptive')``, its NS choice per stack, ``run_ns``: kernels with autotune) against
  each FP8 variant. The FP8 variants are the torch implementations of algorithms/fp8_products.py, so
  their 16-bit products are plain cuBLAS calls, not the kernels' symmetric ones; the ``torch16``
  row (the same code with no FP8 product) isolates what FP8 itself saves, and ``projected`` = default
  − (torch16 − variant) is that saving moved onto the default path.

Every row names its NS path. JSON + markdown go to ``--out``.{json,md}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dmuon.algorithms.fp8_products import (fp8_gemm, fp8_gram_newton_schulz,  # noqa: E402
                                                    fp8_newton_schulz, quantize_e4m3, scaled_fp8_matmul)
from megatron_dmuon.algorithms.gram_newton_schulz import gram_applies  # noqa: E402
from cli_inputs import OneLineParser, check_device  # noqa: E402
from megatron_dmuon.algorithms.ns_dispatch import method_compute_dtype, orthogonalize  # noqa: E402
from megatron_dmuon.runtime.muon_settings import MuonSettings  # noqa: E402
from megatron_dmuon.runtime.ns_timing import device_name, time_steps  # noqa: E402
from megatron_dmuon.runtime.owner_step import run_ns  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                    "momenta_tiny_it20.pt")
# one Qwen2.5-7B layer as the owner step stacks it: (rows, cols) -> stack size
QWEN_LAYER = {(3584, 3584): 2, (512, 3584): 2, (18944, 3584): 2, (3584, 18944): 1}
TINY_LAYER = {(128, 128): 2, (32, 128): 2, (352, 128): 2, (128, 352): 1}
SETTINGS = MuonSettings(ns_method="auto", coefficients="adaptive")

# name -> (standard-NS options, Gram-NS options, scaling, fast_accum); None = that method's 16-bit path
STD2, STD_APPLY, GRAM_R = dict(products=("gram", "apply"), keep_last=1), dict(products=("apply",), keep_last=1), \
    dict(products=("gram",), keep_last=1)
VARIANTS = {
    "torch16": (dict(products=()), dict(products=()), "row", False),
    "fp8_row_std[A,BX]k1_gram[R]": (STD2, GRAM_R, "row", False),
    "fp8_row_std[BX]k1_gram16": (STD_APPLY, None, "row", False),
    "fp8_row_fast_std[A,BX]k1_gram[R]": (STD2, GRAM_R, "row", True),
    "fp8_tensor_std[A,BX]k1_gram[R]": (STD2, GRAM_R, "tensor", False),
    "fp8_block128_std[A,BX]k1_gram[R]": (STD2, GRAM_R, "block128", False),
    "fp8_row_std[A,BX]k2_gram[R]": (dict(products=("gram", "apply"), keep_last=2), GRAM_R, "row", False),
    "fp8_row_std[A,BX]k0_gram[R,QX]k0": (dict(products=("gram", "apply"), keep_last=0),
                                          dict(products=("gram", "apply"), keep_last=0), "row", False),
    "fp8_row_std16_gram[R,QX]k1": (None, dict(products=("gram", "apply"), keep_last=1), "row", False),
    "fp8_row_std16_gram[R,square]": (None, dict(products=("gram", "square"), keep_last=1), "row", False),
}
SPEED_VARIANTS = ("torch16", "fp8_row_std[A,BX]k1_gram[R]", "fp8_row_std[BX]k1_gram16",
                  "fp8_row_fast_std[A,BX]k1_gram[R]", "fp8_tensor_std[A,BX]k1_gram[R]",
                  "fp8_block128_std[A,BX]k1_gram[R]", "fp8_row_std16_gram[R,QX]k1")


def default_choice(stack):
    """The NSChoice the owner step makes for this stack under SETTINGS (``ns_resolver(device).choice``).
    Off CUDA 'auto' is standard NS; there the method is the one CUDA's FLOP rule picks (Gram where it
    applies), so CPU rows show the numerics of the GPU's methods."""
    rows, cols, batch = stack.size(-2), stack.size(-1), stack.size(0)
    choice = SETTINGS.ns_resolver(stack.device).choice(rows, cols, batch)
    if stack.device.type != "cuda":
        method = "gram" if gram_applies(rows, cols) else "standard"
        choice = dataclasses.replace(choice, method=method, compute_dtype=method_compute_dtype(method, SETTINGS.ns_dtype))
    return choice


def default_ns(stack):
    """The owner step's NS of this stack: its NSChoice, run by ``run_ns``."""
    choice = default_choice(stack)
    return run_ns(stack, choice), f"default: {choice.runs} {str(choice.compute_dtype).replace('torch.', '')}"


def variant_ns(name, emulate=None):
    std, gram, scaling, fast = VARIANTS[name]

    def ns(stack):
        choice = default_choice(stack)
        kw = dict(choice.schedule)
        opts = std if choice.runs == "standard" else gram
        if opts is None:  # this method stays on the default path
            return run_ns(stack, choice)
        fn = fp8_newton_schulz if choice.runs == "standard" else fp8_gram_newton_schulz
        return fn(stack, compute_dtype=choice.compute_dtype, scaling=scaling, fast_accum=fast, emulate=emulate,
                  **opts, **kw)
    return ns


def path_label(name):
    std, gram, scaling, fast = VARIANTS[name]

    def one(o, dtype):
        if o is None:
            return "default kernels"
        if not o["products"]:
            return f"torch {dtype}"
        return f"{dtype}+e4m3[{','.join(o['products'])}] keep_last={o.get('keep_last', 1)}"
    return (f"standard: {one(std, 'bf16')}; gram: {one(gram, 'fp16')}; scaling={scaling}"
            + (", fast accum" if fast else ""))


def fp32_ns(stack):
    choice = default_choice(stack)
    return orthogonalize(stack.float(), method=choice.runs, compute_dtype=torch.float32, check_finite=False,
                         **dict(choice.schedule))


def sigma_range(y):
    """(min σ, max σ) of every matrix of a stack, from the eigenvalues of the small Gram in float64."""
    y = y.double()
    y = y.mT if y.size(-2) > y.size(-1) else y
    ev = torch.linalg.eigvalsh(y @ y.mT).clamp(min=0).sqrt()
    return float(ev.min()), float(ev.max())


def low_rank_noise(rows, cols, batch, device, seed):
    """Momentum-like inputs: rank-64 signal with a decaying spectrum plus 2% Gaussian noise."""
    g = torch.Generator(device=device).manual_seed(seed)
    r = 64
    u = torch.randn(batch, rows, r, device=device, generator=g)
    v = torch.randn(batch, r, cols, device=device, generator=g)
    s = (1 + torch.arange(r, device=device, dtype=torch.float32) / 3) ** -1.6
    signal = (u * s) @ v / (rows * cols) ** 0.5
    noise = torch.randn(batch, rows, cols, device=device, generator=g) / (rows * cols) ** 0.5
    return signal + 0.02 * noise * signal.norm() / noise.norm()


def numerics(args, device, deadline):
    cases = [(f"recorded {k}", x.to(device)) for k, x in torch.load(DATA, map_location="cpu", weights_only=True)["inputs"].items()]
    if device.type == "cuda" and not args.tiny:
        cases += [("low-rank+noise 3584x18944", low_rank_noise(3584, 18944, 1, device, 0)),
                  ("low-rank+noise 3584x3584", low_rank_noise(3584, 3584, 1, device, 1))]
    rows = []
    for label, x in cases:
        ref = fp32_ns(x).double()
        default_path = default_ns(x[:1])[1] + (" (kernels)" if device.type == "cuda" else " (torch path)")
        paths = {"default": lambda s: default_ns(s)[0], **{n: variant_ns(n) for n in VARIANTS}}
        for name, fn in paths.items():
            if time.time() > deadline:
                rows.append({"case": label, "variant": name, "skipped": "time budget"})
                continue
            try:
                y = fn(x).double()
            except Exception as exc:  # noqa: BLE001 - Fp8Unavailable or a product this torch/GPU rejects: recorded, the rest runs
                rows.append({"case": label, "variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            lo, hi = sigma_range(y)
            rel = float(((y - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max())
            rows.append({"case": label, "variant": name, "path": default_path if name == "default" else path_label(name),
                         "sigma_min": lo, "sigma_max": hi, "rel_to_fp32": rel})
        lo, hi = sigma_range(ref)
        rows.append({"case": label, "variant": "fp32 (reference)", "sigma_min": lo, "sigma_max": hi, "rel_to_fp32": 0.0})
    return rows


def products(args, device, deadline):
    if device.type != "cuda":
        return [{"skipped": "products: CUDA only"}]
    shapes = {"X Xt 3584x18944x3584": (3584, 18944, 3584), "B X 3584x3584x18944": (3584, 3584, 18944),
              "square 3584^3": (3584, 3584, 3584)}
    out = []
    for label, (m, k, n) in shapes.items():
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        bt = torch.randn(n, k, device=device, dtype=torch.bfloat16)  # b = bt.t(): column-major
        b = bt.t()
        flop = 2.0 * m * k * n
        calls = {"bf16 torch.mm": lambda: a @ b}
        for scaling in ("tensor", "row", "block128"):
            qa, sa = quantize_e4m3(a, scaling)
            qb, sb = quantize_e4m3(bt, scaling)
            for fast in (False, True):
                calls[f"e4m3 {scaling} GEMM only{' fast' if fast else ''}"] = (
                    lambda qa=qa, sa=sa, qb=qb, sb=sb, s=scaling, f=fast: _gemm_only(qa, sa, qb, sb, s, f))
            calls[f"e4m3 {scaling} incl. quantization"] = (
                lambda s=scaling: scaled_fp8_matmul(a, b, scaling=s, out_dtype=torch.bfloat16))
        times = {c: [] for c in calls}
        for c, fn in list(calls.items()):
            try:
                time_steps(fn, iters=1, warmup=2, device=device)
            except Exception as exc:  # noqa: BLE001 - Fp8Unavailable or a product this torch/GPU rejects: recorded, the rest runs
                out.append({"product": label, "call": c, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                del calls[c], times[c]
        for _ in range(args.rounds):
            if time.time() > deadline:
                break
            for c, fn in calls.items():
                times[c] += time_steps(fn, iters=1, warmup=0, device=device)
        for c, ts in times.items():
            if ts:
                ms = statistics.median(ts)
                out.append({"product": label, "call": c, "ms": ms, "tflops": flop / ms / 1e9, "n": len(ts)})
        del a, bt, b
    return out


def _gemm_only(qa, sa, qb, sb, scaling, fast):
    return fp8_gemm(qa, sa, qb, sb, scaling, torch.bfloat16, fast)


def speed(args, device, deadline):
    layer = TINY_LAYER if args.tiny else QWEN_LAYER
    out = []
    for layers in (1, 4):
        stacks = [low_rank_noise(r, c, b * layers, device, layers * 10 + i) for i, ((r, c), b) in enumerate(layer.items())]
        labels = {}

        def run_default():
            for s in stacks:
                y, labels[tuple(s.shape)] = default_ns(s)
        paths = {"default": run_default}
        for name in SPEED_VARIANTS:
            fns = [variant_ns(name) for _ in stacks]
            paths[name] = (lambda fns=fns: [f(s) for f, s in zip(fns, stacks)])
        times = {p: [] for p in paths}
        for p, fn in list(paths.items()):  # warm-up: the default path's autotune, the FP8 variants' first calls
            if time.time() > deadline:
                break
            try:
                time_steps(fn, iters=1, warmup=args.warmup, device=device)
            except Exception as exc:  # noqa: BLE001 - Fp8Unavailable or a product this torch/GPU rejects: recorded, the rest runs
                out.append({"layers": layers, "variant": p, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                del paths[p], times[p]
        for _ in range(args.rounds):
            if time.time() > deadline:
                break
            for p, fn in paths.items():
                times[p] += time_steps(fn, iters=1, warmup=0, device=device)
        base = statistics.median(times["default"]) if times.get("default") else None
        t16 = statistics.median(times["torch16"]) if times.get("torch16") else None
        for p, ts in times.items():
            if not ts:
                continue
            ms = statistics.median(ts)
            row = {"layers": layers, "variant": p, "ms": ms, "n": len(ts), "min_ms": min(ts), "max_ms": max(ts),
                   "path": "; ".join(sorted(set(labels.values()))) if p == "default" else path_label(p)}
            if base:
                row["ratio_to_default"] = ms / base
                if t16 and p not in ("default", "torch16"):
                    row["projected_ms"] = base - (t16 - ms)
                    row["projected_ratio"] = row["projected_ms"] / base
            out.append(row)
        del stacks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def markdown(result):
    lines = [f"# [fp8-ns] one-layer NS, {result['device']} ({result['date']})", "",
             f"torch {result['torch']}; default = MuonSettings(ns_method='auto', coefficients='adaptive'), "
             "its NSChoice + run_ns per stack (kernels, autotune).", ""]
    sp = [r for r in result.get("speed", []) if "ms" in r]
    if sp:
        lines += ["## Speed (interleaved medians; CUDA events on a GPU, host clock on CPU)", "",
                  "| layers | variant | ms | x default | projected ms (default − (torch16 − variant)) | x default | NS path |",
                  "|---:|---|---:|---:|---:|---:|---|"]
        for r in sp:
            lines.append(f"| {r['layers']} | {r['variant']} | {r['ms']:.2f} | {r.get('ratio_to_default', float('nan')):.3f} | "
                         f"{r.get('projected_ms', float('nan')):.2f} | {r.get('projected_ratio', float('nan')):.3f} | {r['path']} |")
        lines.append("")
    pr = [r for r in result.get("products", []) if "ms" in r]
    if pr:
        lines += ["## Products", "", "| product | call | ms | TFLOP/s |", "|---|---|---:|---:|"]
        lines += [f"| {r['product']} | {r['call']} | {r['ms']:.3f} | {r['tflops']:.0f} |" for r in pr]
        lines.append("")
    nu = [r for r in result.get("numerics", []) if "rel_to_fp32" in r]
    if nu:
        lines += ["## Numerics (σ of the output; rel. Frobenius distance to float32 NS of the same method and schedule)", "",
                  "| case | variant | σ min | σ max | rel. to fp32 | NS path |", "|---|---|---:|---:|---:|---|"]
        lines += [f"| {r['case']} | {r['variant']} | {r['sigma_min']:.3f} | {r['sigma_max']:.3f} | {r['rel_to_fp32']:.4f} | "
                  f"{r.get('path', '')} |" for r in nu]
        lines.append("")
    errs = [r for sec in ("speed", "products", "numerics") for r in result.get(sec, []) if "error" in r or "skipped" in r]
    if errs:
        lines += ["## Not run", ""] + [f"- {json.dumps(r)}" for r in errs[:40]] + [""]
    return "\n".join(lines)


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="small shapes (smoke test; CPU emulates the FP8 products)")
    p.add_argument("--out", required=True, help="output prefix: writes PREFIX.json and PREFIX.md")
    p.add_argument("--sections", nargs="+", default=["products", "numerics", "speed"],
                   choices=["products", "numerics", "speed"])
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 15, tiny 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, nargs=3, default=(40.0, 60.0, 220.0), metavar=("PRODUCTS", "NUMERICS", "SPEED"),
                   help="time budget of each section in seconds")
    args = p.parse_args(argv)
    check_device(p, args.device)  # (an AssertionError traceback without CUDA before)
    args.rounds = args.rounds or (2 if args.tiny else 15)
    device = torch.device(args.device)
    result = {"device": device_name(device), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "tiny": args.tiny, "variants": {n: path_label(n) for n in VARIANTS}}
    budgets = dict(zip(("products", "numerics", "speed"), args.budget_s))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for sec in ("products", "speed", "numerics"):  # products: no autotune, bounded; speed: the decisive one
        if sec not in args.sections:
            continue
        t0 = time.time()
        try:
            result[sec] = {"products": products, "numerics": numerics, "speed": speed}[sec](args, device, t0 + budgets[sec])
        except Exception as exc:  # noqa: BLE001 - keep what the other sections measured
            result[sec] = [{"error": f"{type(exc).__name__}: {str(exc)[:500]}"}]
        result[f"{sec}_s"] = time.time() - t0
        print(f"[fp8_ns] {sec}: {result[f'{sec}_s']:.1f} s", flush=True)
        with open(args.out + ".json", "w") as f:  # after every section: a killed run keeps what it had
            json.dump(result, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
