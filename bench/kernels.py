"""Benchmark of the Gram Newton–Schulz kernels on Qwen2.5-7B layer shapes (JSON + markdown).

    python bench/kernels.py [--out-dir docs/results/kernels] [--name bench_kernels_h200] [--coefficients polar_express]
                            [--peers .peers] [--cache PATH] [--smoke]

Measures, for each Qwen2.5-7B matrix shape as a batch of 8 (and for one whole layer):
torch standard NS (algorithms.newton_schulz, bf16), torch Gram NS (algorithms.gram_newton_schulz,
fp16), our Gram NS kernels (autotuned), and peers when their code is present under --peers
(never committed): microsoft/dion's Triton NS and X-Square-Robot/dmuon's Gram NS.

Schedules: every method runs the published 5-step Polar Express schedule, except the
``*_adaptive`` ones, which take ``algorithms.schedules.schedule_for_shape``: the quartic
normalisation with 4 designed steps for aspect >= 2 and 5 for the square q/o.

Error metric (all tables): relative Frobenius error ``‖NS(X) − P‖_F / ‖P‖_F`` of the output
vs the exact polar factor ``P = U Vᵀ`` of the float64 input, computed in float64 (eigh of the
Gram matrix on the GPU, cross-checked against the SVD once). The per-shape table reports
matrix 0 of the batch; the layer table reports the maximum over every matrix of the layer.
Times are median ms (CUDA events); TFLOP/s use each method's own FLOP count; the FLOP lower
bound assumes 790 TFLOP/s. --smoke runs tiny shapes on CPU (torch paths only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ns import time_calls, warm_up_clocks  # noqa: E402
from megatron_dmuon.algorithms.flops import newton_schulz_flops  # noqa: E402
from megatron_dmuon.algorithms.gram_newton_schulz import gram_applies, gram_newton_schulz  # noqa: E402
from megatron_dmuon.algorithms.newton_schulz import msgn_svd, newton_schulz  # noqa: E402
from megatron_dmuon.algorithms.schedules import schedule_for_shape  # noqa: E402
from megatron_dmuon.kernels import (  # noqa: E402
    GraphedGroups,
    gram_newton_schulz_fast,
    nonfinite_metrics,
    orthogonalize_batched,
    orthogonalize_groups,
)

PEAK_TFLOPS = 790.0
QWEN_SHAPES = {  # name: (rows, cols) as stored by the model
    "q/o": (3584, 3584),
    "k/v": (512, 3584),
    "gate/up": (18944, 3584),
    "down": (3584, 18944),
}
# One layer, grouped by the wide shape the owner batches: q,o | k,v | gate,up (transposed),down.
QWEN_LAYER = {"q,o": (2, 3584, 3584), "k,v": (2, 512, 3584), "gate,up,down": (3, 3584, 18944)}
SMOKE_SHAPES = {"sq": (48, 48), "kv": (16, 64), "tall": (96, 32), "wide": (32, 96)}
SMOKE_LAYER = {"sq": (2, 48, 48), "kv": (2, 16, 64), "mlp": (3, 32, 96)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, reps=10, warmup=2):
    """Median milliseconds per call (the timing loop of bench/ns.py)."""
    sync(device)
    return statistics.median(time_calls(fn, reps, warmup, device))


def polar_fp64(x: torch.Tensor) -> torch.Tensor:
    """Exact polar factor of one matrix in float64 via eigh of its (small) Gram matrix."""
    X = x.double()
    tall = X.size(0) > X.size(1)
    if tall:
        X = X.T
    evals, U = torch.linalg.eigh(X @ X.T)
    keep = evals > evals.max() * X.size(1) * torch.finfo(torch.float64).eps
    inv_sqrt = torch.where(keep, evals.clamp(min=1e-300).rsqrt(), torch.zeros_like(evals))
    P = (U * inv_sqrt) @ (U.T @ X)
    return P.T if tall else P


def rel_err(value: torch.Tensor, ref: torch.Tensor) -> float:
    return float((value.double() - ref).norm() / ref.norm())


def load_peers(peers_dir: Path, wanted=("dion", "dmuon")):
    peers = {}
    dion = peers_dir / "dion" / "dion_newton_schulz_triton.py"
    if dion.exists() and "dion" in wanted:
        try:
            sys.path.insert(0, str(dion.parent))
            import dion_newton_schulz_triton as dion_mod

            peers["dion_triton_ns"] = dion_mod.newton_schulz_triton
        except Exception as exc:  # report, do not fail the benchmark
            peers["dion_triton_ns"] = f"import failed: {exc}"
    dmuon = peers_dir / "dmuon_src" / "dmuon"
    if dmuon.exists() and "dmuon" in wanted:
        try:
            sys.path.insert(0, str(dmuon.parent))
            from dmuon.optim.newton_schulz import gram_newton_schulz as dmuon_gram

            peers["dmuon_gram_ns"] = lambda x: torch.stack([dmuon_gram(m) for m in x]) if x.dim() == 3 else dmuon_gram(x)
        except Exception as exc:
            peers["dmuon_gram_ns"] = f"import failed: {exc}"
    return peers


def _adaptive(fn):
    """Run ``fn(x, **schedule_for_shape(rows, cols))``: the quartic normalisation, 4 steps for
    aspect >= 2, else 5."""
    return lambda x: fn(x, **schedule_for_shape(x.size(-2), x.size(-1)))


def _adaptive_schedules(stacks):
    return [schedule_for_shape(x.size(-2), x.size(-1)) for x in stacks]


def _graphed_groups(**kw):
    """Run a list of stacks through ``GraphedGroups`` ('auto', adaptive schedules), captured once
    per list of shapes and replayed after that."""
    graphs = {}

    def run(stacks):
        key = tuple(tuple(x.shape) for x in stacks)
        if key not in graphs:
            graphs[key] = GraphedGroups(stacks, "auto", per_stack_kwargs=_adaptive_schedules(stacks), **kw)
        return graphs[key](stacks)

    return run


def methods_for(args, device, peers):
    co = args.coefficients
    fast = device.type == "cuda"
    gram_kw = dict(compute_dtype=torch.float16, check_finite=False)
    std_kw = dict(coefficients=co, compute_dtype=torch.bfloat16, check_finite=False)
    methods = {
        # name: (callable on a [B, m, n] stack, FLOP method, symmetric FLOP count?)
        "torch_standard_bf16": (lambda x: newton_schulz(x, **std_kw), "standard", False),
        "torch_gram_fp16": (lambda x: gram_newton_schulz(x, coefficients=co, **gram_kw), "gram", False),
    }
    if fast:
        cache = args.cache
        methods["ours_gram_fp16"] = (
            lambda x: gram_newton_schulz_fast(x, coefficients=co, **gram_kw, cache_path=cache), "gram", True)
        methods["ours_gram_fp16_adaptive"] = (
            _adaptive(lambda x, **s: gram_newton_schulz_fast(x, **s, **gram_kw, cache_path=cache)), "gram", True)
        methods["ours_auto_fp16_adaptive"] = (
            _adaptive(lambda x, **s: orthogonalize_batched(x, "auto", **s, **gram_kw, cache_path=cache)), "auto", True)
        methods["ours_auto_fp16_adaptive_restart2"] = (  # what the Gram restart would cost (none by default)
            _adaptive(lambda x, **s: orthogonalize_batched(x, "auto", **s, **gram_kw, restart_after=(2,), cache_path=cache)),
            "auto", True)
        graphed = _graphed_groups(**gram_kw, cache_path=cache)
        methods["ours_auto_fp16_adaptive_graphed"] = (lambda x: graphed([x])[0], "auto", True)
        # the owner step's call: the result in the compute dtype (its apply pass reads it once)
        graphed_fp16 = _graphed_groups(**gram_kw, cache_path=cache, out_dtype=torch.float16)
        methods["ours_auto_fp16_adaptive_graphed_fp16out"] = (lambda x: graphed_fp16([x])[0], "auto", True)
    for name, fn in peers.items():
        if callable(fn):
            methods[f"peer_{name}"] = (fn, "gram" if "gram" in name else "standard", "triton" in name)
    return methods


def flops_of(method, rows, cols, batch, symmetric, steps=5):
    if method in ("auto", "gram"):
        # What runs: Gram when the aspect ratio allows it (min_aspect_ratio=2), else standard.
        method = "gram" if gram_applies(rows, cols) else "standard"
    return batch * newton_schulz_flops(rows, cols, steps, method, symmetric=symmetric)


def lower_bound_ms(rows, cols, batch, steps=5):
    best = min(newton_schulz_flops(rows, cols, steps, m, symmetric=True, min_aspect_ratio=1.0) for m in ("standard", "gram"))
    return batch * best / (PEAK_TFLOPS * 1e12) * 1e3


def bench_shapes(args, device, methods, report):
    shapes = SMOKE_SHAPES if args.smoke else QWEN_SHAPES
    batch = 2 if args.smoke else args.batch
    rows_out = []
    for shape_name, (rows, cols) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(7)
        x = torch.randn(batch, rows, cols, device=device, generator=gen)
        polar = polar_fp64(x[0])
        bound = lower_bound_ms(rows, cols, batch)
        for name, (fn, fmethod, symmetric) in methods.items():
            entry = {"shape": shape_name, "rows": rows, "cols": cols, "batch": batch, "method": name}
            try:
                out = fn(x)
                entry["rel_err_vs_polar"] = rel_err(out[0], polar)
                entry["finite"] = bool(torch.isfinite(out).all())
                del out
                entry["ms"] = time_ms(lambda: fn(x), device, reps=args.reps)
                steps = schedule_for_shape(rows, cols)["steps"] if "adaptive" in name else 5
                entry["steps"] = steps
                flops = flops_of(fmethod, rows, cols, batch, symmetric, steps)
                entry["tflops"] = flops / (entry["ms"] * 1e-3) / 1e12
                entry["lower_bound_ms"] = bound
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            rows_out.append(entry)
            print(json.dumps(entry), flush=True)
        del x, polar
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["shapes"] = rows_out


def tune_layer_methods(args, device, report):
    """Measure Gram vs standard for the layer's stacks (with each group's adaptive schedule)
    so that 'ours_auto' uses the measured choice."""
    if device.type != "cuda":
        return
    from megatron_dmuon.kernels import tune_method

    layer = SMOKE_LAYER if args.smoke else QWEN_LAYER
    report["method_tuning"] = {
        g: tune_method(m, n, b, torch.float16, device, cache_path=args.cache, **schedule_for_shape(m, n))
        for g, (b, m, n) in layer.items()
    }
    print(json.dumps(report["method_tuning"]), flush=True)


def bench_layer(args, device, methods, report):
    layer = SMOKE_LAYER if args.smoke else QWEN_LAYER
    gen = torch.Generator(device=device).manual_seed(11)
    stacks = {g: torch.randn(*s, device=device, generator=gen) for g, s in layer.items()}
    polars = {g: [polar_fp64(m) for m in x] for g, x in stacks.items()}  # every matrix of the layer
    bound = sum(lower_bound_ms(r, c, b) for b, r, c in layer.values())
    bound_adaptive = sum(lower_bound_ms(r, c, b, schedule_for_shape(r, c)["steps"]) for b, r, c in layer.values())
    result = {"groups": {g: list(s) for g, s in layer.items()}, "lower_bound_ms": bound,
              "lower_bound_ms_adaptive": bound_adaptive, "methods": {}}
    for name, (fn, _, _) in methods.items():
        try:
            errs = {}
            for g, x in stacks.items():
                out = fn(x)
                errs[g] = [rel_err(out[i], polars[g][i]) for i in range(x.size(0))]
            batched = time_ms(lambda: [fn(x) for x in stacks.values()], device, reps=args.reps)
            looped = time_ms(lambda: [fn(m.unsqueeze(0)) for x in stacks.values() for m in x], device, reps=args.reps) \
                if "graphed" not in name else None
            result["methods"][name] = {"batched_ms": batched, "looped_ms": looped, "rel_err_vs_polar": errs,
                                       "max_rel_err": max(max(e) for e in errs.values())}
        except Exception as exc:
            result["methods"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        print(name, json.dumps(result["methods"][name]), flush=True)
    for name, fn in layer_methods(args, device).items():  # the whole layer in one call
        try:
            groups = list(stacks)
            outs = fn([stacks[g] for g in groups])
            errs = {g: [rel_err(outs[k][i], polars[g][i]) for i in range(stacks[g].size(0))] for k, g in enumerate(groups)}
            batched = time_ms(lambda: fn([stacks[g] for g in groups]), device, reps=args.reps)
            result["methods"][name] = {"batched_ms": batched, "looped_ms": None, "rel_err_vs_polar": errs,
                                       "max_rel_err": max(max(e) for e in errs.values())}
        except Exception as exc:
            result["methods"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        print(name, json.dumps(result["methods"][name]), flush=True)
    interleaved_layer_rounds(args, device, methods, stacks, result)
    report["layer"] = result


def interleaved_layer_rounds(args, device, methods, stacks, result, rounds=7):
    """Re-time every working layer method in interleaved rounds (A B C … A B C …) and keep the
    median per method: GPU clocks drift over a run, and this puts the methods side by side."""
    if device.type != "cuda":
        return
    calls = {name: (lambda fn=fn: [fn(x) for x in stacks.values()]) for name, (fn, _, _) in methods.items()
             if "batched_ms" in result["methods"].get(name, {})}
    for name, fn in layer_methods(args, device).items():
        if "batched_ms" in result["methods"].get(name, {}):
            calls[name] = lambda fn=fn: fn(list(stacks.values()))
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name].append(time_ms(call, device, reps=3, warmup=1))
    for name, values in samples.items():
        result["methods"][name]["interleaved_ms"] = statistics.median(values)
        result["methods"][name]["interleaved_min_ms"] = min(values)
    print("interleaved layer ms:", json.dumps({k: round(statistics.median(v), 3) for k, v in samples.items()}), flush=True)


def layer_methods(args, device):
    """Methods that take the layer's list of stacks: our groups on concurrent CUDA streams,
    eager and as one captured graph."""
    if device.type != "cuda":
        return {}
    kw = dict(compute_dtype=torch.float16, check_finite=False, cache_path=args.cache)
    return {
        "ours_auto_fp16_adaptive_streams": lambda stacks: orthogonalize_groups(
            stacks, "auto", per_stack_kwargs=_adaptive_schedules(stacks), **kw),
        "ours_auto_fp16_adaptive_streams_graphed": _graphed_groups(**kw),
        "ours_auto_fp16_adaptive_streams_graphed_fp16out": _graphed_groups(**kw, out_dtype=torch.float16),
    }


def bench_kv_batching(args, device, methods, report):
    rows, cols = SMOKE_SHAPES["kv"] if args.smoke else QWEN_SHAPES["k/v"]
    batch = 2 if args.smoke else args.batch
    x = torch.randn(batch, rows, cols, device=device)
    result = {}
    for name, (fn, _, _) in methods.items():
        if "peer" in name:
            continue
        try:
            batched = time_ms(lambda: fn(x), device, reps=args.reps)
            looped = time_ms(lambda: [fn(m.unsqueeze(0)) for m in x], device, reps=args.reps) if "graphed" not in name else None
            result[name] = {"batched_ms": batched, "looped_ms": looped}
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
    # The headline ratios: our graphed and our eager batch vs our own eager per-matrix loop and torch's loops.
    loop_refs = ("ours_auto_fp16_adaptive", "torch_gram_fp16", "torch_standard_bf16")
    for ours_name in ("ours_auto_fp16_adaptive_graphed", "ours_auto_fp16_adaptive"):
        ours = result.get(ours_name, {}).get("batched_ms")
        for ref in loop_refs if ours else ():
            looped = result.get(ref, {}).get("looped_ms")
            if looped:
                result[f"speedup_{ours_name}_batch_vs_{ref}_looped"] = looped / ours
    report["kv_batch"] = {"rows": rows, "cols": cols, "batch": batch, **result}
    print(json.dumps(report["kv_batch"]), flush=True)


def breakdown(args, device, report):
    """Where the adaptive Gram path's layer time goes: each kind of launch timed alone on the
    layer's shapes (median ms), times how often one call issues it."""
    if device.type != "cuda":
        return
    from megatron_dmuon.algorithms.gram_newton_schulz import restart_points
    from megatron_dmuon.kernels.autotune import shape_plan
    from megatron_dmuon.kernels.ns_driver import _apply_q, _normalised_wide, _sym, _syrk

    layer = SMOKE_LAYER if args.smoke else QWEN_LAYER
    result = {}
    for g, (b, m, n) in layer.items():
        sched = schedule_for_shape(m, n)
        steps = sched["steps"]
        x = torch.randn(b, m, n, device=device)
        X, _ = _normalised_wide(x, torch.float16, 1e-7)
        plan = shape_plan(m, n, b, torch.float16, device, cache_path=args.cache)
        R = _syrk(plan.syrk, X)
        gram = gram_applies(m, n)
        if gram:
            restarts = len(restart_points((2,), steps))
            segments = [2, steps - 2] if restarts else [steps]
            # Per segment of s steps: s Z' products, 2 R updates on all but its last step,
            # s - 1 Q updates (the first Q is Z' + aI).
            squares = sum(s + 2 * (s - 1) + (s - 1) for s in segments)
            counts = {"prep": 1, "syrk": 1 + restarts, "square": squares, "bmm_fp16": restarts, "bmm_out": 1}
        else:  # standard NS: per step a SYRK, a polynomial and a full B·X product
            counts = {"prep": 1, "syrk": steps, "square": steps, "baddbmm": steps, "cast_out": 1}
        ops = {
            "prep": lambda: _normalised_wide(x, torch.float16, 1e-7),
            "syrk": lambda: _syrk(plan.syrk, X),
            "square": lambda: _sym(plan.square, R, R, c=R, alpha=0.5, beta=-1.0),
            "bmm_fp16": lambda: torch.bmm(R, X),
            "bmm_out": lambda: _apply_q(R, X, False, torch.float32),
            "baddbmm": lambda: torch.baddbmm(X, R, X, beta=2.0),
            "cast_out": lambda: X.to(torch.float32),
        }
        times = {k: time_ms(ops[k], device, reps=args.reps) for k in counts}
        parts = {k: {"count": counts[k], "ms_each": times[k], "ms": counts[k] * times[k]} for k in counts}
        result[g] = {"method": "gram" if gram else "standard", "steps": steps, "parts": parts,
                     "sum_ms": sum(p["ms"] for p in parts.values()),
                     "plan": {"syrk": plan.syrk.as_dict(), "square": plan.square.as_dict()}}
        del x, X, R
    report["breakdown"] = result
    print(json.dumps(result), flush=True)


