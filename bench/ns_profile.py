"""Kernel-level breakdown of one batched NS call on the GPU (torch.profiler), per shape and schedule.

    python bench/ns_profile.py [--shapes 2x3584x3584 3x3584x18944] [--out FILE]

Prints, for each stack and schedule ('adaptive' = the per-shape quartic schedule, 'frobenius' =
the previous choice), the wall time of one call (CUDA events, median of 10) and the profiler's
table of GPU kernels by total time: where the time goes beyond the products.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ns_schedules import frobenius_schedule  # noqa: E402
from megatron_dmuon.algorithms.schedules import schedule_for_shape  # noqa: E402
from megatron_dmuon.kernels import orthogonalize_batched  # noqa: E402
from megatron_dmuon.kernels.autotune import time_cuda_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["2x3584x3584", "3x3584x18944"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
