"""The overlapped owner step (overlap step `on`): each need group's Newton–Schulz runs
while the next forward computes the layers before it. The mode's meaning is
planning/overlap_mode.OverlapMode; Megatron's bucket groups drive it through megatron/overlap_hooks.py.

``MatrixInfo.need`` orders the Muon matrices by when the next forward needs them (their DDP bucket
group's place in the forward, megatron/overlap_hooks.py). The step cuts the NS stacks per need group
(a stack never spans two groups), runs every momentum pass, and launches each group's NS in need
order: on CUDA on a side stream, so ``optimizer.step()`` returns while it runs; on the CPU right
away. A group is finished when its params are first needed (the param sync of its bucket group,
before the forward of its layers): the current stream waits for the group's NS, the outputs are
checked, the directions applied to the fp32 masters with the lr and weight decay of the step, and
the masters handed to ``OwnerMuonAdamW.on_applied`` (the copy into the model's params). Whatever is
left is finished by a checkpoint, the next step or a forced param sync.

Two halves, talking through one object, a need group's lifecycle: a generator that yields at each
wait (after its momentum pass, after its NS launch) and finishes the group when resumed the last
time, as microsoft/dion runs each batch of its Muon.

* ``OverlappedStep`` is the runtime. It knows nothing of the owner: it runs the lifecycles it is
  given (streams and events between their stages), and keeps the groups in flight, those started in
  the backward ('backward') and the momenta those overwrote, until the step commits or cancels them.
* ``OwnerOverlap``, mixed into ``OwnerMuonAdamW``, is the owner's side: it makes the lifecycles
  from its own stack helpers (``fill_ns_stacks``, ``launch_ns``, ``check_ns_outputs``,
  ``apply_ns_outputs``), keeps its counters (``stats``) and momenta (``state``), and offers the methods
  the Megatron glue calls (megatron/overlap_hooks.py, owner_optimizer.py, optimizer.py).

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
from typing import Dict, Generator, List, Optional, Tuple

import torch
from torch.profiler import record_function

from ..planning.overlap_mode import OverlapMode

# A need group's lifecycle: run to its first yield, the momentum pass has written the NS input stacks
# (it yields them); to its second, the NS is launched; resumed once more, the group is finished.
Lifecycle = Generator[Optional[List[torch.Tensor]], None, None]


class _InFlight:
    """One need group launched and not finished: its lifecycle (paused after the NS launch), its
    masters, its NS input stacks, and the event after its NS (CUDA: recorded on the side stream)."""

    def __init__(self, lifecycle: Lifecycle, mains: list, stacks: List[torch.Tensor]):
        self.lifecycle, self.mains, self.stacks = lifecycle, mains, stacks
        self.event = None
        self.device = stacks[0].device if stacks else None


class OverlappedStep:
    """The runtime of the need groups' lifecycles: launched (``launch``), in flight, finished when the
    forward needs them (``finish``) or before anything else reads the masters (``finish_all``). Under
    'backward' the groups launched during the backward (``launch(..., early_backups=...)``) wait for
    the step's decision: ``commit_early`` keeps them in flight, ``cancel_early`` drops them and
    returns the momenta they overwrote, for the owner to restore."""

    def __init__(self, mode: OverlapMode):
        self.mode = mode
        self._groups: Dict[int, _InFlight] = {}
        self._early: set = set()  # needs launched during this step's backward
        self._backups: dict = {}  # the momenta those overwrote, by main param (None: there was none)
        self._momentum_done: list = []  # (device, event) after their momentum passes: the grads must outlive them
        self._ns_streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        self._momentum_streams: Dict[torch.device, "torch.cuda.Stream"] = {}

    def needs(self) -> list:
        """The needs in flight, in order."""
        return sorted(self._groups)

    def masters(self) -> set:
        """The main params of every group in flight (their masters are not applied yet)."""
        return {p for item in self._groups.values() for p in item.mains}

    def started_early(self, need: Optional[int] = None) -> bool:
        """Whether need group ``need`` (None: any) was launched during this step's backward."""
        return bool(self._early) if need is None else need in self._early

    def early_count(self) -> int:
        return len(self._early)

    def left_count(self) -> int:
        """The groups in flight but those started in this step's backward (at a step: the ones the
        last forward never needed)."""
        return len(self._groups) - len(self._early)

    def launch(self, lifecycles: Dict[int, Tuple[list, Lifecycle]], device: Optional[torch.device],
               early_backups: Optional[dict] = None) -> set:
        """Launch each need group of ``lifecycles`` ({need: (its main params, its lifecycle)}, on
        ``device``): every momentum pass first, then each group's NS in need order (side stream on
        CUDA); finished later (mode 'on') or right here (mode 'sync'). ``early_backups``: launched
        during the backward, with the momenta the passes overwrite. Returns the needs started."""
        launched = {}
        for need in sorted(lifecycles):
            mains, lifecycle = lifecycles[need]
            launched[need] = _InFlight(lifecycle, mains, next(lifecycle))  # the momentum pass
        cuda = device is not None and device.type == "cuda"
        if launched and cuda and self.mode.starts_in_backward:  # (the grads' lifetime: commit_early)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._momentum_done.append((device, event))
        side = self.ns_stream(device) if cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))  # the momentum passes wrote the stacks
        with record_function("dmuon.ns_launch"), (torch.cuda.stream(side) if side is not None else contextlib.nullcontext()):
            for item in launched.values():
                next(item.lifecycle)  # the NS launch
                if side is not None:
                    for x in item.stacks:  # allocated on the current stream, read by the side stream
                        x.record_stream(side)
                    item.event = torch.cuda.Event()
                    item.event.record(side)
        started = set(launched) - set(self._groups)
        self._groups.update(launched)
        if early_backups is not None:
            self._backups.update(early_backups)
            self._early |= started
        if self.mode.finishes_in_step:
            self.finish_all()
        return started

    @torch.no_grad()  # also from the forward's pre-hooks, where autograd records
    def finish(self, need: int) -> None:
        """Finish need group ``need`` if it is in flight: the current stream waits for its NS, then
        its lifecycle runs to the end (outputs checked, applied, masters handed on)."""
        item = self._groups.pop(need, None)
        if item is None:
            return
        with record_function("dmuon.finish_group"):
            if item.event is not None:
                torch.cuda.current_stream(item.device).wait_event(item.event)
            next(item.lifecycle, None)

    def finish_all(self, keep_early: bool = False) -> None:
        """Finish every group in flight, in need order (``keep_early``: but this step's early ones)."""
        for need in self.needs():
            if not (keep_early and need in self._early):
                self.finish(need)

    def take_early(self, entries) -> list:
        """The step's ``entries`` less the matrices launched early (during its backward); the early
        groups then count as the step's own, in flight for the forward."""
        launched = self.masters()
        self._early = set()
        return [e for e in entries if e[0] not in launched]

    def _wait_momentum_passes(self) -> None:
        for device, event in self._momentum_done:
            torch.cuda.current_stream(device).wait_event(event)
        self._momentum_done = []

    def commit_early(self) -> None:
        """The step is applied: the early groups stay in flight for the forward; their backups go."""
        self._wait_momentum_passes()
        self._backups = {}

    def cancel_early(self) -> dict:
        """The step is skipped: the early groups are dropped unapplied. Returns the momenta they
        overwrote ({main param: its momentum before, or None}), for the owner to restore."""
        if not self._early and not self._backups:
            return {}
        self._wait_momentum_passes()
        for need in self._early:
            self._groups.pop(need, None)
        backups, self._early, self._backups = self._backups, set(), {}
        return backups

    def ns_stream(self, device) -> "torch.cuda.Stream":
        return _side_stream(self._ns_streams, device)

    def momentum_stream(self, device) -> "torch.cuda.Stream":
        """'backward': the stream of the early groups' momentum passes, apart from the NS stream. The
        step and the next ``zero_grad_buffer`` wait for those passes (``commit_early``); on the NS
        stream each would sit behind the NS of every group launched before it."""
        return _side_stream(self._momentum_streams, device)


