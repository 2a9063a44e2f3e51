"""Which Newton–Schulz each owner stack runs, and what it costs: one resolver for both.

An owner orthogonalizes its matrices (or their split pieces) in one batched call per piece shape.
``NSResolver`` turns what the config asks (``MuonSettings``' NS method, precision and coefficient
schedule) into what runs on one [batch, rows, cols] stack (``NSChoice``: the
method, its compute dtype and its schedule) and into the FLOPs of that run, which the planner's
owner costs use; the rule itself is ``algorithms.flops.ns_method_for`` ('auto': the kernels'
measured choice for this stack on this GPU, the autotune cache read through ``measured``, else
the FLOP rule). Off CUDA the run is standard NS (the torch path has no measured choice); the
planner costs what the CUDA path runs (a plan made on CPU is for the GPU). ``plan_ns_choices``
decides every piece of a plan at build time, for exactly the batch each owner's stack will hold;
the owner step runs those choices and decides nothing itself.
"""
from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Callable, Dict, Iterable, Literal, Mapping, Optional, Sequence, Tuple, get_args

import torch

from ..algorithms.flops import NS_METHODS, ns_method_for
from ..algorithms.gram_newton_schulz import GRAM_MIN_ASPECT_RATIO, gram_applies
from ..algorithms.ns_dispatch import method_compute_dtype
from ..algorithms.schedules import schedule_for_shape
from .params import check_muon_matrix_shape, ns_flops

__all__ = ["ADAPTIVE_SCHEDULE", "NSChoice", "NSResolver", "choose_ns", "ns_schedule", "owner_ns_cost", "owner_stack_batches",
           "plan_ns_choices", "stack_ns_choices", "torch_path_method", "Measured"]

# the adaptive schedule: per shape, the quartic normalisation with 4 designed steps for wide/tall
# matrices (aspect >= 2) and 5 for the rest (algorithms.schedules.schedule_for_shape)
AdaptiveSchedule = Literal["adaptive"]
ADAPTIVE_SCHEDULE: str = get_args(AdaptiveSchedule)[0]

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


def ns_schedule(coefficients, steps: int, rows: int, cols: int) -> dict:
    """The NS keyword arguments of a [rows, cols] matrix under the coefficients ``coefficients`` at
    ``steps`` steps: ``{'coefficients', 'steps'}`` (and ``'normalisation'`` for the
    adaptive schedule)."""
    if coefficients == ADAPTIVE_SCHEDULE:
        return schedule_for_shape(rows, cols)
    return {"coefficients": coefficients, "steps": steps}


def choose_ns(rows: int, cols: int, batch: int, *, requested: str, precision: torch.dtype, schedule: Mapping,
              on_cuda: bool, measured: Optional[Measured] = None) -> NSChoice:
    """The NS of a [batch, rows, cols] stack. ``requested``: 'standard', 'gram' or 'auto';
    ``precision``: the requested NS precision (Gram runs a bf16 request in fp16:
    ``algorithms.ns_dispatch.method_compute_dtype``); ``schedule``: the config's schedule for
    this shape; ``measured``: the autotune cache's lookup (CUDA only)."""
    method = torch_path_method(requested)
    if requested == "auto" and on_cuda:
        steps = schedule.get("steps", 5)
        method = ns_method_for(rows, cols, steps, "auto", None, GRAM_MIN_ASPECT_RATIO,
                               schedule.get("normalisation", "frobenius"),
                               measured=measured(min(rows, cols), max(rows, cols), batch, precision, steps)
                               if measured else None)
    return NSChoice(method, method_compute_dtype(method, precision), dict(schedule), rows, cols)


@dataclasses.dataclass(frozen=True)
class NSResolver:
    """The NS settings of one run on one device, resolving any stack: ``choice`` (what runs) and
    ``flops`` (what that costs; the planner's owner cost of a piece). ``requested``: the NS
    method asked for; ``coefficients`` / ``steps``: the schedule (``ns_schedule``); ``on_cuda``:
    the kernels run it (the planner's resolver always is: it plans for the GPU); ``measured``:
    the autotune cache's lookup on that GPU (None: the FLOP rule decides 'auto')."""

    requested: str = "auto"
    precision: torch.dtype = torch.bfloat16
    coefficients: object = "you"
    steps: int = 5
    on_cuda: bool = True
    measured: Optional[Measured] = dataclasses.field(default=None, compare=False)

    def schedule(self, rows: int, cols: int) -> dict:
        return ns_schedule(self.coefficients, self.steps, rows, cols)

    def choice(self, rows: int, cols: int, batch: int = 1, requested: Optional[str] = None) -> NSChoice:
        """The NS of a [batch, rows, cols] stack; ``requested`` overrides the run's method
        (distributed Gram NS runs Gram whatever the request)."""
        return choose_ns(rows, cols, batch, requested=requested or self.requested, precision=self.precision,
                         schedule=self.schedule(rows, cols), on_cuda=self.on_cuda, measured=self.measured)

    def flops(self, rows: int, cols: int, batch: int = 1) -> float:
        """FLOPs of the NS ``choice`` runs on one matrix of a [batch, rows, cols] stack (Gram with
        its restarts; symmetric products at half cost, as the kernels compute them)."""
        choice = self.choice(rows, cols, batch)
        schedule = choice.schedule
        return ns_flops(rows, cols, schedule.get("steps", self.steps), choice.runs,
                        normalisation=schedule.get("normalisation", "frobenius"))


