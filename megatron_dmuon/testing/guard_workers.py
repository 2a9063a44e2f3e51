"""Workers of the tests of the step's guards, run on each gloo rank (imported in child processes): the
replica check, a NaN-skipped step against one that never saw its batch, and the device reads of DMuon's
metrics."""
from __future__ import annotations

import torch

from .workers import _build, _finish_overlap, _micro_batches, _report, _train, init_parallel


def replica_check(rank, world_size, tp=1, pp=1, ep=1, vpp=None, corrupt_rank=None, **kw):
    """Train, optionally perturb one element of one parameter on ``corrupt_rank`` (to show that a
    divergent replica is found), then run the per-bucket replica check; returns its report."""
    import dataclasses

    from megatron_dmuon.megatron.replicas import check_replicas

    init_parallel(tp, pp, ep, vpp)
    run = _build(**kw)
    _train(run, range(run.o["steps"]))
    _finish_overlap(run)
    if corrupt_rank is not None and torch.distributed.get_rank() == corrupt_rank:
        with torch.no_grad():
            target = next(p for c in run.chunks for n, p in c.module.named_parameters() if n.endswith("linear_qkv.weight"))
            target.view(-1)[0] += 1e-3
    return dataclasses.asdict(check_replicas(run.chunks))


def nan_vs_never_seen(rank, world_size, nan_at=(3, 1), **kw):
    """Two runs in one process group: one whose rank ``nan_at[1]`` gets a NaN gradient at step
    ``nan_at[0]``, one that never sees that step's batch. Returns both reports."""
    init_parallel()
    out = {}
    for name, extra in (("nan", dict(nan_at=nan_at)), ("never_seen", dict(skip_steps=(nan_at[0],)))):
        run = _build(**kw)
        trained = _train(run, range(run.o["steps"]), **extra)
        _finish_overlap(run)
        out[name] = _report(run, rank, trained, [])
    return out


def metrics_device_reads(rank, world_size, steps=3, **kw):
    """Device values read back (``Tensor.item`` / ``tolist``, CUDA syncs) inside the optimizer steps of a DMuon run,
    with DMuon's metrics off, then on (megatron/metrics.py must add none); the metrics' values at the end."""
    from megatron_dmuon.megatron.gpt import train_step

    init_parallel()
    run = _build(**kw)
    counts = {"item": 0, "tolist": 0, "synchronize": 0}
    originals = {"item": torch.Tensor.item, "tolist": torch.Tensor.tolist, "synchronize": torch.cuda.synchronize}

    def counted(name):
        def wrapper(*a, **k):
            counts[name] += 1
            return originals[name](*a, **k)
        return wrapper

    class CountedStep:  # the optimizer as train_step sees it, its step() counted
        def __init__(self, opt):
            self.opt = opt

        def __getattr__(self, name):
            return getattr(self.opt, name)

        def step(self):
            torch.Tensor.item, torch.Tensor.tolist = counted("item"), counted("tolist")
            torch.cuda.synchronize = counted("synchronize")
            try:
                return self.opt.step()
            finally:
                torch.Tensor.item, torch.Tensor.tolist = originals["item"], originals["tolist"]
                torch.cuda.synchronize = originals["synchronize"]

    def steps_counted(first):
        before = dict(counts)
        for step in range(first, first + steps):
            micro = _micro_batches(run, step)
            train_step(run.chunks, CountedStep(run.opt), micro, run.shape.seq_length, run.o["mbs"])
        return {k: counts[k] - before[k] for k in counts}

    off = steps_counted(0)
    metrics = run.opt.enable_metrics(run.chunks)
    on = steps_counted(steps)
    return {"off": off, "on": on, "values": metrics.values()}
