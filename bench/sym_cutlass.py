"""CUTLASS sm90 symmetric-product backend vs Triton and cuBLAS (GPU only).

1. Builds the CUTLASS library (``cutlass_symmetric.build_library``) and reports the build time.
2. Correctness: every compiled variant × op form (syrk, sym_poly, sym_axpby, general form with
   c and diag) × dtype on small and odd shapes, against the float32 torch backend; the result
   must be exactly symmetric.
3. Timing, interleaved rounds (median): cuBLAS (full product), the two best Triton variants of
   docs/results/kernels/bench_sym_tiles_h200_2026-11-30.md, each CUTLASS variant, the best CUTLASS variant without its
   mirror pass ("sep") and with the fused mirror ("fused"), each variant without any mirror,
   and the separate mirror pass alone.

    python bench/sym_cutlass.py [--out PATH_STEM] [--rounds 5]

TFLOP/s counts the symmetric FLOPs (m²k per matrix, half the dense 2m²k) in every column.
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

from megatron_dmuon.kernels import cutlass_symmetric as cs, symmetric_ops  # noqa: E402
from megatron_dmuon.kernels.autotune import _op_inputs, relative_error  # noqa: E402
from megatron_dmuon.kernels.triton_symmetric import KernelConfig  # noqa: E402

TRITON = {"triton ptr 128x256 s4": KernelConfig(128, 256, 64, 8, 4, 8),
          "triton tma 128x256 s4": KernelConfig(128, 256, 64, 8, 4, 8, tma=2)}
CASES = [("syrk", 3584, 3584, 1), ("syrk", 3584, 3584, 3), ("syrk", 3584, 18944, 3), ("syrk", 512, 3584, 8),
         ("square", 3584, 3584, 1), ("square", 3584, 3584, 3), ("axpby", 3584, 3584, 3), ("square", 512, 512, 8)]
# The batches the owner step runs on one H200 for the 4-layer Qwen2.5-7B-shaped model: 4 layers x
# (gate, up, down) stacked into one Gram NS call of 12 3584 x 18944 matrices.
BATCHED_CASES = [("syrk", 3584, 18944, 12), ("syrk", 3584, 3584, 12), ("square", 3584, 3584, 12)]


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--cases", nargs="*", type=parse_case, default=None,
                        help="op:m:k:batch ... (default: the standard cases and the owner step's batches)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness section")
    args = parser.parse_args(argv)
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
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(100):
        a @ a
    result["cases"] = []
    for case in args.cases or CASES + BATCHED_CASES:
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


if __name__ == "__main__":
    main()