class OwnerOverlap:
    """``OwnerMuonAdamW``'s side of the overlapped step: the need groups' lifecycles made from its
    stack helpers, its counters and momenta, and what the Megatron glue calls. The owner sets
    ``overlap_mode`` (an ``OverlapMode``), ``_overlapped`` (the runtime) and ``on_applied``."""

    overlap_mode: OverlapMode
    _overlapped: OverlappedStep

    def _need_group(self, members, grad_scale: Optional[float], need: int) -> Lifecycle:
        """One need group's lifecycle (``members``: (main param, param group, info) of its matrices)."""
        applied = [(p, info, g["lr"], g["weight_decay"]) for p, g, info in members]  # this step's (the scheduler moves on)
        plan, stacks = self.fill_ns_stacks(members, grad_scale, tag=need)
        yield stacks
        outputs = self.launch_ns(plan, stacks)
        yield None
        outputs = self.check_ns_outputs(plan, outputs, stacks, standard_retry=False)
        self.apply_ns_outputs(plan, outputs, applied)
        if self.on_applied is not None:
            self.on_applied([p for p, *_ in applied])

    def _need_groups(self, entries, grad_scale: Optional[float] = None) -> Dict[int, Tuple[list, Lifecycle]]:
        by_need = defaultdict(list)
        for p, group, info in entries:
            by_need[info.need].append((p, group, info))
        return {need: ([p for p, _, _ in members], self._need_group(members, grad_scale, need))
                for need, members in sorted(by_need.items())}

    def _split_need_group(self, members, split: dict, work_updates: dict, need: int, like: torch.Tensor) -> Lifecycle:
        """One need group's lifecycle under the split layout (runtime/dp_exchange.py). ``members``:
        this rank's (main param, param group, info) of the group, its pieces and the matrices whole in
        its shard; ``split``: every split matrix of the group, whoever holds it (every rank takes part
        in every group's way back: it may forward pieces); ``work_updates``: the whole update of every
        matrix this rank orthogonalizes (the step ran the momentum passes and the pieces' way to their
        homes for all groups at once). On the NS stream: the NS of the group's matrices homed or whole
        here; when the forward needs the group: the directions' way back and the apply. The same
        functions as the synchronous split step (``_exchange_step``), on the group's own stacks."""
        entries = [(p, {"lr": g["lr"], "weight_decay": g["weight_decay"]}, info)  # this step's (the scheduler moves on)
                   for p, g, info in members]
        owned = sorted([info for _, _, info in members if info.dp_split is None]
                       + [info for info in split.values() if info.dp_split.home == self.dp.rank], key=lambda i: i.name)
        # (popped: each update lives on in its stack only, not through the forward beside it)
        plan, stacks = self.owned_stacks([(info, work_updates.pop(info.name).reshape(info.shape)) for info in owned],
                                         tag=need)
        self.stats["ns_matrices"] += len(owned)
        yield stacks
        outputs = self.launch_ns(plan, stacks)
        yield None
        outputs = self.check_ns_outputs(plan, outputs, stacks, standard_retry=False)
        orthogonalized = {info.name: plan.outputs(outputs, j) for j, info in enumerate(owned)}
        narrow = set(self._narrow_directions(split.values(), like)) if split else set()
        directions = self.directions_of([i for i in owned if i.name not in narrow], orthogonalized, like.dtype)
        if split:
            directions.update(self.split_from_homes(split, orthogonalized, directions, narrow, like))
        self.apply_directions(entries, directions)
        if self.on_applied is not None:
            self.on_applied([p for p, *_ in members])

    def _launch_overlapped_split(self, entries) -> None:
        """The Muon part of ``step()`` under the split layout: the momentum passes and the pieces' way to
        their homes for every matrix at once (one exchange: every home's links busy together), then the
        NS cut per need group and launched; each group's way back when the forward needs it. Every group
        with a split matrix is made on every rank, so that all ranks run the ways back in the same
        (need) order. ``stats['dp_bytes']``: what the last finished step's exchange sent (under 'on'
        the ways back run in the forward, after this step returns)."""
        like = self._master_like(entries)
        split = self.split_of(entries)
        if any(i.dp_split.team for i in split.values()):  # (the config refuses the two together; a plan could not)
            raise RuntimeError("DMuon: a matrix whose NS a team shares runs in the synchronous step only; this plan "
                               "has teams under an overlapped step: plan without teams")
        self.stats["dp_bytes"], self.dp.bytes_sent = self.dp.bytes_sent, 0
        with record_function("dmuon.momentum"):
            updates = self._momentum_updates(entries)
        work_updates = {info.name: updates[info.name] for _, _, info in entries if info.dp_split is None}
        if split:
            work_updates.update(self.split_to_homes(split, updates, like))
        members, split_by_need = defaultdict(list), defaultdict(dict)
        for entry in entries:
            members[entry[2].need].append(entry)
        for name, info in split.items():
            split_by_need[info.need][name] = info
        lifecycles = {need: ([p for p, _, _ in members[need]],
                             self._split_need_group(members[need], split_by_need[need], work_updates, need, like))
                      for need in sorted(set(members) | set(split_by_need))}
        self._overlapped.launch(lifecycles, like.device if like is not None else None)
        if self.overlap_mode.finishes_in_step:
            self.stats["dp_bytes"] = self.dp.bytes_sent
        self.stats["ns_matrices_total"] += self.stats["ns_matrices"]
        self.stats["tp_bytes"] = 0

    def _launch_overlapped(self, entries, grad_scale: Optional[float] = None) -> None:
        """The Muon part of ``step()`` for whole matrices (no TP), cut per need group and launched."""
        self._overlapped.launch(self._need_groups(entries, grad_scale), entries[0][0].device if entries else None)
        self.stats["ns_matrices_total"] += self.stats["ns_matrices"]
        self.stats["tp_bytes"] = 0

    def _begin_overlapped_step(self, grad_scale: Optional[float]) -> None:
        """At ``step()``: the groups the last forward did not need are finished (counted in
        ``stats['overlap_groups_left']``: NS the forward did not hide); 'backward': this step's own,
        launched during its backward, stay in flight, unless clipping fires (``grad_scale``): they
        started unclipped and are launched again."""
        self.stats["overlap_groups_left"] += self._overlapped.left_count()
        self._overlapped.finish_all(keep_early=True)
        if grad_scale is not None:
            self.cancel_early_for_clipping()
        self._overlapped.commit_early()

    # ---------------------------------------------------------------- what the Megatron glue calls
    def launch_early(self, entries) -> None:
        """'backward': one need group's momentum pass and NS, launched while the backward still runs
        (its grads final: reduced to this owner). Whatever the last forward left in flight is finished
        first. The momenta it overwrites are kept until the step decides (``cancel_early``), so a
        skipped step changes nothing."""
        if not entries:
            return
        self._overlapped.finish_all(keep_early=True)
        if not self._overlapped.started_early():  # the step's counters start with its first early group
            self.stats["ns_calls"] = self.stats["ns_fp32_retries"] = self.stats["ns_matrices"] = 0
        backups = {}
        for p, _, _ in entries:
            buf = self.state.get(p, {}).get("momentum_buffer")
            backups[p] = None if buf is None else buf.clone()
        started = self._overlapped.launch(self._need_groups(entries), entries[0][0].device, early_backups=backups)
        self.stats["overlap_groups_early"] += len(started)  # need groups started during a backward, all steps

    def cancel_early(self) -> None:
        """The step is skipped (non-finite grads): the early groups are dropped unapplied and the
        momenta they overwrote restored, as if nothing had run."""
        for p, buf in self._overlapped.cancel_early().items():
            if buf is None:
                self.state.get(p, {}).pop("momentum_buffer", None)
            else:
                self.state[p]["momentum_buffer"].copy_(buf)

    def cancel_early_for_clipping(self) -> None:
        """Clipping fires on a step whose early groups started unclipped: they are dropped (and
        counted as redone) for the step to launch them again, clipped, as 'on' does."""
        if self._overlapped.started_early():
            self.stats["overlap_redos"] += self._overlapped.early_count()
            self.cancel_early()

    def started_early(self, need: int) -> bool:
        """Whether need group ``need`` was launched during this step's backward."""
        return self._overlapped.started_early(need)

    def early_momentum_stream(self, device) -> "torch.cuda.Stream":
        """The stream the early groups' momentum passes run on (``OverlappedStep.momentum_stream``)."""
        return self._overlapped.momentum_stream(device)

    def finish_need_group(self, need: int) -> None:
        """Need group ``need`` finished (when the forward first needs its params)."""
        self._overlapped.finish(need)

    def finish_overlapped(self) -> None:
        """Every group in flight finished (before anything reads the masters or params)."""
        self._overlapped.finish_all()

    def needs_in_flight(self) -> list:
        """The need groups launched and not finished (empty unless the step overlaps)."""
        return self._overlapped.needs()

    def masters_in_flight(self) -> set:
        """The main params whose update is in flight (not applied to their masters yet)."""
        return self._overlapped.masters()


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
