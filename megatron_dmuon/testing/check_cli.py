"""`dmuon-check`: train a tiny megatron-core GPT with DMuon, then verify that every DP replica
holds bit-identical parameters (per-bucket checksums over each DP group); prints the first
mismatch. CPU (default): spawns --dp x --tp gloo ranks. Under torchrun it runs on the launched
ranks (NCCL on GPUs). In a job: ``megatron_dmuon.megatron.replicas.check_replicas(model_chunks)``.
"""
from __future__ import annotations

import json
import os
import sys


def _parser():
    from .verify_cli import layout_parser

    p = layout_parser("dmuon-check", __doc__)
    p.add_argument("--steps", type=int, default=3, help="training steps before the check")
    p.add_argument("--overlap", action="store_true", help="overlap_grad_reduce + overlap_param_gather")
    p.add_argument("--corrupt-rank", type=int, default=None,
                   help="perturb one parameter element on this global rank first (shows a mismatch being found)")
    p.add_argument("--json", action="store_true")
    return p


def _print(report: dict, as_json: bool) -> int:
    from ..megatron.replicas import ReplicaReport

    print(json.dumps(report) if as_json else str(ReplicaReport(**report)))
    return 0 if report["ok"] else 1


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("dp", "tp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    kw = dict(steps=args.steps, tp=args.tp, overlap=args.overlap, corrupt_rank=args.corrupt_rank)
    if "LOCAL_RANK" in os.environ:
        return _main_torchrun(args, kw)
    world = args.dp * args.tp
    if args.corrupt_rank is not None and not 0 <= args.corrupt_rank < world:
        parser.error(f"--corrupt-rank must be a rank in [0, {world})")
    from .multiproc import run_distributed

    reports = run_distributed("megatron_dmuon.testing.guard_workers:replica_check", world, kwargs=kw)
    return _print(reports[0], args.json)


def _main_torchrun(args, kw) -> int:
    import torch

    from .guard_workers import replica_check
    from .verify_cli import torchrun_backend

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group(torchrun_backend())
    report = replica_check(rank, world, **kw)
    code = _print(report, args.json) if rank == 0 else (0 if report["ok"] else 1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
