"""The main job's checks while it runs: the errors every rank reaches together (``job_error``: rank 0
prints one line, every rank exits) and the checks that stop a run which cannot recover."""
from __future__ import annotations

import math
import sys

import torch

from .checks import PROG


def job_error(message: str, code: int) -> None:
    """A run-time error every rank reached together: rank 0 prints it once, every rank exits.
    The barrier keeps the other ranks from exiting first: torchrun stops every rank at the first
    one that ends, which could kill rank 0 before its message was written."""
    message = " ".join(message.split("\n"))  # one line: launch/run_main.sh's filter keeps the error's first line
    if torch.distributed.get_rank() == 0:
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.stderr.flush()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    raise SystemExit(code)


@torch.no_grad()
def params_finite(opt) -> bool:
    """Whether every parameter the optimizer holds (the main params: fp32 shards) is finite on
    every rank (one all-reduce)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    device = params[0].device if params else torch.device("cpu")
    bad = torch.zeros(1, device=device)
    for p in params:
        if p.numel() and not bool(torch.isfinite(p).all()):
            bad.fill_(1.0)
            break
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return not bool(bad.item())


def stop_if_not_learning(args, it, streak, loss, ok, opt) -> None:
    """--exit-after-skipped-iterations: K consecutive iterations without a finite loss and an
    applied update stop the run; an applied update after a non-finite loss (Megatron's AdamW does
    not skip it) stops it at once if it made the parameters non-finite."""
    limit = args.exit_after_skipped_iterations
    if limit and streak >= limit:
        job_error(f"{streak} consecutive iterations up to {it} had non-finite gradients or loss (the updates were "
                  f"skipped): the run cannot recover; lower --lr, check the data, or raise "
                  f"--exit-after-skipped-iterations", 1)
    if ok and not math.isfinite(loss) and not params_finite(opt):
        job_error(f"iteration {it} had a non-finite loss and its update made the parameters non-finite: the "
                  f"run cannot recover (nothing saved after it); lower --lr or keep --clip-grad on", 1)
