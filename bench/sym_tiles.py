"""Sweep of the symmetric-product kernels on the Gram NS product shapes (GPU only).

For each product (an NS polynomial step ``b·R + c·R²`` on m×m, and SYRKs ``X·Xᵀ``) at the
batch sizes one Qwen2.5-7B layer produces, every kernel variant in ``VARIANTS`` and cuBLAS's
full product are checked against the float32 torch path and timed with CUDA events, side by
side in one process. Prints JSON and a markdown table; ``--out`` writes both.

    python bench/sym_tiles.py [--out docs/results/kernels/bench_sym_tiles_h200] [--quick]

TFLOP/s counts the symmetric FLOPs (m²k per matrix, half a full product) for every column,
cuBLAS included, so the numbers compare the time to produce the same symmetric result.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ns import warm_up_clocks  # noqa: E402
from megatron_dmuon.kernels import symmetric_ops  # noqa: E402
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

CASES = [
    ("square", 3584, 3584, 1), ("square", 3584, 3584, 2), ("square", 3584, 3584, 3),
    ("square", 3584, 3584, 5), ("square", 3584, 3584, 8),
    ("syrk", 3584, 3584, 2), ("syrk", 3584, 18944, 3),
]


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


def markdown(rows, names):
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="path stem for .json and .md")
    parser.add_argument("--quick", action="store_true", help="first three cases only")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/sym_tiles.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    warm_up_clocks(torch.device("cuda"))
    cases = CASES[:3] if args.quick else CASES
    rows = []
    for case in cases:
        rows.append(run_case(*case, dtype, VARIANTS))
        print(json.dumps(rows[-1]), flush=True)
    names = ["cublas"] + list(VARIANTS)
    table = markdown(rows, names)
    header = (f"# Symmetric products on {torch.cuda.get_device_name()} ({args.dtype}); ms (symmetric TFLOP/s); "
              "✗ = wrong or not symmetric\n\n")
    print(header + table)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
        Path(args.out + ".md").write_text(header + table + "\n")


if __name__ == "__main__":
    main()
