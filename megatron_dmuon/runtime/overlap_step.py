"""The overlapped owner step (`--dmuon-overlap-step on`): each need group's Newton–Schulz runs
while the next forward computes the layers before it.

`OverlappedStep` is owned by `OwnerMuonAdamW` (its ``overlapped``); the owner's step hands it the
Muon matrices and the Megatron glue (megatron/overlap_step.py, owner_optimizer.py, optimizer.py)
drives it through its public methods: ``launch`` / ``launch_early``, ``finish`` / ``finish_all``,
``commit_early`` / ``cancel_early``. The mode's meaning is planning/overlap_mode.OverlapMode.

``MatrixInfo.need`` orders the Muon matrices by when the next forward needs them (their DDP bucket
group's place in the forward, megatron/overlap_step.py). The step cuts the NS stacks per need group
(a stack never spans two groups), runs every momentum pass, and launches each group's NS in need
order: on CUDA on a side stream, so ``optimizer.step()`` returns while it runs; on the CPU right
away. ``finish(need)`` is called when that group's params are first needed (the param sync of its
bucket group, before the forward of its layers); it makes the current stream wait for the group's
NS, checks the outputs, applies the directions to the fp32 masters with the lr and weight decay of
the step, and hands the masters to ``OwnerMuonAdamW.on_applied`` (the copy into the model's params).
``finish_all()`` runs whatever is left (a checkpoint, the next step, a forced param sync).

The arithmetic is the synchronous step's on the same stacks: mode 'sync' runs the same cut stacks
inside ``step()``, and the two agree bit for bit (tests/runtime/test_overlap_step.py). A stack cut per need
group is smaller than the owner's whole same-shape stack of mode 'off', which the GPU's batched
GEMMs may round differently; 'off' and 'on' therefore agree to rounding, not to the bit.
One difference in checking: the NaN/Inf retry reads back only the stacks whose NS can overflow (Gram
NS in 16 bits); a standard NS of a finite input is finite (its input is normalized), so reading
those back would add a host sync per group for nothing. The online NS check keeps its host sync on
the steps it is due.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Dict, Optional

import torch
from torch.profiler import record_function

from ..planning.overlap_mode import OverlapMode


class _LaunchedGroup:
    """One need group in flight: its stacks, NS outputs, the event after its NS, and its members
    as (main param, info, lr, weight decay) with the values of the step that launched it."""

    def __init__(self, plan, stacks, members):
        self.plan, self.stacks, self.members = plan, stacks, members
        self.outputs = None
        self.event = None  # CUDA: recorded on the side stream after the group's NS
        self.device = stacks[0].device if stacks else None


class PendingSteps:
    """The need groups launched and not yet finished, by need (at most one step's worth). Under
    'backward', ``early`` holds the needs launched during this step's backward, ``backups`` the
    momenta they overwrote (restored if the step is skipped), ``momentum_done`` the events after
    their momentum passes (the grads they read must outlive them)."""

    def __init__(self):
        self.groups: Dict[int, _LaunchedGroup] = {}
        self.early: set = set()
        self.backups: dict = {}
        self.momentum_done: list = []

    def __bool__(self) -> bool:
        return bool(self.groups)

    def needs(self) -> list:
        return sorted(self.groups)

    def main_params(self) -> set:
        return {p for item in self.groups.values() for p, *_ in item.members}


class OverlappedStep:
    """The Muon work of one ``OwnerMuonAdamW`` cut per need group and finished apart from its
    ``step()``. It uses the owner's public stack helpers (``fill_ns_stacks``, ``launch_ns``,
    ``check_ns_outputs``, ``apply_ns_outputs``), its ``state`` (the momenta), ``stats`` and
    ``on_applied`` (the copy of finished masters into the model's params)."""

    def __init__(self, owner, mode: OverlapMode):
        self.owner = owner
        self.mode = mode
        self.pending = PendingSteps()
        self._ns_streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        self._momentum_streams: Dict[torch.device, "torch.cuda.Stream"] = {}

    def launch(self, entries, grad_scale: Optional[float] = None) -> None:
        """The Muon part of ``OwnerMuonAdamW.step`` for whole matrices (no TP), cut per need group:
        momentum passes now, each group's NS launched (side stream on CUDA), finished later by
        ``finish`` (mode 'on') or right here (mode 'sync')."""
        owner, pending = self.owner, self.pending
        by_need = defaultdict(list)
        for p, group, info in entries:
            by_need[info.need].append((p, group, info))
        launched = {}
        for need in sorted(by_need):
            members = by_need[need]
            plan, stacks = owner.fill_ns_stacks(members, grad_scale, tag=need)
            launched[need] = _LaunchedGroup(plan, stacks, [(p, info, g["lr"], g["weight_decay"]) for p, g, info in members])
        if launched and entries[0][0].is_cuda and self.mode.starts_in_backward:  # (the grads' lifetime: commit_early)
            device = entries[0][0].device
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            pending.momentum_done.append((device, event))
        side = self.ns_stream(entries[0][0].device) if entries and entries[0][0].is_cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))  # the momentum passes wrote the stacks
        with record_function("dmuon.ns_launch"), (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()):
            for item in launched.values():
                item.outputs = owner.launch_ns(item.plan, item.stacks)
                if side is not None:
                    for x in item.stacks:  # allocated on the current stream, read by the side stream
                        x.record_stream(side)
                    item.event = torch.cuda.Event()
                    item.event.record(side)
        pending.groups.update(launched)
        owner.stats["ns_matrices_total"] += owner.stats["ns_matrices"]
        owner.stats["tp_bytes"] = 0
        if self.mode.finishes_in_step:
            self.finish_all()

    @torch.no_grad()  # also from the forward's pre-hooks, where autograd records
    def finish(self, need: int) -> None:
        """Finish need group ``need`` if it is in flight: wait for its NS on the current stream, check
        the outputs, apply them, and hand the masters to the owner's ``on_applied``."""
        owner = self.owner
        item = self.pending.groups.pop(need, None)
        if item is None:
            return
        with record_function("dmuon.finish_group"):
            if item.event is not None:
                torch.cuda.current_stream(item.device).wait_event(item.event)
            outputs = owner.check_ns_outputs(item.plan, item.outputs, item.stacks, standard_retry=False)
            owner.apply_ns_outputs(item.plan, outputs, item.members)
            if owner.on_applied is not None:
                owner.on_applied([p for p, *_ in item.members])

    def finish_all(self, keep_early: bool = False) -> None:
        """Finish every group in flight, in need order (``keep_early``: but this step's early ones)."""
        for need in self.pending.needs():
            if not (keep_early and need in self.pending.early):
                self.finish(need)

    def launch_early(self, entries) -> None:
        """'backward': one need group's momentum pass and NS, launched while the backward still runs
        (its grads final: reduced to this owner). Whatever the last forward left in flight is finished
        first. The momenta it overwrites are kept until the step decides (``commit_early`` /
        ``cancel_early``), so a skipped step changes nothing."""
        if not entries:
            return
        owner, pending = self.owner, self.pending
        self.finish_all(keep_early=True)
        if not pending.early:  # the step's counters start with its first early group
            owner.stats["ns_calls"] = owner.stats["ns_fp32_retries"] = owner.stats["ns_matrices"] = 0
        for p, _, _ in entries:
            buf = owner.state.get(p, {}).get("momentum_buffer")
            pending.backups[p] = None if buf is None else buf.clone()
        before, total = set(pending.groups), owner.stats["ns_matrices_total"]
        self.launch(entries)
        owner.stats["ns_matrices_total"] = total  # (added by the step, once)
        started = set(pending.groups) - before
        pending.early |= started
        owner.stats["overlap_groups_early"] += len(started)  # need groups started during a backward, all steps

    def take_early(self, entries) -> list:
        """The step's ``entries`` less the matrices launched early (during its backward); the early
        groups then count as the step's own, in flight for the forward."""
        launched = self.pending.main_params()
        self.pending.early = set()
        return [e for e in entries if e[0] not in launched]

    def _wait_momentum_passes(self) -> None:
        for device, event in self.pending.momentum_done:
            torch.cuda.current_stream(device).wait_event(event)
        self.pending.momentum_done = []

    def commit_early(self) -> None:
        """The step is applied: the early groups stay in flight for the forward; their backups go."""
        self._wait_momentum_passes()
        self.pending.backups = {}

    def cancel_early(self) -> None:
        """The step is skipped (non-finite grads): the early groups are dropped unapplied and the
        momenta they overwrote restored, as if nothing had run."""
        pending, state = self.pending, self.owner.state
        if not pending.early and not pending.backups:
            return
        self._wait_momentum_passes()
        for need in pending.early:
            pending.groups.pop(need, None)
        for p, buf in pending.backups.items():
            if buf is None:
                state.get(p, {}).pop("momentum_buffer", None)
            else:
                state[p]["momentum_buffer"].copy_(buf)
        pending.early, pending.backups = set(), {}

    def cancel_early_for_clipping(self) -> None:
        """Clipping fires on a step whose early groups started unclipped: they are dropped (and
        counted as redone) for the step to launch them again, clipped, as 'on' does."""
        if self.pending.early:
            self.owner.stats["overlap_redos"] += len(self.pending.early)
            self.cancel_early()

    def ns_stream(self, device) -> "torch.cuda.Stream":
        return _side_stream(self._ns_streams, device)

    def momentum_stream(self, device) -> "torch.cuda.Stream":
        """'backward': the stream of the early groups' momentum passes, apart from the NS stream. The
        step and the next ``zero_grad_buffer`` wait for those passes (``momentum_done``); on the NS
        stream each would sit behind the NS of every group launched before it."""
        return _side_stream(self._momentum_streams, device)


def finish(owner, need: int) -> None:
    """``owner.overlapped.finish(need)`` (the entry tests/kernels/test_gpu.py drives the step by)."""
    owner.overlapped.finish(need)


def _side_stream(streams: dict, device) -> "torch.cuda.Stream":
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device, priority=0)  # the lowest: see model_priority_stream
    return streams[device]


@contextlib.contextmanager
def model_priority_stream(enabled: bool = True):
    """Run the body (a training loop) on a CUDA stream of the highest priority. The overlapped
    step's NS runs on a stream of the default, lowest priority, so the GPU's block scheduler gives
    the model's own kernels the SMs first and the NS fills what they leave, instead of the forward
    queueing behind every NS kernel launched before it."""
    if not (enabled and torch.cuda.is_available()):
        yield
        return
    outer = torch.cuda.current_stream()
    stream = torch.cuda.Stream(priority=-100)  # clamped to the device's highest priority
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        outer.wait_stream(stream)
