"""Symmetric products on the GPU (the SYRK X·Xᵀ and Gram NS's polynomial steps): our kernels against cuBLAS.

    python bench/symmetric.py tiles [--out docs/results/kernels/bench_sym_tiles_h200] [--quick] [--dtype float16]
    python bench/symmetric.py cutlass [--out PATH_STEM] [--rounds 5] [--cases op:m:k:batch ...] [--no-check]

``tiles``: for each product (an NS polynomial step ``b·R + c·R²`` on m×m, and SYRKs ``X·Xᵀ``) at the
batch sizes one Qwen2.5-7B layer produces, every Triton tile variant in ``VARIANTS`` and cuBLAS's full
product, checked against the float32 torch path and timed with CUDA events, side by side in one process.

``cutlass`` (sm90): 1. builds the CUTLASS library (``cutlass_symmetric.build_library``) and reports the
build time; 2. correctness: every compiled variant × op form (syrk, sym_poly, sym_axpby, general form
with c and diag) × dtype on small and odd shapes, against the float32 torch backend; the result must be
exactly symmetric; 3. timing in interleaved rounds (median): cuBLAS (full product), the two best Triton
variants of docs/results/kernels/bench_sym_tiles_h200_2026-11-30.md, each CUTLASS variant, the best
CUTLASS variant without its mirror pass ("sep") and with the fused mirror ("fused"), each variant
without any mirror, and the separate mirror pass alone.

Both print JSON and a markdown table (``--out``: <stem>.json and <stem>.md). TFLOP/s counts the
symmetric FLOPs (m²k per matrix, half the dense 2m²k) in every column, cuBLAS included, so the numbers
compare the time to produce the same symmetric result.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ns import warm_up_clocks  # noqa: E402
from megatron_dmuon.kernels import cutlass_symmetric as cs, symmetric_ops  # noqa: E402
from megatron_dmuon.kernels.autotune import _op_inputs, relative_error, time_cuda_ms  # noqa: E402
from megatron_dmuon.kernels.triton_symmetric import KernelConfig  # noqa: E402

VARIANTS = {
    "ptr 128x128 s3": KernelConfig(128, 128, 64, 8, 3, 8),
    "ptr 128x128 s4": KernelConfig(128, 128, 64, 8, 4, 8),
    "ptr 128x256 s3": KernelConfig(128, 256, 64, 8, 3, 8),
    "ptr 128x256 s4": KernelConfig(128, 256, 64, 8, 4, 8),
    "tma/tile 128x256 s3": KernelConfig(128, 256, 64, 8, 3, 8, tma=2),
    "tma/tile 128x256 s4": KernelConfig(128, 256, 64, 8, 4, 8, tma=2),
    "tma/pers 128x256 s4": KernelConfig(128, 256, 64, 8, 4, 8, tma=1),
}
TILE_CASES = [
    ("square", 3584, 3584, 1), ("square", 3584, 3584, 2), ("square", 3584, 3584, 3),
    ("square", 3584, 3584, 5), ("square", 3584, 3584, 8),
    ("syrk", 3584, 3584, 2), ("syrk", 3584, 18944, 3),
]

# cutlass: the two best Triton variants of the tiles sweep beside it
TRITON = {"triton ptr 128x256 s4": VARIANTS["ptr 128x256 s4"], "triton tma 128x256 s4": VARIANTS["tma/tile 128x256 s4"]}
CUTLASS_CASES = [("syrk", 3584, 3584, 1), ("syrk", 3584, 3584, 3), ("syrk", 3584, 18944, 3), ("syrk", 512, 3584, 8),
                 ("square", 3584, 3584, 1), ("square", 3584, 3584, 3), ("axpby", 3584, 3584, 3), ("square", 512, 512, 8)]
# The batches the owner step runs on one H200 for the 4-layer Qwen2.5-7B-shaped model: 4 layers x
# (gate, up, down) stacked into one Gram NS call of 12 3584 x 18944 matrices.
BATCHED_CASES = [("syrk", 3584, 18944, 12), ("syrk", 3584, 3584, 12), ("square", 3584, 3584, 12)]


# --- tiles
def run_case(op, m, k, batch, dtype, variants):
    device = torch.device("cuda")
    inputs = _op_inputs(op, m, k, batch, dtype, device)
    reference = symmetric_ops.sym_matmul(**inputs, backend="torch")
    out = torch.empty_like(reference)
    sym_flops = batch * m * m * k * 2 / 2
    row = {"op": op, "m": m, "k": k, "batch": batch}
    candidates = [("cublas", "cublas", None)] + [(name, "triton", cfg) for name, cfg in variants.items()]
    for name, backend, cfg in candidates:
        fn = lambda: symmetric_ops.sym_matmul(**inputs, out=out, backend=backend, config=cfg)  # noqa: E731
        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = relative_error(out, reference)
            sym = bool(torch.equal(out, out.mT)) if backend == "triton" else None
            ms = time_cuda_ms(fn)
            row[name] = {"ms": ms, "tflops": sym_flops / ms / 1e9, "err": err, "symmetric": sym}
        except Exception as exc:  # a variant that fails to compile is reported, not fatal
            row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[-1][:200] if str(exc) else ''}"}
    return row


def tiles_markdown(rows, names):
    lines = ["| product | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in rows:
        cells = []
        for name in names:
            r = row.get(name, {})
            if "ms" in r:
                flag = "" if r["err"] < 5e-3 and r["symmetric"] in (None, True) else " ✗"
                cells.append(f"{r['ms']:.3f} ({r['tflops']:.0f}){flag}")
            else:
                cells.append("fail")
        lines.append(f"| {row['op']} m{row['m']} k{row['k']} b{row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tiles(args):
    dtype = getattr(torch, args.dtype)
    warm_up_clocks(torch.device("cuda"))
    cases = TILE_CASES[:3] if args.quick else TILE_CASES
    rows = []
    for case in cases:
        rows.append(run_case(*case, dtype, VARIANTS))
        print(json.dumps(rows[-1]), flush=True)
    names = ["cublas"] + list(VARIANTS)
    table = tiles_markdown(rows, names)
    header = (f"# Symmetric products on {torch.cuda.get_device_name()} ({args.dtype}); ms (symmetric TFLOP/s); "
              "✗ = wrong or not symmetric\n\n")
    print(header + table)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
        Path(args.out + ".md").write_text(header + table + "\n")


# --- cutlass
def parse_case(text):
    op, m, k, batch = text.split(":")
    return op, int(m), int(k), int(batch)


def inputs_for(op, m, k, batch, dtype):
    if op == "axpby":  # beta·a + a@z with commuting symmetric a, z (z = a² here)
        base = _op_inputs("square", m, m, batch, dtype, torch.device("cuda"))
        a = base["a"]
        z = (a.float() @ a.float()).to(dtype)
        z = ((z + z.mT) / 2).to(dtype)
        return dict(a=a, b=z, c=a, alpha=1.0, beta=0.75, b_symmetric=True)
    return _op_inputs(op, m, k, batch, dtype, torch.device("cuda"))


def check(dtype):
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, k, batch in ((512, 3584, 2), (520, 1000, 3), (136, 264, 1), (3584, 3584, 1)):
        x = torch.randn(batch, m, k, device="cuda", generator=gen, dtype=torch.float32)
        x = (x / x.norm(dim=(-2, -1), keepdim=True)).to(dtype)
        r = (x @ x.mT).to(dtype)
        c = torch.randn(batch, m, m, device="cuda", generator=gen).to(dtype)
        c = ((c + c.mT) / 2).to(dtype)
        forms = {
            "syrk": dict(a=x, b=x.mT),
            "syrk+c+diag": dict(a=x, b=x.mT, c=c, alpha=0.5, beta=-1.25, diag=3.0),
            "poly": dict(a=r, b=r, c=r, alpha=2.0, beta=-4.75, diag=1.5, b_symmetric=True),
            "axpby": dict(a=r, b=r, c=r, alpha=1.0, beta=0.3, b_symmetric=True),
            "2-D syrk": dict(a=x[0], b=x[0].mT, diag=-2.0),
        }
        for name, kw in forms.items():
            ref = symmetric_ops.sym_matmul(**kw, backend="torch")
            for cfg in [cs.CutlassConfig(i, mode) for i in range(cs.NUM_CONFIGS) for mode in cs.MIRRORS]:
                try:
                    out = symmetric_ops.sym_matmul(**kw, backend="cutlass", config=cfg)
                    torch.cuda.synchronize()
                    err = relative_error(out, ref)
                    rows.append({"form": name, "m": m, "k": k, "batch": batch, "cfg": cfg.as_dict(), "err": err,
                                 "symmetric": bool(torch.equal(out, out.mT)),
                                 "max_abs_vs_torch": float((out.float() - ref.float()).abs().max())})
                except Exception as exc:
                    rows.append({"form": name, "m": m, "k": k, "batch": batch, "cfg": cfg.as_dict(), "error": str(exc)[:300]})
    return rows


def time_rounds(fns: dict, rounds: int, reps: int = 10) -> dict:
    samples = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(begin.elapsed_time(end) / reps)
    return {name: statistics.median(v) for name, v in samples.items()}


def bench_case(op, m, k, batch, dtype, rounds):
    kw = inputs_for(op, m, k, batch, dtype)
    ref = symmetric_ops.sym_matmul(**kw, backend="torch")
    out = torch.empty_like(ref)
    fns, errors = {}, {}
    fns["cublas"] = lambda: symmetric_ops.sym_matmul(**kw, out=out, backend="cublas")
    for name, cfg in TRITON.items():
        fns[name] = lambda cfg=cfg: symmetric_ops.sym_matmul(**kw, out=out, backend="triton", config=cfg)
    for cfg in range(cs.NUM_CONFIGS):
        for mirror, tag in ((1, "sep"), (2, "fused")):
            fns[f"cutlass{cfg} {tag}"] = lambda cfg=cfg, mirror=mirror: symmetric_ops.sym_matmul(
                **kw, out=out, backend="cutlass", config=cs.CutlassConfig(cfg, mirror))
    for name, fn in list(fns.items()):
        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            errors[name] = relative_error(out, ref)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            del fns[name]
    lib = cs._library()
    a, b = kw["a"], kw["b"]
    ldb, sb = (b.stride(-1), b.stride(0)) if b.stride(-2) == 1 else (b.stride(-2), b.stride(0))
    stream = torch.cuda.current_stream().cuda_stream
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def raw(cfg, mirror):
        return lambda: lib.dmuon_sym_matmul(cfg, int(dtype == torch.bfloat16), a.data_ptr(), b.data_ptr(),
                                            out.data_ptr(), out.data_ptr(), batch, m, k, a.stride(1), a.stride(0),
                                            ldb, sb, m, m * m, m, m * m, 1.0, 0.0, 0.0, mirror, sms, stream)

    for cfg in range(cs.NUM_CONFIGS):
        fns[f"cutlass{cfg} no-mirror"] = raw(cfg, 0)
    lib.dmuon_mirror.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p]
    fns["mirror only"] = lambda: lib.dmuon_mirror(out.data_ptr(), batch, m, m, m * m, stream)
    ms = time_rounds(fns, rounds)
    flops = batch * m * m * k
    return {"op": op, "m": m, "k": k, "batch": batch, "errors": errors,
            "ms": ms, "tflops": {n: flops / t / 1e9 for n, t in ms.items()}}


def cutlass(args):
    dtype = getattr(torch, args.dtype)
    start = time.time()
    error = cs.warm_up()
    result = {"device": torch.cuda.get_device_name(), "build_s": time.time() - start, "build_error": error}
    print(json.dumps(result), flush=True)
    if error:
        raise SystemExit(error)
    if not args.no_check:
        result["check"] = check(torch.float16) + check(torch.bfloat16)
        bad = [r for r in result["check"] if "error" in r or not r["symmetric"] or r["err"] > 3e-2]
        print(json.dumps({"checks": len(result["check"]), "bad": bad[:20]}), flush=True)
    warm_up_clocks(torch.device("cuda"))
    result["cases"] = []
    for case in args.cases or CUTLASS_CASES + BATCHED_CASES:
        row = bench_case(*case, dtype, args.rounds)
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
    names = list(result["cases"][0]["ms"])
    lines = [f"# {result['device']} ({args.dtype}): ms (symmetric TFLOP/s = m²k/t)", "",
             "| product | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in result["cases"]:
        cells = [f"{row['ms'][n]:.3f} ({row['tflops'][n]:.0f})" if n in row["ms"] else "fail" for n in names]
        lines.append(f"| {row['op']} m{row['m']} k{row['k']} b{row['batch']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))
        Path(args.out + ".md").write_text(table + "\n")


def main(argv=None):
    from cli_inputs import OneLineParser  # (bench/, on the path when this runs as a script)

    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="backend", required=True)
    t = sub.add_parser("tiles", help="every Triton tile variant and cuBLAS on the Gram NS product shapes")
    t.add_argument("--out", default=None, help="path stem for .json and .md")
    t.add_argument("--quick", action="store_true", help="first three cases only")
    t.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    c = sub.add_parser("cutlass", help="the CUTLASS sm90 backend: build, correctness, timing vs Triton and cuBLAS")
    c.add_argument("--out", default=None)
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    c.add_argument("--cases", nargs="*", type=parse_case, default=None,
                        help="op:m:k:batch ... (default: the standard cases and the owner step's batches)")
    c.add_argument("--no-check", action="store_true", help="skip the correctness section")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/symmetric.py needs a CUDA GPU")
    tiles(args) if args.backend == "tiles" else cutlass(args)


if __name__ == "__main__":
    main()
