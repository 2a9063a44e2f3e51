"""Checkpoint functions run on each gloo rank by the tests and `dmuon-verify --resume-at`:
save, resume a fresh (perturbed) model and optimizer, and loads that must fail."""
from __future__ import annotations

import torch

from .workers import DEFAULTS, _build, _finish_overlap, _report, _train, init_parallel, optimizer_state_shards


def dmuon_resume(rank, world_size, resume_at, tp=1, pp=1, ep=1, vpp=None, fmt="dist", save_dir=None, load_dir=None,
                 resume_here=True, optimizer_only=False, data_dp=None, instances=1, **kw):
    """Save/load through the optimizer's checkpoint entry points.

    * ``load_dir`` unset: train ``resume_at`` steps, save (``fmt``: 'dist' = dist_checkpointing
      torch_dist, 'torch' = state_dict() + save_parameter_state()), train on to the end: the
      uninterrupted run; then build a fresh (perturbed) model and optimizer, load, train
      ``resume_at``.. the end: the resumed run. Returns both reports ('uninterrupted', 'resumed').
      With ``save_dir`` the checkpoint stays there (for a resume at another layout; with
      ``resume_here=False`` no resumed run here), else a temporary directory is removed.
    * ``load_dir`` set: only the resumed run, from that checkpoint (any DP/TP layout).
    ``optimizer_only``: load only the optimizer (the publish must then bring every replica the
    loaded weights)."""
    import shutil
    import tempfile

    init_parallel(tp, pp, ep, vpp, instances=instances)
    kw["instances"] = instances
    steps = {**DEFAULTS, **kw}["steps"]
    out = {}
    if load_dir is None:
        root = save_dir
        if rank == 0 and root is None:
            root = tempfile.mkdtemp(prefix="dmuon-ckpt-")
        box = [root]
        torch.distributed.broadcast_object_list(box, src=0)
        root = box[0]
        try:
            run = _build(**kw)
            first = _train(run, range(resume_at), data_dp)
            _save(run, root, resume_at, fmt)
            rest = _train(run, range(resume_at, steps), data_dp)
            _finish_overlap(run)
            out["uninterrupted"] = _report(run, rank, _concat(first, rest), [])
            out["uninterrupted"]["checkpoint"] = root
            if not resume_here:
                return out
            resumed = _build(perturb=True, **kw)
            _load(resumed, root, resume_at, fmt, optimizer_only)
            rest = _train(resumed, range(resume_at, steps), data_dp)
            _finish_overlap(resumed)
            out["resumed"] = _report(resumed, rank, rest, [])
        finally:
            torch.distributed.barrier()
            if rank == 0 and save_dir is None:
                shutil.rmtree(root, ignore_errors=True)
        return out
    resumed = _build(perturb=True, **kw)
    _load(resumed, load_dir, resume_at, fmt, optimizer_only)
    rest = _train(resumed, range(resume_at, steps), data_dp)
    _finish_overlap(resumed)
    return {"resumed": _report(resumed, rank, rest, [])}


def _concat(a, b):
    return {k: (a[k] + b[k]) if isinstance(a[k], list) else b[k] for k in a}


def _save(run, root, iteration, fmt):
    import os

    from megatron.core import parallel_state as ps

    from megatron_dmuon.megatron.checkpoint.job import save_checkpoint

    if fmt == "dist":
        save_checkpoint(root, iteration, run.chunks, run.opt, extra={"scheduler": run.sched.state_dict()})
        return
    # torch format as Megatron-LM writes it: DP rank 0 of each model-parallel rank writes the
    # model + optimizer.state_dict(); every rank joins save_parameter_state (gathered to DP rank 0)
    mp = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_{ps.get_pipeline_model_parallel_rank():03d}"
    path = os.path.join(root, f"iter_{iteration:07d}", mp)
    if ps.get_data_parallel_rank() == 0:
        os.makedirs(path, exist_ok=True)
        torch.save({**_model_state_dicts(run), "optimizer": run.opt.state_dict(),
                    "scheduler": run.sched.state_dict()}, os.path.join(path, "model_optim_rng.pt"))
    torch.distributed.barrier()
    run.opt.save_parameter_state(os.path.join(path, "distrib_optim.pt"))
    torch.distributed.barrier()


def _model_state_dicts(run) -> dict:
    """The model part of a torch-format checkpoint as Megatron-LM writes it: 'model', or
    'model0', 'model1', ... with virtual stages."""
    if len(run.chunks) == 1:
        return {"model": run.chunks[0].state_dict()}
    return {f"model{i}": c.state_dict() for i, c in enumerate(run.chunks)}


