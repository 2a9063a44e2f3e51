"""`dmuon-verify`: DMuon at a given DP x TP x PP (x EP) layout vs the single-process Muon reference
(--vpp: Megatron's interleaved pipeline schedule, one model chunk per virtual stage).

CPU (default): spawns dp x tp x pp gloo ranks with the CPU test shim and runs the TP=PP=EP=1
reference in one process. GPU: launch under torchrun
(`torchrun --nproc-per-node N -m megatron_dmuon.testing.verify_cli --tp 2 --bf16`); every rank trains on
NCCL, rank 0 then runs the reference in a fresh single-rank CPU process. Prints the max relative parameter difference per
tensor (parameters merged over TP shards, PP stages and EP experts); exits 1 above the tolerance
or if a matrix was not orthogonalized exactly once per step.

Resume (--resume-at K): train K steps, save the model and the optimizer (dist_checkpointing
torch_dist, or the torch format with --resume-format torch), train on to --steps: the
uninterrupted run; then build a fresh (perturbed) model and optimizer, load, train K..--steps and
compare parameters AND optimizer state (fp32 masters, momentum, AdamW moments and step) with the
uninterrupted run: bit-identical at the same layout. --resume-dp / --resume-tp / --resume-vpp
resume at another layout (the checkpoint is resharded; float64 on CPU, compared within the
tolerance). The checkpoint lives in a temporary directory that is removed afterwards.

Precision: fp32 without TP/EP is bit-exact, PP and VPP included (the reference reproduces the
reduce-scatter's summation order of every stage and chunk; pipeline stages pass the same fp32
activations and gradients a single process computes). A TP/EP forward sums in a different order
than TP=1, and NS amplifies that fp32 noise to ~1e-5 in 10 steps (Megatron's own AdamW differs by
1.3e-6 after one step), so on CPU those layouts run in float64 by default (Megatron's fp32 code
path carrying float64, see testing/cpu_shim), where the comparison is exact to ~1e-13.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..planning.tp_cost import TP_METHODS
from ..algorithms.flops import NS_METHODS
from ..algorithms.update_rule import UPDATE_RULES, UpdateRule

# bf16 params (rounding 2^-8 per update), bf16 grads and bf16 NS against the fp32 reference after
# 10 steps at lr 2e-2: measured 8.7e-2 worst tensor on CPU/gloo DP=2; bound with margin.
BF16_TOL = 1.5e-1
FP32_TOL = 1e-6
FP64_TOL = 1e-10
# fp32 with TP/PP/EP: the forward sums in another order than the TP=1 reference; measured 8e-5
# worst tensor after 10 steps at TP=2 on CPU (NS amplifies the rounding noise); bound with margin.
FP32_REORDERED_TOL = 5e-4
PRECISIONS = ("auto", "fp32", "fp64", "bf16")


def layout_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser shared by the diagnostic CLIs (verify, check): --dp and --tp."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel size (CPU spawn mode; world = dp x tp x pp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    return p


def torchrun_backend() -> str:
    """Under torchrun: NCCL on this rank's GPU, else gloo through the CPU test shim."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return "nccl"
    from . import cpu_shim

    cpu_shim.install()
    return "gloo"