def owner_ns_cost(shape: Sequence[int], resolver: NSResolver = NSResolver()) -> float:
    """The planner's cost of one NS piece: FLOPs of the NS the owner step runs on one ``shape``
    matrix under ``resolver`` (``NSResolver.flops``: the method it resolves, Gram with its restart,
    the per-shape adaptive schedule's 4 or 5 steps, symmetric products at half cost). The one owner
    cost of the package: the run's (``MuonSettings.ns_resolver('cuda')``, with this GPU's autotune
    measurements), ``dmuon plan``'s and the benches' (a resolver of their flags, no measurement).
    The default resolver is DMuonConfig()'s NS: 'auto', Megatron's quintic ('you') at 5 steps (the
    coefficients set only matters for 'adaptive', whose step count differs per shape). Under the
    adaptive schedule a 3584 x 18944 matrix costs 2.09 times a 3584² one with the restart, 1.44
    without; ``params.ns_cost``'s standard 5-step count says 3.86."""
    return resolver.flops(*check_muon_matrix_shape("matrix", shape))


def owner_stack_batches(pieces: Iterable[Tuple[int, ...]]) -> Counter:
    """{(rows, cols): stack size} of the pieces one owner orthogonalizes together: a 2-D piece
    takes one slot of its shape's stack, a [heads, rows, cols] piece one slot per head (as
    ``runtime.ns_stacks.StackPlan`` lays them out)."""
    batches = Counter()
    for piece in pieces:
        batches[tuple(piece[-2:])] += 1 if len(piece) == 2 else piece[0]
    return batches


def stack_ns_choices(matrices: Sequence[Tuple[object, Sequence[Tuple[int, ...]], Sequence[str], Sequence[Mapping], str]],
                     resolver: NSResolver) -> Tuple[Tuple[NSChoice, ...], ...]:
    """The NS choice of every piece of every (owner, pieces, requested methods, schedules, TP
    method) matrix, one entry per piece in the last four: each owner stacks the pieces of its
    matrices by shape, so a piece's stack holds every piece of that shape its owner
    orthogonalizes; distributed Gram NS runs Gram NS on the TP group's shards of one matrix
    whatever the request."""
    batches: Dict[object, Counter] = defaultdict(Counter)
    for owner, pieces, _, _, tp_method in matrices:
        if tp_method != "distributed_gram":
            batches[owner].update(owner_stack_batches(pieces))
    out = []
    for owner, pieces, requests, schedules, tp_method in matrices:
        choices = []
        for piece, requested, schedule in zip(pieces, requests, schedules):
            rows, cols = piece[-2:]
            gram = tp_method == "distributed_gram"
            choices.append(choose_ns(rows, cols, 1 if gram else batches[owner][(rows, cols)],
                                     requested="gram" if gram else requested, precision=resolver.precision,
                                     schedule=schedule, on_cuda=resolver.on_cuda,
                                     measured=None if gram else resolver.measured))
        out.append(tuple(choices))
    return tuple(out)


def plan_ns_choices(records: Sequence, resolver: NSResolver) -> Tuple[Tuple[NSChoice, ...], ...]:
    """The NS choice of every piece of every Muon record (``planning.plan.MatrixRecord``; () for
    AdamW ones), in the order given: each piece's requested method and schedule as the record
    holds them. An owner, one per optimizer part (dense or expert), DP rank and TP owner, stacks
    the pieces of every record it orthogonalizes (pass the records of all model chunks one
    optimizer steps)."""
    muon = [r for r in records if r.use_muon]
    chosen = iter(stack_ns_choices([((r.expert, r.dp_owner, r.tp_owner), r.pieces, r.ns_methods, r.schedules,
                                     r.tp_method) for r in muon], resolver))
    return tuple(next(chosen) if r.use_muon else () for r in records)


def _check_requested(requested: str) -> None:
    if requested not in NS_METHODS:
        raise ValueError(f"NS method {requested!r} unknown; valid: {', '.join(NS_METHODS)}")
