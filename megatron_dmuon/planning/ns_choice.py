"""Which Newton–Schulz each owner stack runs: decided once, before the first step, and only here.

An owner orthogonalizes its matrices (or their split pieces) in one batched call per piece shape.
``choose_ns`` turns what the config asks (``--dmuon-ns-method``, ``--muon-fp32-matmul-prec``,
the coefficient schedule) into what runs on one [batch, rows, cols] stack: the method, its compute
dtype and its schedule. 'auto' is the kernels' measured choice for this stack on this GPU (the
autotune cache, read through ``measured``), else the FLOP rule (``algorithms.flops.ns_method_for``);
off CUDA it is standard NS (the torch path has no measured choice). ``owner_stack_batches`` counts
the stacks each owner will form from the plan's records, so the choice can be made at build time
for exactly the batch the step will run.
"""
from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from ..algorithms.flops import NS_METHODS, ns_method_for
from ..algorithms.gram_newton_schulz import GRAM_MIN_ASPECT_RATIO, gram_applies
from ..algorithms.ns_dispatch import method_compute_dtype

__all__ = ["NSChoice", "choose_ns", "owner_stack_batches", "plan_ns_choices", "torch_path_method", "Measured"]

# (min(rows, cols), max(rows, cols), batch, requested dtype, steps) -> 'gram' | 'standard' | None
Measured = Callable[[int, int, int, torch.dtype, int], Optional[str]]


@dataclasses.dataclass(frozen=True)
class NSChoice:
    """What one stack's NS runs: ``method`` as the NS entry points take it ('standard' or 'gram';
    a Gram request on a near-square shape runs standard NS inside them, see ``runs``), the dtype
    it computes and returns in, and its schedule ({'coefficients', 'steps'[, 'normalisation']})."""

    method: str
    compute_dtype: torch.dtype
    schedule: Mapping
    rows: int
    cols: int

    @property
    def runs(self) -> str:
        """The iteration that actually runs on this shape."""
        return "gram" if self.method == "gram" and gram_applies(self.rows, self.cols) else "standard"

    def kwargs(self) -> dict:
        """Keyword arguments of the NS entry points (kernels and torch path alike)."""
        return dict(self.schedule, compute_dtype=self.compute_dtype, out_dtype=self.compute_dtype)

    def label(self, coefficients) -> str:
        """In words, as the job's summary reports it per shape (e.g. 'gram float16 you x5')."""
        name = coefficients if isinstance(coefficients, str) else "custom"
        return f"{self.method} {str(self.compute_dtype).replace('torch.', '')} {name} x{self.schedule['steps']}"


def torch_path_method(requested: str) -> str:
    """The method of the float32 torch path (CPU runs, non-finite retries): 'auto' is standard
    there, the kernels' measured choice exists on CUDA only."""
    _check_requested(requested)
    return "standard" if requested == "auto" else requested


def choose_ns(rows: int, cols: int, batch: int, *, requested: str, precision: torch.dtype, schedule: Mapping,
              on_cuda: bool, measured: Optional[Measured] = None) -> NSChoice:
    """The NS of a [batch, rows, cols] stack. ``requested``: 'standard', 'gram' or 'auto';
    ``precision``: the requested NS precision (Gram runs a bf16 request in fp16:
    ``algorithms.ns_dispatch.method_compute_dtype``); ``schedule``: the config's schedule for
    this shape; ``measured``: the autotune cache's lookup (CUDA only)."""
    method = torch_path_method(requested)
    if requested == "auto" and on_cuda:
        steps = schedule.get("steps", 5)
        method = (measured(min(rows, cols), max(rows, cols), batch, precision, steps) if measured else None) or \
            ns_method_for(rows, cols, steps, "auto", None, GRAM_MIN_ASPECT_RATIO,
                          schedule.get("normalisation", "frobenius"))
    return NSChoice(method, method_compute_dtype(method, precision), dict(schedule), rows, cols)


def owner_stack_batches(pieces: Iterable[Tuple[int, ...]]) -> Counter:
    """{(rows, cols): stack size} of the pieces one owner orthogonalizes together: a 2-D piece
    takes one slot of its shape's stack, a [heads, rows, cols] piece one slot per head (as
    ``runtime.ns_stacks.StackPlan`` lays them out)."""
    batches = Counter()
    for piece in pieces:
        batches[tuple(piece[-2:])] += 1 if len(piece) == 2 else piece[0]
    return batches


def plan_ns_choices(records: Sequence, *, precision: torch.dtype, on_cuda: bool,
                    measured: Optional[Measured] = None) -> Tuple[Tuple[NSChoice, ...], ...]:
    """The NS choice of every piece of every Muon record (``planning.plan.MatrixRecord``; () for
    AdamW ones), in the order given: each piece's requested method and schedule as the record
    holds them, for the stack its owner will form. An owner, one per optimizer part (dense or
    expert), DP rank and TP owner, stacks the pieces of every record it orthogonalizes (pass the
    records of all model chunks one optimizer steps); distributed Gram NS runs Gram NS on the
    TP group's shards whatever the request."""
    def owner(r):
        return r.expert, r.dp_owner, r.tp_owner

    batches: Dict[tuple, Counter] = defaultdict(Counter)
    for r in records:
        if r.use_muon and r.tp_method != "distributed_gram":
            batches[owner(r)].update(owner_stack_batches(r.pieces))
    out = []
    for r in records:
        choices = []
        for piece, requested, schedule in zip(r.pieces, r.ns_methods, r.schedules) if r.use_muon else ():
            rows, cols = piece[-2:]
            if r.tp_method == "distributed_gram":
                choices.append(choose_ns(rows, cols, 1, requested="gram", precision=precision, schedule=schedule,
                                         on_cuda=on_cuda))
                continue
            choices.append(choose_ns(rows, cols, batches[owner(r)][(rows, cols)], requested=requested,
                                     precision=precision, schedule=schedule, on_cuda=on_cuda, measured=measured))
        out.append(tuple(choices))
    return tuple(out)


def _check_requested(requested: str) -> None:
    if requested not in NS_METHODS:
        raise ValueError(f"--dmuon-ns-method {requested!r} unknown; valid: {', '.join(NS_METHODS)}")