def _parser():
    p = layout_parser("dmuon-verify", __doc__)
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=1,
                   help="virtual stages per pipeline rank (Megatron's interleaved schedule; needs --pp > 1). The "
                        "checked GPT then has --pp x --vpp layers, one per model chunk; --overlap aligns the param "
                        "all-gathers to the schedule as Megatron-LM does")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (a MoE GPT with 4 experts per layer)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="auto: fp32 for pure DP, fp64 with TP/PP/EP on CPU (fp32 on GPU)")
    p.add_argument("--bf16", action="store_true", help="bf16 params and bf16 NS (tolerance %g)" % BF16_TOL)
    p.add_argument("--overlap", action="store_true", help="overlap_grad_reduce + overlap_param_gather")
    p.add_argument("--split", choices=("qkv", "heads", "glu"), default=None, help="orthogonalize split pieces")
    p.add_argument("--ns-method", choices=NS_METHODS, default="standard", help="NS variant (the reference uses the same)")
    p.add_argument("--tp-method", choices=TP_METHODS, default="auto",
                   help="TP matrices: gather to the owner, distributed Gram (needs --ns-method gram/auto), or auto")
    p.add_argument("--update", choices=UPDATE_RULES, default="muon",
                   help="owners' update rule (--dmuon-update); dion3 and normuon run without Nesterov")
    p.add_argument("--fraction", type=float, default=None, help="dion3: share of rows (--dmuon-fraction; default 0.25)")
    p.add_argument("--tol", type=float, default=None, help="max relative difference allowed per tensor")
    p.add_argument("--resume-at", type=int, default=None, metavar="K",
                   help="save after K steps, resume a fresh model and optimizer from it, compare with the uninterrupted run")
    p.add_argument("--resume-format", choices=("dist", "torch"), default="dist",
                   help="dist: dist_checkpointing torch_dist (default); torch: state_dict() + save_parameter_state()")
    p.add_argument("--resume-dp", type=int, default=None, help="resume at this DP size (resharding; default --dp)")
    p.add_argument("--resume-tp", type=int, default=None, help="resume at this TP size (resharding; default --tp)")
    p.add_argument("--resume-vpp", type=int, default=None,
                   help="resume at this number of virtual stages (resharding; default --vpp)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _check(args, p):
    for name in ("dp", "tp", "pp", "vpp", "ep", "steps", "grad_accum"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})"
                    + ("; --steps 0 would check nothing" if name == "steps" else ""))
    if args.tol is not None and not (0 < args.tol < float("inf")):
        p.error(f"--tol must be a finite number > 0 (got {args.tol}): the largest relative difference allowed per tensor")
    from ..megatron.gpt import GPTShape

    shape = GPTShape()  # the checked model (verify's workers build it)
    for what, size in (("attention heads", shape.num_attention_heads), ("query groups", shape.num_query_groups),
                       ("FFN width", shape.ffn_hidden_size)):
        if size % args.tp:
            p.error(f"--tp {args.tp} must divide the checked GPT's {what} ({size}): use --tp 1 or 2")
    interleaved = max(args.vpp, args.resume_vpp or 1) > 1  # the checked GPT: one layer per model chunk
    if not interleaved and shape.num_layers % args.pp:
        p.error(f"--pp {args.pp} must divide the checked GPT's {shape.num_layers} layers: use --pp 1 or 2")
    for flag, vpp in (("--vpp", args.vpp), ("--resume-vpp", args.resume_vpp)):
        if vpp is not None and vpp > 1 and args.pp < 2:
            p.error(f"{flag} {vpp} needs --pp > 1: virtual stages interleave a pipeline (got --pp {args.pp})")
    runs = [(args.vpp, args.grad_accum)]  # (virtual stages, micro-batches per rank) of each run
    if args.resume_at is not None and args.resume_dp and (args.dp * args.grad_accum) % args.resume_dp == 0:
        runs.append((args.resume_vpp or args.vpp, args.dp * args.grad_accum // args.resume_dp))
    elif args.resume_at is not None:
        runs.append((args.resume_vpp or args.vpp, args.grad_accum))
    for vpp, micro in runs:
        if vpp > 1 and micro < args.pp:
            p.error(f"--grad-accum {args.grad_accum} gives {micro} micro-batch(es) per rank, fewer than --pp {args.pp}: "
                    "Megatron's interleaved schedule (--vpp / --resume-vpp) needs at least one per pipeline stage")
    if 4 % args.ep:
        p.error(f"--ep {args.ep} must divide the checked MoE GPT's 4 experts: use --ep 1, 2 or 4")
    if args.bf16:
        args.precision = "bf16"
    if args.fraction is not None and (not UpdateRule(args.update).selects_fraction or not 0.0 < args.fraction <= 1.0):
        p.error(f"--fraction {args.fraction} needs --update dion3 and a value in (0, 1]")
    if args.resume_at is not None and not 1 <= args.resume_at < args.steps:
        p.error(f"--resume-at must be in [1, --steps) = [1, {args.steps}) (got {args.resume_at})")
    if args.resume_at is None and (args.resume_dp or args.resume_tp or args.resume_vpp):
        p.error("--resume-dp / --resume-tp / --resume-vpp need --resume-at K")
    for name in ("resume_dp", "resume_tp", "resume_vpp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.resume_dp and (args.dp * args.grad_accum) % args.resume_dp:
        p.error(f"--resume-dp {args.resume_dp} must divide the global batch of --dp x --grad-accum = "
                f"{args.dp * args.grad_accum} micro-batches")
    if args.resume_format == "torch" and (args.resume_tp not in (None, args.tp)
                                          or args.resume_vpp not in (None, args.vpp)):
        p.error("--resume-format torch keeps one file per TP/PP rank (its model chunks inside): it reshards over "
                "DP only")


def _reshards(args) -> bool:
    return ((args.resume_dp or args.dp) != args.dp or (args.resume_tp or args.tp) != args.tp
            or (args.resume_vpp or args.vpp) != args.vpp)


def _reorders_sums(args) -> bool:
    """Whether the layout sums in another order than the reference can reproduce: a TP/EP forward
    (row-parallel partial sums, vocab-parallel cross-entropy). Pipeline stages and virtual stages
    do not (they pass on the values one process computes; the DP reduce order is reproduced)."""
    return args.tp > 1 or args.ep > 1


def _precision(args, on_gpu: bool) -> str:
    if args.precision != "auto":
        return args.precision
    exact = not _reorders_sums(args) and not _reshards(args)
    return "fp32" if on_gpu or exact else "fp64"


def _num_layers(pp: int, vpp: int) -> int:
    """The checked GPT's depth: 2 layers, or one per model chunk under the interleaved schedule."""
    return 2 if vpp == 1 else pp * vpp


def _run_kwargs(args, precision):
    shape = dict(bf16=precision == "bf16", fp64=precision == "fp64")
    if args.ep > 1:
        shape["num_experts"] = 4
    if args.vpp > 1 or (args.resume_vpp or 1) > 1:  # a resharded resume keeps the saved model
        shape["num_layers"] = _num_layers(args.pp, max(args.vpp, args.resume_vpp or 1))
    ns_dtype = {"bf16": "bfloat16", "fp64": "float64"}.get(precision, "float32")
    return dict(steps=args.steps, grad_accum=args.grad_accum, overlap=args.overlap, tp=args.tp, pp=args.pp,
                vpp=args.vpp, align_param_gather=args.overlap and args.vpp > 1, ep=args.ep, shape_kw=shape,
                ns_dtype=ns_dtype, split=args.split,
                muon_kw=dict(ns_method=args.ns_method, tp_method=args.tp_method, **_update_kwargs(args)))


def _update_kwargs(args) -> dict:
    rule = UpdateRule(args.update)
    if not rule.by_rows:
        return {}
    return dict(update=args.update, fraction=rule.default_fraction if args.fraction is None else args.fraction,
                nesterov=False)


def _reference_kwargs(kw, precision):
    ref = {k: v for k, v in kw.items() if k not in ("overlap", "tp", "pp", "vpp", "ep", "align_param_gather")}
    if precision == "bf16":  # the reference is fp32
        ref["shape_kw"] = {k: v for k, v in kw["shape_kw"].items() if k != "bf16"}
        ref["ns_dtype"] = "float32"
    return ref


def _report(diffs, tol, as_json, meta):
    worst = max(diffs.values())
    ok = worst <= tol and meta.get("each_matrix_once", True)
    if as_json:
        print(json.dumps({**meta, "max_rel_diff": worst, "tolerance": tol, "ok": ok, "per_tensor": diffs}))
    else:
        width = max(len(n) for n in diffs)
        print(f"{'tensor':<{width}}  max rel diff")
        for n, d in diffs.items():
            print(f"{n:<{width}}  {d:.3e}")
        print(f"worst {worst:.3e} vs tolerance {tol:.1e}: {'PASS' if ok else 'FAIL'} ({meta})")
    return 0 if ok else 1


def _tolerance(args, precision):
    if args.tol is not None:
        return args.tol
    if precision == "fp32" and _reorders_sums(args):
        return FP32_REORDERED_TOL
    return {"bf16": BF16_TOL, "fp64": FP64_TOL}.get(precision, FP32_TOL)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    if "LOCAL_RANK" in os.environ:  # under torchrun: NCCL on GPUs
        return _main_torchrun(args)
    from .compare import every_layout, full_params, orthogonalized_once, rel_diffs, run_dmuon, run_reference

    precision = _precision(args, on_gpu=False)
    kw = _run_kwargs(args, precision)
    if args.resume_at is not None:
        return _resume_spawned(args, kw, precision)
    results = run_dmuon(args.dp * args.tp * args.pp, **kw)
    exact_order = precision == "fp32" and not _reorders_sums(args)
    ref = run_reference(args.dp, layouts=every_layout(results) if exact_order else None,
                        **_reference_kwargs(kw, precision))
    meta = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep, "backend": "gloo",
            "precision": precision, "update": args.update,
            "each_matrix_once": orthogonalized_once(results, ref["num_matrices"], args.steps),
            # per rank, counted from the state tensors; Megatron's AdamW DistributedOptimizer's figure beside it
            "optimizer_state_bytes": [r["state_bytes"] for r in results],
            "adamw_distopt_state_bytes": [r["adamw_state_bytes"] for r in results]}
    return _report(rel_diffs(full_params(results), ref["params"]), _tolerance(args, precision), args.json, meta)


def _resume_report(args, uninterrupted, resumed, precision, backend):
    """Resumed vs uninterrupted: parameters and optimizer state (bit-identical at one layout)."""
    from .compare import full_optimizer_state, full_params, rel_diffs, state_diffs

    params = rel_diffs(full_params(resumed), full_params(uninterrupted))
    state = state_diffs(full_optimizer_state(resumed), full_optimizer_state(uninterrupted))
    tol = args.tol
    if tol is None:  # one layout: bit-identical; resharded: the summation order changes
        tol = (FP32_REORDERED_TOL if precision == "fp32" else _tolerance(args, precision)) if _reshards(args) else 0.0
    worst_p, worst_s = max(params.values()), max(state.values())
    ok = worst_p <= tol and worst_s <= tol
    meta = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep, "resume_at": args.resume_at,
            "resume_dp": args.resume_dp or args.dp, "resume_tp": args.resume_tp or args.tp,
            "resume_vpp": args.resume_vpp or args.vpp,
            "format": args.resume_format, "backend": backend, "precision": precision,
            "params": len(params), "state_tensors": len(state), "max_param_diff": worst_p,
            "max_state_diff": worst_s, "tolerance": tol, "ok": ok}
    if args.json:
        print(json.dumps(meta))
    else:
        word = "bit-identical" if tol == 0.0 else f"within {tol:.0e}"
        for what, diffs in (("parameters", params), ("optimizer state", state)):
            bad = [n for n, d in diffs.items() if d > tol]
            print(f"{what}: {len(diffs)} tensors, worst {max(diffs.values()):.3e}"
                  + (f"; first beyond tolerance: {bad[0]}" if bad else ""))
        print(f"resume at step {args.resume_at} ({args.resume_format} format, DP {args.dp}->{meta['resume_dp']}, "
              f"TP {args.tp}->{meta['resume_tp']}, VPP {args.vpp}->{meta['resume_vpp']}) vs the uninterrupted run, "
              f"{word}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _resume_spawned(args, kw, precision):
    import shutil
    import tempfile

    from .multiproc import run_distributed

    target = "megatron_dmuon.testing.checkpoint_workers:dmuon_resume"
    kw = dict(kw, resume_at=args.resume_at, fmt=args.resume_format)
    if not _reshards(args):
        out = run_distributed(target, args.dp * args.tp * args.pp, kwargs=kw)
        return _resume_report(args, [r["uninterrupted"] for r in out], [r["resumed"] for r in out], precision, "gloo")
    root = tempfile.mkdtemp(prefix="dmuon-verify-ckpt-")
    try:
        saved = run_distributed(target, args.dp * args.tp * args.pp,
                                kwargs=dict(kw, save_dir=root, resume_here=False))
        dp2, tp2, vpp2 = args.resume_dp or args.dp, args.resume_tp or args.tp, args.resume_vpp or args.vpp
        resumed = run_distributed(target, dp2 * tp2 * args.pp,
                                  kwargs=dict(kw, tp=tp2, vpp=vpp2, align_param_gather=args.overlap and vpp2 > 1,
                                              load_dir=root, data_dp=args.dp))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _resume_report(args, [r["uninterrupted"] for r in saved], [r["resumed"] for r in resumed], precision, "gloo")


def _main_torchrun(args):
    from . import checkpoint_workers, workers
    from .multiproc import ForkedRank

    rank = int(os.environ["RANK"])
    # rank 0's reference process on CPU: forked now, before the process group (and the shim), with this
    # process's imports (the fork server a fresh run_reference starts would import them again). On GPUs,
    # and with DMUON_TEST_SPAWN=subprocess, run_reference starts it afresh after training
    forked = (rank == 0 and args.resume_at is None and not torch.cuda.is_available()
              and os.environ.get("DMUON_TEST_SPAWN", "fork") != "subprocess")
    reference = ForkedRank() if forked else None
    try:
        return _train_and_compare(args, checkpoint_workers, workers, reference)
    finally:
        if reference is not None:
            reference.close()


def _train_and_compare(args, checkpoint_workers, workers, reference):
    from .compare import rel_diffs
    from .global_params import merge_ranks

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = torchrun_backend()
    if world % (args.tp * args.pp):
        print(f"dmuon-verify: world size {world} is not a multiple of --tp x --pp", file=sys.stderr)
        return 2
    args.dp = world // (args.tp * args.pp)
    precision = _precision(args, on_gpu=backend == "nccl")
    kw = _run_kwargs(args, precision)
    torch.distributed.init_process_group(backend)
    if args.resume_at is not None:
        if _reshards(args):
            print("dmuon-verify: --resume-dp/--resume-tp/--resume-vpp run in CPU spawn mode (not under torchrun)",
                  file=sys.stderr)
            return 2
        out = checkpoint_workers.dmuon_resume(rank, world, resume_at=args.resume_at, fmt=args.resume_format, **kw)
        everyone = [None] * world
        torch.distributed.gather_object(out, everyone if rank == 0 else None, dst=0)
        code = 0
        if rank == 0:
            code = _resume_report(args, [r["uninterrupted"] for r in everyone], [r["resumed"] for r in everyone],
                                  precision, backend)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return code
    res = workers.dmuon_train(rank, world, **kw)
    shards = [None] * world
    torch.distributed.gather_object(res["shards"], shards if rank == 0 else None, dst=0)
    everyone_layouts = [None] * world
    torch.distributed.gather_object(res.get("layouts", []), everyone_layouts if rank == 0 else None, dst=0)
    layouts = [text for r in (everyone_layouts if rank == 0 else []) for text in r]
    code = 0
    if rank == 0:
        # the TP=PP=EP=1 reference runs in a single-rank CPU process of its own (forked before this
        # process's group, or started afresh): this process's Megatron parallel state (and its
        # collectives) belong to the distributed run
        from .compare import REFERENCE, reference_kwargs, run_reference

        exact_order = precision == "fp32" and not _reorders_sums(args) and backend == "gloo"
        ref_kw = dict(layouts=sorted(set(layouts)) if exact_order else None, **_reference_kwargs(kw, precision))
        ref = (reference.run(REFERENCE, kwargs=reference_kwargs(args.dp, **ref_kw)) if reference is not None
               else run_reference(args.dp, **ref_kw))
        meta = {"dp": args.dp, "tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep, "backend": backend,
                "precision": precision, "each_matrix_once": res["ns_counts"] == [ref["num_matrices"]] * args.steps}
        code = _report(rel_diffs(merge_ranks(shards), ref["params"]), _tolerance(args, precision), args.json, meta)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
