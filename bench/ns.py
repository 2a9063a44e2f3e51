"""Newton–Schulz measured on its own: time per shape, accuracy, schedules, and a kernel profile.

    python bench/ns.py time [--shapes 3584x3584x2,512x3584x2] [--reps 20] [--dtype default|bfloat16|float16|float32]
                            [--steps 5] [--coefficients keller] [--scale 1] [--check-finite] [--threads N]
    python bench/ns.py accuracy [--seeds 3] [--steps 5]
    python bench/ns.py accuracy --heavy-tailed 512x3584 3584x18944 [--device cuda]
    python bench/ns.py schedules [--out-dir docs/results/ns_schedules] [--gpu] [--reps 20]
    python bench/ns.py profile [--shapes 2x3584x3584 3x3584x18944] [--out FILE]          # GPU

Each prints what it measured (JSON, then markdown); ``python bench/ns.py CMD --help`` says what it
measures. The timing core (``warm_up_clocks``, ``time_calls``: CUDA events on a GPU,
wall clock on CPU) is shared with bench/kernels.py and bench/symmetric.py.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dmuon.algorithms.coefficients import get_coefficients  # noqa: E402
from megatron_dmuon.algorithms.flops import newton_schulz_flops  # noqa: E402
from megatron_dmuon.algorithms.gram_newton_schulz import gram_applies, gram_newton_schulz  # noqa: E402
from megatron_dmuon.algorithms.newton_schulz import newton_schulz  # noqa: E402
from megatron_dmuon.algorithms.ns_metrics import (heavy_tailed_matrix, ill_conditioned_matrix,  # noqa: E402
                                                  orthogonalization_errors, scale_bias)
from megatron_dmuon.algorithms.schedules import POLAR_EXPRESS_6, schedule_for_shape, spectrum_error  # noqa: E402

QWEN25_7B_LAYER = "3584x3584x2,512x3584x2,18944x3584x2,3584x18944x1"
TIME_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dims(token: str, counts=(2, 3), form: str = "RxC or RxCxK") -> list[int]:
    """The positive integers of ``token`` (``AxB[xC]``); ValueError naming it and ``form`` otherwise."""
    parts = token.lower().strip().split("x")
    if len(parts) not in counts or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"bad shape {token!r}: use {form} with positive integers")
    return [int(p) for p in parts]


def parse_shapes(spec: str, scale: int) -> list[tuple[int, int, int]]:
    shapes = []
    for token in spec.split(","):
        parts = dims(token)
        rows, cols, count = (*parts, 1) if len(parts) == 2 else parts
        shapes.append((max(1, rows // scale), max(1, cols // scale), count))
    return shapes


def warm_up_clocks(device: torch.device, matmuls: int = 100) -> None:
    """Bring the GPU clocks up before anything is timed (idle clocks make first timings slow)."""
    if device.type != "cuda":
        return
    warm = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(matmuls):
        warm @ warm
    torch.cuda.synchronize(device)


def time_calls(fn, reps: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each timed call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_shapes(args) -> None:
    """Standard vs Gram NS per matrix shape (a benchmark, not a test): CUDA events, warm-up, median of
    ``--reps`` timed calls; on CPU wall clock, few reps and by default every dimension divided by
    ``--scale 8`` so it finishes (the scale is recorded in the JSON). A shape ``RxC`` or ``RxCxK`` (K
    same-shape matrices) is ONE batched call on a ``[K, R, C]`` stack; the "one layer total" row sums the
    calls. Default shapes: one Qwen2.5-7B decoder layer (q/o 3584x3584 (2), k/v 512x3584 (2), gate/up
    18944x3584 (2), down 3584x18944 (1)). FLOPs from ``algorithms.flops.newton_schulz_flops`` (full
    GEMMs). ``--dtype default``: each function's own compute dtype (bf16 standard, fp16 Gram)."""
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.type == "cuda"
    reps = args.reps or (20 if on_cuda else 2)
    warmup = args.warmup if args.warmup is not None else (3 if on_cuda else 1)
    scale = args.scale or (1 if on_cuda else 8)
    shapes = parse_shapes(args.shapes, scale)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    functions = {"standard": newton_schulz, "gram": gram_newton_schulz}
    unknown = [m for m in methods if m not in functions]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; valid: standard, gram")

    generator = torch.Generator(device=device).manual_seed(0)
    results = []
    for rows, cols, count in shapes:
        x = torch.randn(count, rows, cols, device=device, dtype=torch.float32, generator=generator)
        for method in methods:
            kwargs = dict(coefficients=args.coefficients, steps=args.steps, check_finite=args.check_finite)
            if args.dtype != "default":
                kwargs["compute_dtype"] = TIME_DTYPES[args.dtype]
            fn = functions[method]
            compute_dtype = kwargs.get("compute_dtype", torch.bfloat16 if method == "standard" else torch.float16)
            falls_back = method == "gram" and not gram_applies(rows, cols)
            times = time_calls(lambda: fn(x, **kwargs), reps, warmup, device)
            ms = statistics.median(times)
            flops = count * newton_schulz_flops(rows, cols, args.steps, method)
            results.append({
                "rows": rows, "cols": cols, "count": count, "method": method,
                "compute_dtype": str(compute_dtype).removeprefix("torch."),
                "gram_fell_back_to_standard": falls_back,
                "ms_per_call": ms, "ms_per_matrix": ms / count,
                "ms_min": min(times), "ms_max": max(times),
                "model_flops": flops, "tflops_per_s": flops / (ms * 1e-3) / 1e12,
            })
        del x
        if on_cuda:
            torch.cuda.empty_cache()

    totals = {m: sum(r["ms_per_call"] for r in results if r["method"] == m) for m in methods}
    report = {
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "reps": reps, "warmup": warmup, "scale": scale,
        "steps": args.steps, "coefficients": args.coefficients, "check_finite": args.check_finite,
        "results": results, "one_layer_total_ms": totals,
    }
    print(json.dumps(report, indent=1))
    print()
    print(f"device: {report['device']}, torch {torch.__version__}, scale 1/{scale}, median of {reps}")
    print("| shape (count) | method | dtype | ms/call | ms/matrix | TFLOP/s | note |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        note = "falls back to standard" if r["gram_fell_back_to_standard"] else ""
        print(f"| {r['rows']}x{r['cols']} ({r['count']}) | {r['method']} | {r['compute_dtype']} | "
              f"{r['ms_per_call']:.3f} | {r['ms_per_matrix']:.3f} | {r['tflops_per_s']:.3g} | {note} |")
    for m, total in totals.items():
        print(f"| one layer total | {m} | | {total:.3f} | | | |")


SETS = ("keller", "polar_express", "you")
ACCURACY_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
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


def accuracy_paths(device) -> dict:
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
    paths = accuracy_paths(device)
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


def accuracy(args) -> None:
    """NS / Gram NS accuracy per coefficient set and compute dtype (not a test): one record per set x
    dtype x method with the maxima of ``algorithms.ns_metrics.orthogonalization_errors`` over the
    matrices; this produced the bound table in docs/algorithms.md. ``--heavy-tailed`` instead runs each
    NS path an optimizer can take (ours in torch and, on CUDA, in the kernels; Megatron's
    emerging_optimizers NS at its 'medium' and 'high' precisions) with the quintic schedule on matrices
    shaped like real momenta (σ_i ∝ (1 + (i−1)/3)^−1.6, optionally 4 spikes 30x larger) at the given
    shapes, and reports each path's rounding error against float64 NS and its scale bias
    ⟨Y, Y_exact⟩/‖Y_exact‖² − 1 (a systematic lean that rounding noise alone would not give)."""
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
        for dname, dtype in ACCURACY_DTYPES.items():
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


SCHEDULE_SHAPES = {"q/o": (3584, 3584), "k/v": (512, 3584), "gate/up, down": (3584, 18944)}
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
    for name, (m, n) in SCHEDULE_SHAPES.items():
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
    for name, (m, n) in SCHEDULE_SHAPES.items():
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


def schedules_markdown(report: dict) -> str:
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


def schedules(args) -> None:
    """Which NS schedule, how many steps: errors vs the exact polar factor on gradient-like spectra.

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
    device = torch.device("cuda" if args.gpu else "cpu")
    report = {"exact": exact_table(device)}
    if args.gpu:
        report["device"] = torch.cuda.get_device_name()
        report["gpu"] = gpu_table(args.reps)
    text = schedules_markdown(report)
    print(text)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = "ns_schedules_gpu" if args.gpu else "ns_schedules"
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
        (out / f"{name}.md").write_text(text)


def profile(args) -> None:
    """Kernel-level breakdown of one batched NS call on the GPU (torch.profiler), per shape and schedule.

    Prints, for each stack and schedule ('adaptive' = the per-shape quartic schedule, 'frobenius' =
    the previous choice), the wall time of one call (CUDA events, median of 10) and the profiler's
    table of GPU kernels by total time: where the time goes beyond the products.
    """
    from megatron_dmuon.kernels import orthogonalize_batched
    from megatron_dmuon.kernels.autotune import time_cuda_ms

    lines = []
    for spec in args.shapes:
        b, m, n = (int(v) for v in spec.split("x"))
        x = torch.randn(b, m, n, device="cuda")
        for label, kw in (("adaptive", schedule_for_shape(m, n)), ("frobenius", frobenius_schedule(m, n))):
            fn = lambda: orthogonalize_batched(x, "auto", compute_dtype=torch.float16, **kw)  # noqa: E731
            fn()  # autotune and compile outside the timing
            ms = time_cuda_ms(fn, min_reps=10, max_reps=10)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
            lines += [f"## {spec} {label} ({kw['steps']} steps, {kw['normalisation']}): {ms:.3f} ms", table, ""]
            print("\n".join(lines[-3:]), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines))


def main(argv=None) -> None:
    from cli_inputs import OneLineParser, check_device  # (bench/, on the path when this runs as a script)

    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="measure", required=True)
    sub_kw = dict(formatter_class=argparse.RawDescriptionHelpFormatter)
    t = sub.add_parser("time", help="standard vs Gram Newton-Schulz timing per shape", description=inspect.cleandoc(time_shapes.__doc__),
                       **sub_kw)
    t.add_argument("--shapes", default=QWEN25_7B_LAYER)
    t.add_argument("--reps", type=int, default=None, help="timed calls per case (cuda 20, cpu 2)")
    t.add_argument("--warmup", type=int, default=None, help="untimed calls first (cuda 3, cpu 1)")
    t.add_argument("--dtype", default="default", choices=["default", *TIME_DTYPES])
    t.add_argument("--steps", type=int, default=5)
    t.add_argument("--coefficients", default="keller")
    t.add_argument("--scale", type=int, default=None, help="divide every dim by this (cpu default 8)")
    t.add_argument("--methods", default="standard,gram")
    t.add_argument("--check-finite", action="store_true", help="include the NaN/Inf check (a host sync)")
    t.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 avoids OpenMP contention on a busy machine)")
    a = sub.add_parser("accuracy", help="NS / Gram NS accuracy per coefficient set and dtype; --heavy-tailed: "
                       "every NS path on momentum-like spectra", description=inspect.cleandoc(accuracy.__doc__), **sub_kw)
    a.add_argument("--seeds", type=int, default=3)
    a.add_argument("--steps", type=int, default=5)
    a.add_argument("--heavy-tailed", nargs="+", default=None, metavar="ROWSxCOLS")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    s = sub.add_parser("schedules", help="the NS schedules' errors vs the exact polar factor (--gpu: and the fp16 "
                       "kernels)", description=inspect.cleandoc(schedules.__doc__), **sub_kw)
    s.add_argument("--out-dir", default=None)
    s.add_argument("--gpu", action="store_true")
    s.add_argument("--reps", type=int, default=20)
    p = sub.add_parser("profile", help="torch.profiler's kernel table of one batched NS call (GPU)",
                       description=inspect.cleandoc(profile.__doc__), **sub_kw)
    p.add_argument("--shapes", nargs="+", default=["2x3584x3584", "3x3584x18944"])
    p.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:  # the shapes, before any work
        if args.measure == "time":
            parse_shapes(args.shapes, 1)
        for token in (args.heavy_tailed or []) if args.measure == "accuracy" else []:
            dims(token, (2,), "ROWSxCOLS")
        for token in args.shapes if args.measure == "profile" else []:
            dims(token, (3,), "BATCHxROWSxCOLS")
    except ValueError as e:
        ap.error(f"{'--heavy-tailed' if args.measure == 'accuracy' else '--shapes'}: {e}")
    if args.measure == "accuracy":
        check_device(ap, args.device)
    if args.measure == "profile" or (args.measure == "schedules" and args.gpu):
        check_device(ap, "cuda")
    {"time": time_shapes, "accuracy": accuracy, "schedules": schedules, "profile": profile}[args.measure](args)


if __name__ == "__main__":
    main()