def _load(run, root, iteration, fmt, optimizer_only=False):
    import os

    from megatron.core import parallel_state as ps

    from megatron_dmuon.megatron.checkpoint.job import checkpoint_dir, load_checkpoint

    if fmt == "dist":
        if optimizer_only:  # the masters alone: the publish must reach every replica
            from megatron.core import dist_checkpointing

            from megatron_dmuon.megatron.checkpoint.optimizer_state import content_metadata, model_state

            state = model_state(run.chunks)
            state["optimizer"] = run.opt.sharded_state_dict(state, is_loading=True,
                                                            metadata=content_metadata("fully_reshardable"))
            for key in [k for k in state if k.startswith("model")]:
                state.pop(key)
            loaded = dist_checkpointing.load(state, checkpoint_dir(root, iteration))
            run.opt.load_state_dict(loaded["optimizer"])
            return
        common = load_checkpoint(checkpoint_dir(root, iteration), run.chunks, run.opt)
        run.sched.load_state_dict(common["scheduler"])
        return
    mp = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_{ps.get_pipeline_model_parallel_rank():03d}"
    path = os.path.join(root, f"iter_{iteration:07d}", mp)
    saved = torch.load(os.path.join(path, "model_optim_rng.pt"), weights_only=False)
    if not optimizer_only:
        for key, chunk in zip(_model_state_dicts(run), run.chunks):
            chunk.load_state_dict(saved[key])
    run.opt.load_state_dict(saved["optimizer"])
    run.opt.load_parameter_state(os.path.join(path, "distrib_optim.pt"))
    run.sched.load_state_dict(saved["scheduler"])


def _snapshot(run) -> dict:
    from megatron_dmuon.testing.global_params import local_shards

    return {"params": [local_shards(c.module) for c in run.chunks], "state": optimizer_state_shards(run)}


def _same(a: dict, b: dict) -> bool:
    def flat(x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, dict):
            return [t for k in sorted(x, key=str) for t in flat(x[k])]
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in flat(v)]
        return []

    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(torch.equal(x, y) for x, y in zip(fa, fb))


def checkpoint_bad_loads(rank, world_size, root, **kw):
    """Loads that must fail loudly on every rank and leave the model and optimizer untouched:
    a checkpoint of another model, of Megatron's own Adam optimizer, with a truncated data file,
    of another update rule (--dmuon-update).
    Returns {case: (error message, state untouched)}."""
    import os
    import shutil

    from megatron_dmuon.megatron.checkpoint.job import checkpoint_dir, load_checkpoint, save_checkpoint

    init_parallel()
    good = _build(**kw)
    _train(good, range(2))
    save_checkpoint(os.path.join(root, "dmuon"), 2, good.chunks, good.opt)
    adam = _build(mode="adam", **kw)
    _train(adam, range(1))
    save_checkpoint(os.path.join(root, "adam"), 1, adam.chunks, adam.opt)
    corrupt = os.path.join(root, "corrupt")
    if rank == 0:  # the same checkpoint with its data files cut short (a crash while copying it)
        shutil.copytree(os.path.join(root, "dmuon"), corrupt)
        for data_file in (f for f in os.listdir(checkpoint_dir(corrupt, 2)) if f.endswith(".distcp")):
            with open(os.path.join(checkpoint_dir(corrupt, 2), data_file), "r+b") as f:
                f.truncate(os.path.getsize(f.name) // 2)
    torch.distributed.barrier()
    cases = {
        "other_model": (dict(shape_kw={**(kw.get("shape_kw") or {}), "num_layers": 3}), checkpoint_dir(os.path.join(root, "dmuon"), 2)),
        "adam_checkpoint": ({}, checkpoint_dir(os.path.join(root, "adam"), 1)),
        "truncated_file": ({}, checkpoint_dir(corrupt, 2)),
        "other_update": (dict(muon_kw={"update": "normuon"}), checkpoint_dir(os.path.join(root, "dmuon"), 2)),
    }
    out = {}
    for case, (extra, path) in cases.items():
        run = _build(**{**kw, **extra})
        _train(run, range(1))
        before = _snapshot(run)
        try:
            load_checkpoint(path, run.chunks, run.opt)
            message = None
        except BaseException as e:  # noqa: BLE001 - the test inspects the type and message
            message = f"{type(e).__name__}: {e}"
        out[case] = (message, _same(before, _snapshot(run)))
    return out


def save_tiny_dist_checkpoint(rank, world_size, path):
    """A real megatron-core dist checkpoint of a tensor and an object (what the trusted .metadata reader
    must admit: every type torch DCP and megatron-core write for them)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    state = {"weight": ShardedTensor.from_rank_offsets("weight", torch.arange(12.0).view(3, 4)),
             "extra": ShardedObject("extra", {"step": 3}, (1,), (0,)), "common": {"iteration": 3}}
    dist_checkpointing.save(state, path)
    return True


def load_param_state_file_errors(rank, world_size, filename):
    """Each rank's error from DMuon's torch-format load of ``filename`` (refused before any state is
    touched, so parts need only their DP group)."""
    from types import SimpleNamespace

    from ..megatron.checkpoint.torch_format import load_param_state_file

    try:
        load_param_state_file([SimpleNamespace(data_parallel_group=torch.distributed.group.WORLD)], filename)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return "loaded"


def save_into_a_link_errors(rank, world_size, root, target):
    """Each rank's error from a save whose iteration directory became a link (to ``target``) after the
    start-up check: raised on every rank together, before anything is written."""
    import os

    from ..megatron.checkpoint.job import checkpoint_dir, save_checkpoint

    if rank == 0:
        os.makedirs(root, exist_ok=True)
        os.symlink(target, checkpoint_dir(root, 2))
    torch.distributed.barrier()
    try:
        save_checkpoint(root, 2, [], None)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return "saved"