def gemm_ceiling(device, report):
    if device.type != "cuda":
        return
    n = 8192
    for dtype in (torch.bfloat16, torch.float16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        ms = time_ms(lambda: a @ b, device, reps=10)
        report.setdefault("gemm_ceiling_tflops", {})[str(dtype)] = 2 * n**3 / (ms * 1e-3) / 1e12


def accuracy_checks(args, device, report):
    """cond-1e6 inputs: no NaN/Inf; and the eigh polar factor vs the SVD one."""
    gen = torch.Generator(device=device).manual_seed(3)
    m, n = (16, 64) if args.smoke else (512, 3584)
    x = torch.randn(2, m, n, device=device, generator=gen)
    result = {"polar_eigh_vs_svd": rel_err(polar_fp64(x[0]), msgn_svd(x[0]).to(device))}
    U, _ = torch.linalg.qr(torch.randn(2, m, m, device=device, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(2, n, m, device=device, dtype=torch.float64, generator=gen))
    s = torch.logspace(0, -6, m, device=device, dtype=torch.float64)
    ill = ((U * s) @ V.mT).float()
    before = nonfinite_metrics()
    fns = {"torch_gram_fp16": lambda t: gram_newton_schulz(t, args.coefficients, check_finite=False)}
    if device.type == "cuda":
        fns["ours_gram_fp16_checked"] = lambda t: gram_newton_schulz_fast(t, args.coefficients, check_finite=True, cache_path=args.cache)
        fns["ours_gram_fp16_unchecked"] = lambda t: gram_newton_schulz_fast(t, args.coefficients, check_finite=False, cache_path=args.cache)
    polar = polar_fp64(ill[0].double())
    for name, fn in fns.items():
        out = fn(ill)
        result[f"cond1e6_{name}"] = {"finite": bool(torch.isfinite(out).all()), "rel_err_vs_polar": rel_err(out[0], polar)}
    after = nonfinite_metrics()
    result["nonfinite_metrics_delta"] = {k: after[k] - before[k] for k in after}
    report["accuracy"] = result
    print(json.dumps(result), flush=True)


def autotune_summary(args, report):
    from megatron_dmuon.kernels.autotune import get_cache

    entries = get_cache(args.cache).entries
    report["autotune"] = entries


def _fmt(v, spec=".3f"):
    return "—" if v is None else format(v, spec)


def markdown(report) -> str:
    lines = [f"# Gram NS kernels benchmark ({report['device']})", ""]
    lines.append(f"torch {report['torch']}, triton {report.get('triton')}, coefficients {report['coefficients']} "
                 f"(`*_adaptive`: quartic normalisation, 4 steps for aspect >= 2, 5 for square); FLOP lower bound at {PEAK_TFLOPS:.0f} TFLOP/s.")
    lines.append("Error: relative Frobenius error vs the float64 polar factor U Vᵀ; per shape: matrix 0; layer: max over every matrix.")
    if "gemm_ceiling_tflops" in report:
        lines.append("Measured 8192³ GEMM: " + ", ".join(f"{k}: {v:.0f} TFLOP/s" for k, v in report["gemm_ceiling_tflops"].items()))
    layer = report.get("layer")
    if layer:
        groups = list(layer["groups"])
        lines += ["", f"## One layer ({', '.join(f'{g} {s}' for g, s in layer['groups'].items())}); FLOP bound "
                  f"{layer['lower_bound_ms']:.2f} ms (5 steps), {layer.get('lower_bound_ms_adaptive', float('nan')):.2f} ms (adaptive)", "",
                  "Interleaved: median over 7 rounds that time every method in turn (min in brackets); "
                  "this is the side-by-side column.", "",
                  "| method | batched ms | interleaved ms | per-matrix loop ms | max rel err | "
                  + " | ".join(f"max err {g}" for g in groups) + " |",
                  "|---|---:|---:|---:|---:|" + "---:|" * len(groups)]
        for name, e in layer["methods"].items():
            if "error" in e:
                lines.append(f"| {name} | error: {e['error'][:60]} | | | |" + " |" * len(groups))
            else:
                per = " | ".join(f"{max(e['rel_err_vs_polar'][g]):.4f}" for g in groups)
                inter = f"{e['interleaved_ms']:.2f} ({e['interleaved_min_ms']:.2f})" if "interleaved_ms" in e else "—"
                lines.append(f"| {name} | {e['batched_ms']:.2f} | {inter} | {_fmt(e['looped_ms'], '.2f')} | "
                             f"{e['max_rel_err']:.4f} | {per} |")
    bd = report.get("breakdown")
    if bd:
        lines += ["", "## Where the adaptive path's time goes (each launch kind timed alone × count)", "",
                  "| group | method, steps | part | count | ms each | ms |", "|---|---|---|---:|---:|---:|"]
        for g, e in bd.items():
            for part, p in e["parts"].items():
                lines.append(f"| {g} | {e['method']}, {e['steps']} | {part} | {p['count']} | {p['ms_each']:.4f} | {p['ms']:.3f} |")
            lines.append(f"| {g} | | **sum** | | | **{e['sum_ms']:.3f}** |")
    lines += ["", "## Per shape (batch of %d)" % report.get("batch", 8), "",
              "| shape | method | steps | ms | TFLOP/s | bound ms | rel err |", "|---|---|---:|---:|---:|---:|---:|"]
    for e in report.get("shapes", []):
        if "error" in e:
            lines.append(f"| {e['shape']} {e['rows']}×{e['cols']} | {e['method']} | | error: {e['error'][:60]} | | | |")
        else:
            lines.append(f"| {e['shape']} {e['rows']}×{e['cols']} | {e['method']} | {e.get('steps', 5)} | {e['ms']:.3f} | "
                         f"{e['tflops']:.0f} | {e['lower_bound_ms']:.3f} | {e['rel_err_vs_polar']:.4f} |")
    kv = report.get("kv_batch")
    if kv:
        lines += ["", f"## k/v {kv['rows']}×{kv['cols']}, batch {kv['batch']}: batched vs looped", "",
                  "| method | batched ms | looped ms |", "|---|---:|---:|"]
        for name, e in kv.items():
            if isinstance(e, dict) and "batched_ms" in e:
                lines.append(f"| {name} | {e['batched_ms']:.3f} | {_fmt(e['looped_ms'])} |")
        lines.append("")
        for name, v in kv.items():
            if name.startswith("speedup"):
                lines.append(f"* {name}: **{v:.1f}×**")
    if report.get("method_tuning"):
        lines += ["", "## Measured Gram vs standard (our kernels)", "", "| group | choice | ms per method | error vs torch path |",
                  "|---|---|---|---|"]
        for g, e in report["method_tuning"].items():
            times = ", ".join(f"{k} {v:.3f}" for k, v in e["time_ms"].items())
            errs = ", ".join(f"{k} {v:.4f}" for k, v in e["error_vs_torch"].items())
            lines.append(f"| {g} | {e['method']} | {times} | {errs} |")
    ops = {k: v for k, v in report.get("autotune", {}).items() if k.startswith("op|")}
    if ops:
        lines += ["", "## Autotuned symmetric products", "",
                  "| product | choice | ms | best pointer-kernel ms | best TMA-kernel ms | cuBLAS ms |", "|---|---|---:|---:|---:|---:|"]
        for key, e in sorted(ops.items()):
            op, m, k, b, dt = key.split("|")[-5:]

            def best(pred):
                t = [c["time_ms"] for c in e["candidates"] if pred(c) and "time_ms" in c]
                return min(t) if t else None
            tri = best(lambda c: c["backend"] == "triton" and not (c.get("config") or {}).get("tma"))
            tma = best(lambda c: c["backend"] == "triton" and (c.get("config") or {}).get("tma"))
            cub = best(lambda c: c["backend"] == "cublas")
            cfg = e["choice"]["config"]
            desc = e["choice"]["backend"]
            if cfg and "block_m" in cfg:
                desc += " {block_m}x{block_n}x{block_k} w{num_warps} s{num_stages}".format(**cfg)
                desc += {1: " tma-persistent", 2: " tma"}.get(cfg.get("tma", 0), "")
            elif cfg:  # another backend's config (cutlass: variant, mirror mode)
                desc += " " + " ".join(f"{k}={v}" for k, v in sorted(cfg.items()))
            lines.append(f"| {op} {m} {k} {b} {dt} | {desc} | {e['time_ms']:.4f} | {_fmt(tri, '.4f')} | "
                         f"{_fmt(tma, '.4f')} | {_fmt(cub, '.4f')} |")
        rejected = sorted({c["rejected"][:120] for e in ops.values() for c in e["candidates"] if "rejected" in c})
        if rejected:
            lines += ["", "Rejected candidates (reasons): " + "; ".join(rejected[:6])]
    if "accuracy" in report:
        lines += ["", "## Accuracy checks", "", "```", json.dumps(report["accuracy"], indent=1), "```"]
    if report.get("section_errors"):
        lines += ["", "## Section errors", "", "```", json.dumps(report["section_errors"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from cli_inputs import OneLineParser  # (bench/, on the path when this runs as a script)

    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default=str(ROOT / "docs" / "results" / "kernels"))
    parser.add_argument("--name", default="bench_kernels")
    parser.add_argument("--coefficients", default="polar_express")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--peers", default=str(ROOT / ".peers"))
    parser.add_argument("--peer-list", default="dion,dmuon", help="which peers to load from --peers")
    parser.add_argument("--cache", default=None, help="autotune cache file (default: the user cache)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed (checks the script)")
    parser.add_argument("--sections", default="ceiling,accuracy,shapes,methods,layer,kv,breakdown")
    args = parser.parse_args(argv)
    if args.cache:  # a file that is not the autotune cache is refused before any shape is tuned
        from megatron_dmuon.kernels.autotune import AutotuneCache

        try:
            AutotuneCache(args.cache).check_writable()
        except ValueError as e:
            parser.error(f"--cache {args.cache}: {e}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("bench/kernels.py needs a CUDA GPU (use --smoke to check the script on CPU)", file=sys.stderr)
        return 2
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": triton_version, "coefficients": args.coefficients,
        "batch": args.batch, "peak_tflops_assumed": PEAK_TFLOPS,
    }
    peers = load_peers(Path(args.peers), tuple(args.peer_list.split(",")))
    report["peers"] = {k: (v if isinstance(v, str) else "loaded") for k, v in peers.items()}
    methods = methods_for(args, device, peers)
    sections = {
        "ceiling": lambda: gemm_ceiling(device, report),
        "accuracy": lambda: accuracy_checks(args, device, report),
        "shapes": lambda: bench_shapes(args, device, methods, report),
        "methods": lambda: tune_layer_methods(args, device, report),
        "layer": lambda: bench_layer(args, device, methods, report),
        "kv": lambda: bench_kv_batching(args, device, methods, report),
        "breakdown": lambda: breakdown(args, device, report),
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    warm_up_clocks(device)
    for section in args.sections.split(","):
        t0 = time.time()
        try:
            sections[section]()
        except Exception as exc:
            report.setdefault("section_errors", {})[section] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        report.setdefault("section_seconds", {})[section] = time.time() - t0
        autotune_summary(args, report)
        (out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
        (out_dir / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
