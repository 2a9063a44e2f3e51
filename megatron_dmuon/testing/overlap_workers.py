"""The overlapped owner step (`--dmuon-overlap-step`) on each gloo rank: several variants of one
run in one spawned world (tests/runtime/test_overlap_step.py)."""
from __future__ import annotations

from .checkpoint_workers import _concat, _load, _save
from .workers import _build, _finish_overlap, _report, _train, init_parallel


def overlap_step_variants(rank, world_size, variants, tp=1, pp=1, ep=1, vpp=None, resume=None, **kw):
    """{variant name: its report} for every ``variants[name]`` (``muon_kw`` of ``_build``, e.g.
    ``{'overlap_step': 'on'}``) on the same model, data and parallel layout; ``resume=(name,
    step, root)``: that variant also saves at ``step`` into ``root``, and a fresh (perturbed) model
    resumes from it and trains to the end, reported as '<name>+resumed'."""
    import torch

    init_parallel(tp, pp, ep, vpp)
    steps = kw.get("steps", 10)
    nan_at = kw.pop("nan_at", None)  # (step, rank): that rank's grad of one matrix is NaN (the step is skipped)
    out = {}
    for name, muon_kw in variants.items():
        run = _build(muon_kw=muon_kw, **kw)
        if resume is not None and resume[0] == name:
            at, root = resume[1], resume[2]
            first = _train(run, range(at), nan_at=nan_at)
            _save(run, root, at, "dist")
            rest = _train(run, range(at, steps), nan_at=nan_at)
            _finish_overlap(run)
            out[name] = _report(run, rank, _concat(first, rest), [])
            resumed = _build(perturb=True, muon_kw=muon_kw, **kw)
            _load(resumed, root, at, "dist")
            rest = _train(resumed, range(at, steps), nan_at=nan_at)
            _finish_overlap(resumed)
            out[name + "+resumed"] = _report(resumed, rank, rest, [])
        else:
            trained = _train(run, range(steps), nan_at=nan_at)
            _finish_overlap(run)
            out[name] = _report(run, rank, trained, [])
        out[name]["pending_after"] = sum(len(p.optimizer.needs_in_flight()) for p in run.parts)
        out[name]["groups_left"] = sum(p.optimizer.stats["overlap_groups_left"] for p in run.parts)
        out[name]["groups_early"] = sum(p.optimizer.stats["overlap_groups_early"] for p in run.parts)
        out[name]["redos"] = sum(p.optimizer.stats["overlap_redos"] for p in run.parts)
        out[name]["ns_checked"] = run.opt.ns_check_reported_at or 0  # the last step whose NS check was reported
        out[name]["needs"] = sorted({i.need for p in run.parts for i in p.optimizer.matrix_info.values()})
        torch.distributed.barrier()
    return out
