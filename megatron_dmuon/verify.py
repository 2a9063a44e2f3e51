"""`dmuon verify`: DMuon at a given DP size vs the single-process Muon reference.

CPU (default): spawns N gloo ranks with the CPU shim and runs the reference in one process.
GPU: launch under torchrun (`torchrun --nproc-per-node N -m megatron_dmuon.cli verify --bf16`);
each rank trains with NCCL, rank 0 then runs the fp32 reference on its GPU.
Prints the max relative parameter difference per tensor; exits 1 above the tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# bf16 params (rounding 2^-8 per update), bf16 grads and bf16 NS against the fp32 reference after
# 10 steps at lr 2e-2: measured 8.7e-2 worst tensor on CPU/gloo DP=2; bound with margin.
BF16_TOL = 1.5e-1
FP32_TOL = 1e-6


def _parser():
    p = argparse.ArgumentParser(prog="dmuon verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel world size (CPU spawn mode)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="bf16 params and bf16 NS (tolerance %g)" % BF16_TOL)
    p.add_argument("--overlap", action="store_true", help="overlap_grad_reduce + overlap_param_gather")
    p.add_argument("--tol", type=float, default=None, help="max relative difference allowed per tensor")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _report(diffs, tol, as_json, meta):
    worst = max(diffs.values())
    ok = worst <= tol
    if as_json:
        print(json.dumps({**meta, "max_rel_diff": worst, "tolerance": tol, "ok": ok, "per_tensor": diffs}))
    else:
        width = max(len(n) for n in diffs)
        print(f"{'tensor':<{width}}  max rel diff")
        for n, d in diffs.items():
            print(f"{n:<{width}}  {d:.3e}")
        print(f"worst {worst:.3e} vs tolerance {tol:.1e}: {'PASS' if ok else 'FAIL'} ({meta})")
    return 0 if ok else 1


def _diffs(params, ref):
    return {n: float((params[n].float().cpu() - p.float().cpu()).norm() / p.float().norm().clamp(min=1e-30))
            for n, p in ref.items()}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    tol = args.tol if args.tol is not None else (BF16_TOL if args.bf16 else FP32_TOL)
    kw = dict(steps=args.steps, grad_accum=args.grad_accum, overlap=args.overlap,
              shape_kw=dict(bf16=args.bf16), ns_dtype="bfloat16" if args.bf16 else "float32")
    if "LOCAL_RANK" in os.environ:  # under torchrun: NCCL on GPUs
        return _main_torchrun(args, kw, tol)
    if args.dp < 1:
        print("dmuon verify: --dp must be >= 1", file=sys.stderr)
        return 2
    from .testing.multiproc import run_distributed

    results = run_distributed("megatron_dmuon.testing.workers:dmuon_dp", args.dp, kwargs=kw)
    ref_kw = dict(kw, shape_kw={}, ns_dtype="float32" if args.bf16 else kw["ns_dtype"])
    ref_kw.pop("overlap")
    ref = run_distributed("megatron_dmuon.testing.workers:reference", 1,
                          kwargs=dict(dp=args.dp, layouts=None if args.bf16 else results[0]["layouts"], **ref_kw))[0]
    ns_ok = results[0]["ns_counts"] == [results[0]["num_matrices"]] * args.steps
    code = _report(_diffs(results[0]["params"], ref["params"]), tol, args.json,
                   {"dp": args.dp, "backend": "gloo", "bf16": args.bf16, "each_matrix_once": ns_ok})
    return code if ns_ok else 1


def _main_torchrun(args, kw, tol):
    from .testing import workers

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "nccl"
    else:  # torchrun on a CPU machine: gloo through the test shim
        from .testing import cpu_shim

        cpu_shim.install()
        backend = "gloo"
    torch.distributed.init_process_group(backend)
    res = workers.dmuon_dp(rank, world, **kw)
    code = 0
    if rank == 0:  # the reference needs no collectives: run it here while the others wait
        ref_kw = dict(kw, shape_kw={}, ns_dtype="float32")
        ref_kw.pop("overlap")
        ref = workers.reference(0, 1, dp=world, layouts=None if args.bf16 else res["layouts"], **ref_kw)
        code = _report(_diffs(res["params"], ref["params"]), tol, args.json,
                       {"dp": world, "backend": backend, "bf16": args.bf16})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return code


