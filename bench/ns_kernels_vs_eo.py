"""DMuon's Newton-Schulz paths against Emerging-Optimizers' (EO) ``newton_schulz``, per Muon matrix shape
(JSON + markdown). EO's is the NS Megatron-LM's Muon runs (main's TensorParallelMuon and PR #6683's
LayerShardedMuon), with and without its Triton SYRK kernel (``use_syrk``, EO >= 0.4.0).

    python bench/ns_kernels_vs_eo.py [--device cuda] [--shapes all | NAME,RxC,...] [--steps 5]
                                     [--coefficient-type quintic] [--batch 4] [--reps 10] [--warmup 3]
                                     [--syrk-shapes all | none | NAME,RxC,...] [--out-dir DIR] [--name NAME]
    python bench/ns_kernels_vs_eo.py --device cpu --shapes 64x128 --reps 2   # a smoke run (torch fallbacks)

Shapes (``--shapes all``, the default): every distinct Muon matrix shape of Qwen2.5-7B and Qwen2.5-32B as the
model stores it (Q/O, K/V, the fused QKV that ``--muon-no-split-qkv`` orthogonalizes whole, gate/up apart as
DMuon orthogonalizes them, the fused SwiGLU fc1 as Megatron's Muon does, down) and (12288, 10240), the shape
PR #6683 quotes its SYRK timing at (after the 7B shapes). ``--stop-after-s`` bounds a run: the shapes not
started by then are rows that say so (the JSON and markdown are written after every shape).

Rows per shape, all at the same coefficients (EO's ``--coefficient-type``, DMuon running the same (a, b, c) per
step: ``algorithms.eo_coefficients.eo_schedule``) and step count, from the same bf16 matrix (EO takes fp32
only: its rows get the same values in fp32, cast before the timer):

* ``dmuon_gram``      DMuon's Gram NS, fp16 (``kernels.gram_newton_schulz_fast``; aspect >= 2 only);
* ``dmuon_standard``  DMuon's standard NS, bf16, symmetric products (``kernels.newton_schulz_fast``);
* ``dmuon_batched``   a stack of ``--batch`` such matrices in one call (``kernels.orthogonalize_batched``,
                      'auto': Gram or standard, each at its own dtype, as DMuon's owner step runs a shape group);
* ``eo``              EO ``newton_schulz`` under ``torch.set_float32_matmul_precision('medium')`` (Megatron's
                      ``--muon-fp32-matmul-prec medium``: the iterations in bf16);
* ``eo_syrk``         the same with ``use_syrk=True`` (EO >= 0.4.0, CUDA, dims divisible by 8; ``--syrk-shapes``:
                      its Triton autotuning takes about a minute per new shape, reported as the first call);
* ``eo_batched``      EO ``newton_schulz`` on the 3-D stack (what PR #6683 runs for ``--muon-ns-batch-size`` > 1).

Each row: median ms of ``--reps`` calls after ``--warmup`` (CUDA events; wall clock on CPU), ms per matrix for
the stacks, the first call's seconds (compilation, autotuning), TFLOP/s at two counts
(``algorithms/flops.py``, multiply-add = 2): the standard NS with full GEMMs, ``2T(2α+1)m³`` per matrix (one
yardstick for every row), and the path's own count (Gram's; symmetric products at half for DMuon's kernels and
EO's SYRK), and the relative Frobenius distance of its output to EO's (same coefficients: bf16 rounding apart).
A row that cannot run here says why (``skipped``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_inputs import OneLineParser, check_device  # noqa: E402
from bench.ns import time_calls, warm_up_clocks  # noqa: E402
from megatron_dmuon.algorithms.eo_coefficients import EO_TABLES, FIXED_STEPS, eo_schedule  # noqa: E402
from megatron_dmuon.algorithms.flops import newton_schulz_flops  # noqa: E402
from megatron_dmuon.algorithms.gram_newton_schulz import gram_applies  # noqa: E402
from megatron_dmuon.kernels import gram_newton_schulz_fast, newton_schulz_fast, orthogonalize_batched  # noqa: E402

# name: (rows, cols) as the model stores the weight (Megatron-LM's layouts)
SHAPES = {
    "7b.qo": (3584, 3584), "7b.kv": (512, 3584), "7b.qkv": (4608, 3584), "7b.gateup": (18944, 3584),
    "7b.fc1": (37888, 3584), "7b.down": (3584, 18944),
    "12288x10240": (12288, 10240),
    "32b.qo": (5120, 5120), "32b.kv": (1024, 5120), "32b.qkv": (7168, 5120), "32b.gateup": (27648, 5120),
    "32b.fc1": (55296, 5120), "32b.down": (5120, 27648),
}
PATHS = ("dmuon_gram", "dmuon_standard", "dmuon_batched", "eo", "eo_syrk", "eo_batched")
BATCHED = {"dmuon_batched", "eo_batched"}


def parse_shape_list(parser, flag: str, spec: str, allow_none: bool = False) -> dict:
    """``all`` / ``none`` / comma-separated names of SHAPES or RxC -> {name: (rows, cols)}; one usage line else."""
    spec = spec.strip()
    if spec == "all":
        return dict(SHAPES)
    if allow_none and spec == "none":
        return {}
    out = {}
    for token in filter(None, (t.strip() for t in spec.split(","))):
        if token in SHAPES:
            out[token] = SHAPES[token]
            continue
        parts = token.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            parser.error(f"{flag} {token!r}: give all{', none' if allow_none else ''}, names of "
                         f"{', '.join(SHAPES)}, or RxC with positive integers (e.g. 64x128)")
        out[token] = (int(parts[0]), int(parts[1]))
    if not out:
        parser.error(f"{flag} {spec!r} names no shape; give all, a name ({', '.join(SHAPES)}) or RxC")
    return out


def eo_api():
    """(EO's newton_schulz or None, its version, why SYRK cannot run or None, why EO cannot run or None)."""
    try:
        import emerging_optimizers
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
    except ImportError as e:
        return None, None, "Emerging-Optimizers is not importable", f"Emerging-Optimizers is not importable ({e})"
    version = str(getattr(emerging_optimizers, "__version__", "unknown"))
    try:
        new_enough = tuple(int(p) for p in version.split(".")[:2]) >= (0, 4)
    except ValueError:
        new_enough = False
    no_syrk = None if new_enough else f"use_syrk needs Emerging-Optimizers >= 0.4.0 (this is {version})"
    if no_syrk is None:
        try:
            from emerging_optimizers import triton_kernels
            if not getattr(triton_kernels, "HAS_TRITON_340", False):
                no_syrk = "EO's SYRK kernel needs Triton >= 3.4 (triton_kernels.HAS_TRITON_340 is False)"
        except ImportError as e:
            no_syrk = f"EO's SYRK kernel does not import ({e})"
    return newton_schulz, version, no_syrk, None


def own_flops(path: str, rows: int, cols: int, steps: int, kernels: bool) -> float:
    """The path's own FLOPs for one matrix (symmetric products at half where a symmetric kernel runs them)."""
    if path == "dmuon_gram" or (path == "dmuon_batched" and gram_applies(rows, cols)):
        return newton_schulz_flops(rows, cols, steps, "gram", symmetric=kernels)
    symmetric = (path in ("dmuon_standard", "dmuon_batched") and kernels) or path == "eo_syrk"
    return newton_schulz_flops(rows, cols, steps, "standard", symmetric=symmetric)


def path_calls(path, x16, x32, stack16, stack32, schedule, args, eo_ns):
    """The zero-argument call that runs ``path`` once (None: not here)."""
    steps, ctype = args.steps, args.coefficient_type
    if path == "dmuon_gram":
        return lambda: gram_newton_schulz_fast(x16, coefficients=schedule, steps=steps, compute_dtype=torch.float16)
    if path == "dmuon_standard":
        return lambda: newton_schulz_fast(x16, coefficients=schedule, steps=steps, compute_dtype=torch.bfloat16)
    if path == "dmuon_batched":
        return lambda: orthogonalize_batched(stack16, "auto", coefficients=schedule, steps=steps)
    if path == "eo":
        return lambda: eo_ns(x32, steps, ctype)
    if path == "eo_syrk":
        return lambda: eo_ns(x32, steps, ctype, use_syrk=True)
    if path == "eo_batched":
        return lambda: eo_ns(stack32, steps, ctype)
    raise ValueError(path)


def skip_reason(path, rows, cols, name, args, device, eo_missing, no_syrk, syrk_shapes):
    if path.startswith("eo") and eo_missing:
        return eo_missing
    if path == "dmuon_gram" and not gram_applies(rows, cols):
        return "aspect < 2: DMuon's Gram path runs its standard NS here (the dmuon_standard row)"
    if path == "eo_syrk":
        if no_syrk:
            return no_syrk
        if device.type != "cuda":
            return "EO's SYRK kernel is a Triton kernel: it needs CUDA (--device cuda)"
        if rows % 8 or cols % 8:
            return "EO runs SYRK only for dimensions divisible by 8"
        if name not in syrk_shapes:
            return "not in --syrk-shapes (its Triton autotuning takes about a minute per new shape)"
    return None


def measure(fn, args, device):
    """(first call's seconds, median ms, min ms, output of one call)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    first = time.perf_counter() - t0
    times = time_calls(fn, args.reps, args.warmup, device)
    return first, statistics.median(times), min(times), out


def rel_diff(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


def bench(args, device, save=None) -> dict:
    """Every row of every shape; ``save(report)`` after each shape (a run stopped midway keeps what it measured)."""
    eo_ns, eo_version, no_syrk, eo_missing = eo_api()
    schedule = list(eo_schedule(args.coefficient_type, args.steps))
    kernels = device.type == "cuda"
    warm_up_clocks(device)
    torch.manual_seed(0)
    rows_out = []
    previous = torch.get_float32_matmul_precision()

    def report():
        return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "emerging_optimizers": eo_version,
                "coefficient_type": args.coefficient_type, "steps": args.steps, "coefficients": schedule,
                "input_dtype": "bfloat16 (EO: the same values in fp32)", "batch": args.batch, "reps": args.reps,
                "warmup": args.warmup,
                "dmuon_backend": "Triton/CUDA kernels (autotuned)" if kernels else "torch fallback (CPU)",
                "shapes": {n: list(s) for n, s in args.shape_map.items()}, "rows": rows_out}

    try:
        started = time.perf_counter()
        for name, (r, c) in args.shape_map.items():
            if rows_out and args.stop_after_s is not None and time.perf_counter() - started > args.stop_after_s:
                why = f"not started: --stop-after-s {args.stop_after_s:g} had passed (run it with --shapes {name})"
                rows_out.extend({"shape": name, "rows": r, "cols": c, "path": path, "status": "skipped", "reason": why,
                                 "batch": args.batch if path in BATCHED else 1} for path in PATHS)
                print(f"{name}: {why}", flush=True)
                continue
            x16 = torch.randn(r, c, device=device).to(torch.bfloat16)
            stack16 = torch.randn(args.batch, r, c, device=device).to(torch.bfloat16)
            x32, stack32 = x16.float(), stack16.float()
            standard = newton_schulz_flops(r, c, args.steps, "standard", symmetric=False)
            reference = {}
            for path in PATHS:
                row = {"shape": name, "rows": r, "cols": c, "path": path,
                       "batch": args.batch if path in BATCHED else 1}
                why = skip_reason(path, r, c, name, args, device, eo_missing, no_syrk, args.syrk_map)
                if why:
                    rows_out.append({**row, "status": "skipped", "reason": why})
                    print(f"{name} {path}: skipped ({why})", flush=True)
                    continue
                # Megatron's --muon-fp32-matmul-prec medium around EO's call (its iterations in bf16)
                torch.set_float32_matmul_precision("medium" if path.startswith("eo") else previous)
                try:
                    first, ms, best, out = measure(path_calls(path, x16, x32, stack16, stack32, schedule, args, eo_ns),
                                                   args, device)
                except Exception as e:  # a path that fails here is reported, the rest still run
                    rows_out.append({**row, "status": "failed", "reason": f"{type(e).__name__}: {e}"[:300]})
                    print(f"{name} {path}: failed ({type(e).__name__}: {e})", flush=True)
                    continue
                finally:
                    torch.set_float32_matmul_precision(previous)
                per = ms / row["batch"]
                own = own_flops(path, r, c, args.steps, kernels)
                first_matrix = (out[0] if path in BATCHED else out).float()
                if path in ("eo", "eo_batched"):
                    reference[path] = first_matrix
                rows_out.append({**row, "status": "ok", "ms": ms, "min_ms": best, "ms_per_matrix": per,
                                 "first_call_s": first, "flops_standard": standard, "flops_own": own,
                                 "tflops_standard": standard / (per * 1e-3) / 1e12,
                                 "tflops_own": own / (per * 1e-3) / 1e12, "_out": first_matrix})
                print(f"{name} {path}: {ms:.3f} ms ({per:.3f} ms/matrix), first call {first:.1f} s", flush=True)
            for row in rows_out:
                out = row.pop("_out", None)
                if out is None or row["shape"] != name:
                    continue
                ref = reference.get("eo_batched" if row["path"] in BATCHED else "eo")
                row["rel_diff_to_eo"] = rel_diff(out, ref) if ref is not None else None
            del x16, stack16, x32, stack32, reference
            if save:
                save(report())
    finally:
        torch.set_float32_matmul_precision(previous)
    return report()


def _num(v, spec):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    return format(v, spec) if abs(v) >= 1 or spec.endswith("e") else format(v, ".3g")  # (CPU smoke runs: tiny)


def markdown(report: dict) -> str:
    lines = [f"NS kernels vs Emerging-Optimizers {report['emerging_optimizers'] or '(not importable)'}: "
             f"{report['device']}, torch {report['torch']}, {report['coefficient_type']} coefficients, "
             f"{report['steps']} steps, {report['input_dtype']}; DMuon: {report['dmuon_backend']}; stacks of "
             f"{report['batch']}; median of {report['reps']} after {report['warmup']} warm-up calls. TFLOP/s: std = "
             "standard NS with full GEMMs (2T(2α+1)m³ per matrix, every row), own = the path's own count "
             "(algorithms/flops.py).", "",
             "| shape | rows x cols | path | ms | ms / matrix | TFLOP/s (std) | TFLOP/s (own) | first call s | "
             "rel. diff to EO |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        head = f"| {row['shape']} | {row['rows']}x{row['cols']} | {row['path']}" + (
            f" (x{row['batch']})" if row["batch"] > 1 else "")
        if row["status"] != "ok":
            lines.append(f"{head} | {row['status']}: {row['reason']} | | | | | |")
            continue
        lines.append(f"{head} | {row['ms']:.3f} | {row['ms_per_matrix']:.3f} | {_num(row['tflops_standard'], '.1f')} | "
                     f"{_num(row['tflops_own'], '.1f')} | {row['first_call_s']:.2f} | "
                     f"{_num(row.get('rel_diff_to_eo'), '.2e')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="all", help=f"all, or names ({', '.join(SHAPES)}) and RxC, comma-separated")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--coefficient-type", default="quintic", choices=sorted(EO_TABLES),
                   help="EO's coefficient type (Megatron's --muon-coefficient-type); DMuon runs the same sets")
    p.add_argument("--batch", type=int, default=4, help="matrices per stack in the batched rows (4 layers' worth)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--syrk-shapes", default="all", help="shapes of the eo_syrk rows: all, none, or a list")
    p.add_argument("--stop-after-s", type=float, default=None,
                   help="start no shape but the first after this many seconds (its rows: skipped, naming the flag)")
    p.add_argument("--out-dir", default=os.environ.get("OUT"), help="folder for the JSON and markdown")
    p.add_argument("--name", default="ns_kernels_vs_eo")
    args = p.parse_args(argv)
    for flag, value, low in (("--steps", args.steps, 1), ("--batch", args.batch, 1), ("--reps", args.reps, 1),
                             ("--warmup", args.warmup, 0)):
        if value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    if FIXED_STEPS.get(args.coefficient_type, args.steps) != args.steps:
        p.error(f"--coefficient-type {args.coefficient_type} runs exactly {FIXED_STEPS[args.coefficient_type]} steps "
                f"(Emerging-Optimizers refuses others); give --steps {FIXED_STEPS[args.coefficient_type]}")
    if args.coefficient_type == "custom" or args.coefficient_type not in EO_TABLES:
        p.error(f"--coefficient-type {args.coefficient_type}: no sets to run")
    args.shape_map = parse_shape_list(p, "--shapes", args.shapes)
    args.syrk_map = parse_shape_list(p, "--syrk-shapes", args.syrk_shapes, allow_none=True)
    check_device(p, args.device)
    device = torch.device(args.device)

    def save(report):
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
                json.dump(report, f, indent=1)
            with open(os.path.join(args.out_dir, f"{args.name}.md"), "w") as f:
                f.write(markdown(report))

    report = bench(args, device, save)
    save(report)
    print("\n" + markdown(report), flush=True)
    failed = [r for r in report["rows"] if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
