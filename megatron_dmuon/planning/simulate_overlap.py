"""How much owner NS the overlapped step (overlap step ``on``) hides: an event model per GPU.

The window (docs/overlap_step.md): from the start of the last micro-batch's backward to the end of
the next iteration's first forward. Per GPU of one stage, with the forward/backward time of each
segment from planning/compute_model.py and the NS of each need group from the owner plan:

* **backward** of the last micro-batch, segments in reverse; a bucket's grads are final when its
  last segment's backward ends and, at DP > 1, its reduce-scatter (comm stream, in ready order) ends;
  the step starts when every reduce-scatter is done;
* **step**: the element-wise passes (not hidden), then:
  - ``off``: the whole owner NS (one batched call per shape) inside the step, at full speed;
  - ``on``: every need group released to the NS stream (one batched call per shape of the group);
  - ``on_backward_start`` (``--clip-grad 0``, issue item 2): each group released as soon as its
    grads are final, during the backward;
  - ``none``: no NS at all (the reference the exposed time is measured against);
* **first forward**, segment by segment; at the first module of a bucket group, Megatron's pre-hook
  (``--overlap-param-gather``): the first group is dispatched there (the model stream waits for its
  NS); the all-gather of the group must end (a collective: it starts when every rank has issued it
  and finished the group's NS, after the previous all-gather); then the next group is dispatched,
  and its finish makes the model stream wait for ITS NS (``prefetch_waits``, what the runtime does
  today: ``_OverlapStepBucketGroup.start_param_sync`` finishes on the current stream). So the
  forward of group k waits for the NS of group k + 1.

The NS stream serves the released groups in need order (first needed first, preempting at kernel
granularity: one priority per need rank, idealized) at ``eta`` of its standalone speed while the
model's kernels run (backward, element-wise passes, forward), and at full speed while the model
stream waits. Exposed NS of a mode = end of the first forward (slowest GPU) minus the same with no
NS at all. The model's kernels are not slowed by the NS beside them (they own the high-priority
stream), host launch time is zero (graph launch), the per-group apply is counted in the step's
element-wise passes, pipeline schedules are not modelled (the stage alone). Pure data.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence

from .compute_model import Segment, forward_segments, model_tflops
from .cost_model import ClusterSpec, CostModel, load_config
from .models import ModelSpec, ParallelSpec
from .owner_layout import megatron_bucket_size
from .planners import gpu_cells, plan_stage, predict_stage
from .simulate import collective_ms, gpu_step_parts

__all__ = ["DEFAULT_ETA", "MODES", "need_groups", "group_ns_ms", "overlap_timeline", "simulate_overlap", "pipelined_publish_ms"]

# Co-run efficiency: the fraction of its standalone speed the NS stream keeps beside the model's
# kernels. Kept low on purpose: the 1-H200 runs fit 0.5-1.0 under eight hardware queues (0 under one),
# but their window is too short to pin it (docs/load_balancing.md, "Overlap model").
DEFAULT_ETA = 0.25
MODES = ("none", "off", "on", "on_backward_start")


def need_groups(plan: dict) -> tuple:
    """([{'need', 'kind', 'bucket', 'numel', 'next'}], {param name: need}): one group per bucket
    (Megatron's default bucket groups), each buffer's buckets last to first (its all-gather chain;
    ``megatron/overlap_hooks.need_order``), dense then expert."""
    groups, param_need = [], {}
    for kind, layout in plan["layouts"].items():
        first = len(groups)
        last = len(layout.buckets) - 1
        for b in range(last, -1, -1):
            bucket = layout.buckets[b]
            need = len(groups)
            groups.append({"need": need, "kind": kind, "bucket": b, "numel": bucket.end - bucket.start,
                           "next": need + 1 if b > 0 else None})
        for name, (_, _, b) in layout.param_ranges.items():
            param_need[name] = first + last - b
    return groups, param_need


def group_ns_ms(plan: dict, par: ParallelSpec, cost_model: CostModel, param_need: Dict[str, int]) -> List[Dict[int, float]]:
    """Per GPU of the stage, {need: predicted NS ms of the matrices it owns in that group}: the
    stacks cut per group, each shape one batched call (launch + k x per-matrix, the plan's cost model)."""
    counts = defaultdict(int)  # (kind, cell, need, shape) -> matrices
    for kind, layout in plan["layouts"].items():
        full = {p.name: tuple(p.full_shape) for p in plan["params"][kind]}
        for name, dp in layout.owners.items():
            counts[kind, dp * layout.tp_size + layout.tp_owners.get(name, 0), param_need[name], full[name]] += 1
    per_cell = defaultdict(lambda: defaultdict(float))
    for (kind, cell, need, shape), k in counts.items():
        per_cell[kind, cell][need] += cost_model.time_ms(shape, k)
    out = []
    for r in range(par.dp_size * par.tp):
        work: Dict[int, float] = defaultdict(float)
        for kind, cell in gpu_cells(par, r).items():
            for need, ms in per_cell.get((kind, cell), {}).items():
                work[need] += ms
        out.append(dict(work))
    return out


class _NSStream:
    """One GPU's NS work: released groups served in need order, ``rate`` x standalone speed."""

    def __init__(self, work: Dict[int, float]):
        self.left = dict(work)
        self.pending: List[int] = []  # released, not done, sorted
        self.done: Dict[int, float] = {}
        self.t = 0.0

    def release(self, need: int) -> None:
        if need in self.done or need in self.pending:
            return
        if self.left.get(need, 0.0) <= 0.0:
            self.done[need] = self.t
        else:
            self.pending.append(need)
            self.pending.sort()

    def advance(self, t_end: float, rate: float) -> None:
        while self.t < t_end and self.pending and rate > 0:
            need = self.pending[0]
            finish = self.t + self.left[need] / rate
            if finish <= t_end:
                self.t, self.left[need] = finish, 0.0
                self.done[need] = finish
                self.pending.pop(0)
            else:
                self.left[need] -= (t_end - self.t) * rate
                self.t = t_end
        self.t = max(self.t, t_end)

    def finish_idle(self, need: int) -> float:
        """When group ``need`` is done if this GPU serves NS at full speed from now on."""
        if need in self.done:
            return self.done[need]
        if need not in self.pending:
            raise RuntimeError(f"need group {need} waited for before its NS was released")
        return self.t + sum(self.left[n] for n in self.pending if n <= need)


class _Gpu:
    def __init__(self, work: Dict[int, float]):
        self.ns = _NSStream(work)
        self.t = 0.0

    def run(self, ms: float, eta: float) -> None:  # the model's kernels run: NS at eta
        self.ns.advance(self.t + ms, eta)
        self.t += ms

    def wait_until(self, t: float) -> None:  # the model stream waits: NS at full speed
        if t > self.t:
            self.ns.advance(t, 1.0)
            self.t = t


def overlap_timeline(mode: str, segments: Sequence[Segment], groups: Sequence[dict], param_need: Dict[str, int],
                     work: Sequence[Dict[int, float]], ns_off: Sequence[float], elementwise: Sequence[float],
                     ag_ms: Sequence[float], rs_ms: Sequence[float], eta: float, dp: int,
                     prefetch_waits: bool = True) -> dict:
    """One mode's window on every GPU (``work``, ``ns_off``, ``elementwise``: per GPU; ``ag_ms``,
    ``rs_ms``: per need group). Time 0 = start of the last micro-batch's backward. Returns
    {'end_ms': end of the first forward on the slowest GPU, 'step_end_ms', 'ns_done_in_backward_ms'}."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} unknown; valid: {', '.join(MODES)}")
    gpus = [_Gpu(w if mode in ("on", "on_backward_start") else {}) for w in work]
    # backward: when each group's grads are final
    t, ready = 0.0, {}
    for seg in reversed(segments):
        t += seg.bwd_ms
        for name in seg.params:
            ready[param_need[name]] = t
    backward_end, comm = t, 0.0
    final = {}
    for need in sorted(ready, key=lambda n: (ready[n], -n)):
        start = max(ready[need], comm)
        comm = start + (rs_ms[need] if dp > 1 else 0.0)
        final[need] = comm
    grads_done = max(backward_end, comm)
    for g in gpus:
        if mode == "on_backward_start":
            for need in sorted(final, key=lambda n: final[n]):
                g.ns.advance(min(final[need], backward_end), eta)
                g.ns.advance(final[need], 1.0)
                g.ns.release(need)
            g.ns.advance(backward_end, eta)
        g.wait_until(grads_done)
    backward_ns = max((sum(w.values()) - sum(g.ns.left.values()) for w, g in zip(work, gpus)), default=0.0) \
        if mode == "on_backward_start" else 0.0
    for r, g in enumerate(gpus):  # the step
        g.run(elementwise[r], eta)
        if mode == "off":
            g.wait_until(g.t + ns_off[r])
        for grp in groups:
            g.ns.release(grp["need"])
    step_end = max(g.t for g in gpus)
    # the first forward, through Megatron's param all-gather chain
    issued: Dict[int, float] = {}
    hooked = set()

    def dispatch(need: int, wait: bool) -> None:
        for g in gpus:
            if wait:
                g.wait_until(g.ns.finish_idle(need))
        issued[need] = max(g.t for g in gpus)

    for seg in segments:
        for need in sorted({param_need[p] for p in seg.params} - hooked):
            hooked.add(need)
            if need not in issued:
                dispatch(need, True)
            start = max(issued[need], comm, max(g.ns.finish_idle(need) for g in gpus))
            comm = start + ag_ms[need]
            for g in gpus:
                g.wait_until(comm)
            nxt = groups[need]["next"]
            if nxt is not None and nxt not in issued:
                dispatch(nxt, prefetch_waits)
        for g in gpus:
            g.run(seg.fwd_ms, eta)
    return {"end_ms": max(g.t for g in gpus), "step_end_ms": step_end, "ns_done_in_backward_ms": backward_ns}


def _unique(per_gpu: Sequence[tuple]) -> List[int]:
    """Indices of the distinct GPUs (same work, element-wise and NS: the same timeline)."""
    seen, keep = set(), []
    for r, key in enumerate(per_gpu):
        if key not in seen:
            seen.add(key)
            keep.append(r)
    return keep


def simulate_overlap(model: ModelSpec, par: ParallelSpec, cluster: ClusterSpec, cost_model: CostModel, *,
                     eta: float = DEFAULT_ETA, seq_length: int = 4096, micro_batch: int = 1, micro_batches: int = 4,
                     planner: str = "milp", two_level: bool = True, plan: Optional[dict] = None,
                     config: Optional[dict] = None, tflops: Optional[float] = None,
                     milp_options: Optional[dict] = None, stage: int = 0, prefetch_waits: bool = True) -> dict:
    """Exposed owner NS per iteration under the overlap step ``off`` / ``on`` / ``on`` with the
    start during the last backward (no clipping), and the fraction of ``off``'s NS hidden.
    ``plan``: a ``plan_stage`` result (Megatron's buckets of an overlapped grad reduce, which the
    overlapped param gather needs); ``tflops``: the model rate (default: the device's
    ``model_tflops`` in the cluster config)."""
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta (co-run efficiency) must be in [0, 1], got {eta}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    config = config or load_config()
    opt = config["optimizer"]
    rate = tflops if tflops is not None else model_tflops(cluster.device.name, config)
    if plan is None:
        size = megatron_bucket_size(par.dp_size, True, None, pp_rank=stage)
        plan = plan_stage(model, par, cost_model, planner, stage=stage, bucket_size=size, milp_options=milp_options)
    segments = forward_segments(model, par, rate, seq_length=seq_length, micro_batch=micro_batch, stage=stage)
    groups, param_need = need_groups(plan)
    ns_off = predict_stage(plan, par, cost_model, opt["grad_bytes"], opt["param_bytes"])["rank_ms"]
    parts = gpu_step_parts(plan, par, cluster, cost_model, opt, ns_off)
    elementwise = [p["elementwise_ms"] + p["tp_exchange_ms"] for p in parts]
    work = group_ns_ms(plan, par, cost_model, param_need)
    layouts = plan["layouts"]
    ag_ms, rs_ms = [], []
    for grp in groups:
        layout = layouts[grp["kind"]]
        for out, nbytes in ((ag_ms, opt["param_bytes"]), (rs_ms, opt["grad_bytes"])):
            out.append(collective_ms(cluster, layout.world_size, layout.tp_size, grp["numel"] * nbytes, two_level))
    keep = _unique([(tuple(sorted(w.items())), e, n) for w, e, n in zip(work, elementwise, ns_off)])
    pick = lambda xs: [xs[r] for r in keep]  # noqa: E731
    ends = {mode: overlap_timeline(mode, segments, groups, param_need, pick(work), pick(ns_off), pick(elementwise),
                                   ag_ms, rs_ms, eta, par.dp_size, prefetch_waits) for mode in MODES}
    base = ends["none"]["end_ms"]
    exposed = {m: ends[m]["end_ms"] - base for m in MODES if m != "none"}  # >= 0: NS only delays (tested)
    fwd, bwd = sum(s.fwd_ms for s in segments), sum(s.bwd_ms for s in segments)
    cut = [sum(w.values()) for w in work]
    first = min((n for w in work for n, ms in w.items() if ms > 0), default=None)
    step_el = max(elementwise)
    compute = micro_batches * (fwd + bwd)
    off = exposed["off"]
    return {"gpus": par.world, "dp": par.dp_size, "cluster": cluster.name, "planner": planner, "eta": eta,
            "model_tflops": rate, "seq_length": seq_length, "micro_batch": micro_batch, "micro_batches": micro_batches,
            "prefetch_waits": prefetch_waits, "need_groups": len(groups),
            "groups_with_ns": len({n for w in work for n, ms in w.items() if ms > 0}),
            "forward_ms": fwd, "backward_ms": bwd, "elementwise_ms": step_el,
            "owner_ns_off_ms": max(ns_off), "owner_ns_cut_ms": max(cut),
            "stack_cut_ms": max(c - o for c, o in zip(cut, ns_off)),
            "first_group_ns_ms": max((w.get(first, 0.0) for w in work), default=0.0),
            "exposed_ns_ms": exposed,
            "hidden_fraction": {m: (1.0 - exposed[m] / off) if off > 0 else 0.0 for m in ("on", "on_backward_start")},
            "ns_done_in_backward_ms": ends["on_backward_start"]["ns_done_in_backward_ms"],
            "publish_ms": sum(ag_ms), "iteration_ms": {m: compute + step_el + exposed[m] for m in exposed},
            "compute_ms": compute}


def pipelined_publish_ms(start_ms: float, ns_ms: Sequence[Dict[int, float]], back_ms: Dict[int, float],
                         ag_ms: Sequence[float]) -> float:
    """The optimizer step under overlap step ``on``, from its start to the last need group published,
    with no forward beside it (the scale table's convention for every optimizer's step): every GPU's
    NS stream starts at ``start_ms`` (the step's element-wise passes and, under the split layout, the
    pieces' way to their homes) and runs its groups' NS (``ns_ms``: per GPU, {need: ms}) one after the
    other in need order, at full speed; group g is published when every GPU has its NS done and the
    all-gather before it has ended: then its directions come back (``back_ms[g]``, the slowest rank's
    way back; the split layout) and its all-gather runs (``ag_ms[g]``), on one communicator."""
    # when every GPU's NS stream has run each group and all before it (the event after a group's NS launch
    # is recorded in stream order); start_ms for a GPU with none of them
    ready = [start_ms] * len(ag_ms)
    for work in ns_ms:
        t = start_ms
        for need in range(len(ag_ms)):
            t += work.get(need, 0.0)
            ready[need] = max(ready[need], t)
    comm = start_ms
    for need, ag in enumerate(ag_ms):
        comm = max(comm, ready[need]) + back_ms.get(need, 0.0) + ag
    return comm
