"""Time standard vs Gram Newton–Schulz per matrix shape (a benchmark, not a test).

Prints one JSON document and then a markdown table. Runs on CUDA when available (CUDA events,
warm-up, median of ``--reps`` timed calls), else on CPU (wall clock, few reps, and by default
every dimension divided by ``--scale 8`` so it finishes; the scale is recorded in the JSON).

Default shapes: one Qwen2.5-7B decoder layer — q/o 3584x3584 (2), k/v 512x3584 (2),
gate/up 18944x3584 (2), down 3584x18944 (1). A shape ``RxC`` or ``RxCxK`` (K same-shape
matrices) is run as ONE batched call on a ``[K, R, C]`` stack; the "one layer total" row sums
the calls. FLOPs come from ``megatron_dmuon.algorithms.flops.newton_schulz_flops`` (full GEMMs).

    python bench/ns.py [--shapes 3584x3584x2,512x3584x2] [--reps 20] [--dtype default|bfloat16|float16|float32]
                       [--steps 5] [--coefficients keller] [--scale 1] [--check-finite] [--threads N]

``--dtype default`` uses each function's own default compute dtype (bf16 standard, fp16 Gram).
Needs only torch (no megatron import): runs on the device image (torch 2.11, Python 3.12).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dmuon.algorithms.flops import newton_schulz_flops  # noqa: E402
from megatron_dmuon.algorithms.gram_newton_schulz import gram_applies, gram_newton_schulz  # noqa: E402
from megatron_dmuon.algorithms.newton_schulz import newton_schulz  # noqa: E402

QWEN25_7B_LAYER = "3584x3584x2,512x3584x2,18944x3584x2,3584x18944x1"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_shapes(spec: str, scale: int) -> list[tuple[int, int, int]]:
    shapes = []
    for token in spec.split(","):
        parts = [int(p) for p in token.lower().strip().split("x")]
        if len(parts) not in (2, 3) or min(parts) < 1:
            raise SystemExit(f"bad shape {token!r}: use RxC or RxCxK with positive ints")
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


def main() -> None:
    ap = argparse.ArgumentParser(description="standard vs Gram Newton-Schulz timing per shape")
    ap.add_argument("--shapes", default=QWEN25_7B_LAYER)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per case (cuda 20, cpu 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (cuda 3, cpu 1)")
    ap.add_argument("--dtype", default="default", choices=["default", *DTYPES])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--coefficients", default="keller")
    ap.add_argument("--scale", type=int, default=None, help="divide every dim by this (cpu default 8)")
    ap.add_argument("--methods", default="standard,gram")
    ap.add_argument("--check-finite", action="store_true", help="include the NaN/Inf check (a host sync)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 avoids OpenMP contention on a busy machine)")
    args = ap.parse_args()
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
                kwargs["compute_dtype"] = DTYPES[args.dtype]
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


if __name__ == "__main__":
    main()
