"""Optimizer switches on gloo ranks (tests): Megatron's own LayerWise Muon (``--optimizer muon
--use-distributed-optimizer`` in Megatron-LM) saves a torch_dist checkpoint, DMuon loads it and
trains on; compared with the run that never switched."""
from __future__ import annotations

import torch

from .workers import DEFAULTS, _build, _finish_overlap, _train, init_parallel, optimizer_state_shards


def layerwise_available() -> bool:
    from megatron.core.optimizer import emerging_optimizers

    return bool(emerging_optimizers.HAVE_EMERGING_OPTIMIZERS)


def _build_layerwise(shape_kw=None, ns_dtype="float32", muon_kw=None, split=None, **kw):
    """Model, DDP and optimizer as Megatron-LM builds them for ``--optimizer muon
    --use-distributed-optimizer`` (megatron/training: arguments.py turns it into
    ``use_layer_wise_distributed_optimizer``; ``wrap_model_chunks_with_ddp`` tags the params and
    gives DDP LayerWise's shard-aligned layout): ChainedOptimizer([LayerWise(Muon), DistOpt(Adam)]).
    The Muon flags are ``megatron_muon_fields`` of the same DMuonConfig the DMuon run uses."""
    import dataclasses
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer, tag_params_for_buffer_routing)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_dmuon.megatron.config import DMuonConfig
    from megatron_dmuon.megatron.megatron_lm_flags import megatron_muon_fields
    from megatron_dmuon.megatron.gpt import build_gpt, transformer_config, wire_sync_funcs
    from megatron_dmuon.testing.global_params import init_params_by_name
    from megatron_dmuon.testing.workers import _muon_settings, _shape, _split_kwargs

    o = {**DEFAULTS, **kw}
    shape = _shape(**(shape_kw or {}))
    if not shape.bf16:  # megatron-core 0.19 wraps LayerWise's Muon (Float16Optimizer...) only under bf16
        raise ValueError("Megatron's LayerWise Muon needs bf16 (megatron-core 0.19 leaves fp32's torch "
                         "optimizer unwrapped: the chain's config check fails)")
    model_config = transformer_config(shape)
    model = build_gpt(shape, model_config)
    init_params_by_name(model)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                               bucket_size=o.get("bucket_size"))
    tag_params_for_buffer_routing([model])
    layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
        list(model.parameters()), ddp_config.bucket_size, ps.get_data_parallel_world_size(), ddp_config)
    ddp = DistributedDataParallel(model_config, ddp_config, model, full_param_layout=layout)
    ddp.broadcast_params()
    wire_sync_funcs([ddp], ddp_config)
    cfg = DMuonConfig(mode="megatron_layerwise", muon=_muon_settings(ns_dtype, **(muon_kw or {})),
                      **_split_kwargs(split))  # as workers._build's DMuon run
    opt_config = OptimizerConfig(optimizer="muon", lr=o["lr"], min_lr=o["lr"], weight_decay=o["weight_decay"],
                                 clip_grad=o["clip_grad"], bf16=True, use_distributed_optimizer=False,
                                 use_layer_wise_distributed_optimizer=True, **megatron_muon_fields(cfg))
    opt = get_megatron_optimizer(opt_config, [ddp])
    sched = OptimizerParamScheduler(
        opt, init_lr=o["lr"], max_lr=o["lr"], min_lr=o["lr"], lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="constant", start_wd=o["weight_decay"], end_wd=o["weight_decay"],
        wd_incr_steps=100, wd_incr_style="constant")
    return SimpleNamespace(chunks=[ddp], ddp=ddp, model=model, ddp_config=ddp_config, opt=opt, sched=sched,
                           parts=[], shape=shape, mode="megatron_layerwise", o=o, config=dataclasses.asdict(cfg.muon))


def layerwise_state(run) -> dict:
    """{global name: {key: full tensor (float64, CPU)}} of a LayerWise run's optimizer, merged over
    every rank: Muon matrices' fp32 master ('param') and momentum from the LayerWise part (whole on
    their DP owner), AdamW params' master, moments and step from the DistributedOptimizer part
    (gathered here over DP). Only for DP (TP = PP = 1)."""
    from megatron_dmuon.testing.global_params import global_names

    names = global_names(run.model)
    by_param = {p: names[n] for n, p in run.model.named_parameters()}
    layerwise, distopt = run.opt.chained_optimizers
    mine = {}
    for inner in layerwise.chained_optimizers:  # Float16OptimizerWithFloat16Params(TensorParallelMuon)
        for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            for model_param, main in zip(model_group, main_group):
                st = inner.optimizer.state[main]
                mine[by_param[model_param]] = {"param": main.detach().double().clone(),
                                               "momentum_buffer": st["momentum_buffer"].detach().double().clone()}
    for model_group, main_group in zip(distopt.model_float16_groups, distopt.shard_fp32_from_float16_groups):
        for model_param, main in zip(model_group, main_group):
            r = distopt._get_model_param_range_map(model_param)["param"]
            st = distopt.optimizer.state[main]
            mine.setdefault(by_param[model_param], {"pieces": [], "numel": model_param.numel(),
                                                    "shape": tuple(model_param.shape),
                                                    "step": float(st["step"])})["pieces"].append(
                (r.start, r.end, {k: t.detach().double().clone() for k, t in
                                  (("param", main), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"]))}))
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    out = {}
    for part in everyone:
        for name, entry in part.items():
            if "pieces" not in entry:
                out[name] = entry
                continue
            full = out.setdefault(name, {k: torch.full((entry["numel"],), float("nan"), dtype=torch.float64)
                                         for k in ("param", "exp_avg", "exp_avg_sq")})
            full["step"] = torch.tensor([entry["step"]], dtype=torch.float64)
            for start, end, tensors in entry["pieces"]:
                for k, t in tensors.items():
                    full[k][start:end] = t
    for name, state in out.items():
        for k, t in state.items():
            if k != "step" and t.dim() == 1 and torch.isnan(t).any():
                raise AssertionError(f"{name}:{k} not covered by the DP ranks' pieces")
    shapes = {names[n]: tuple(p.shape) for n, p in run.model.named_parameters()}
    return {name: {k: (t if k == "step" else t.view(shapes[name])) for k, t in state.items()}
            for name, state in out.items()}


def dmuon_state(run) -> dict:
    """The same view of a DMuon run (from every rank's pieces)."""
    from megatron_dmuon.testing.compare import full_optimizer_state

    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, {"optimizer_state": optimizer_state_shards(run)})
    return {name: {k: (v.view(-1)[:1] if k == "step" else v) for k, v in state.items()}
            for name, state in full_optimizer_state(everyone).items()}


def _params(run) -> dict:
    from megatron_dmuon.testing.global_params import global_names

    names = global_names(run.model if run.model is not None else run.chunks[0].module)
    module = run.model if run.model is not None else run.chunks[0].module
    return {names[n]: p.detach().double().clone() for n, p in module.named_parameters()}


def layerwise_to_dmuon(rank, world_size, resume_at=3, root=None, load_world=None, **kw):
    """LayerWise ``resume_at`` steps, save (torch_dist; the DistOpt part fully reshardable), LayerWise
    on to the end (the run that never switched); a fresh DMuon run loads that checkpoint and trains
    the same steps. Returns both runs' losses, parameters and optimizer state (at the save / right
    after the load, and at the end)."""
    from megatron_dmuon.megatron.checkpoint.job import checkpoint_dir, load_checkpoint, save_checkpoint

    init_parallel()
    steps = {**DEFAULTS, **kw}["steps"]
    out = {}
    lw = _build_layerwise(**kw)
    first = _train(lw, range(resume_at))
    out["layerwise_at_save"] = layerwise_state(lw)
    save_checkpoint(root, resume_at, lw.chunks, lw.opt, extra={"scheduler": lw.sched.state_dict()})
    rest = _train(lw, range(resume_at, steps))
    out["layerwise"] = {"losses": first["losses"] + rest["losses"], "params": _params(lw),
                        "state": layerwise_state(lw)}
    run = _build(perturb=True, **kw)
    common = load_checkpoint(checkpoint_dir(root, resume_at), run.chunks, run.opt)
    run.sched.load_state_dict(common["scheduler"])
    out["dmuon_after_load"] = dmuon_state(run)
    out["dmuon_params_after_load"] = _params(run)
    rest = _train(run, range(resume_at, steps))
    _finish_overlap(run)
    out["dmuon"] = {"losses": rest["losses"], "params": _params(run), "state": dmuon_state(run)}
    return out


def _attempt_load(path, run, snapshot, same) -> tuple:
    """Load ``path`` into ``run``, expecting a refusal: (the error's type and message or None,
    whether ``snapshot()`` is unchanged)."""
    from megatron_dmuon.megatron.checkpoint.job import load_checkpoint

    before = snapshot()
    try:
        load_checkpoint(path, run.chunks, run.opt)
        message = None
    except BaseException as e:  # noqa: BLE001 - the test reads the type and message
        message = f"{type(e).__name__}: {e}"
    return message, same(before, snapshot())


def dmuon_loads_layerwise(rank, world_size, root, resume_at=3, data_dp=None, refuse_kw=None, **kw):
    """A DMuon run at this world's DP size loads ``layerwise_to_dmuon``'s checkpoint and trains on
    (the global batch defined for ``data_dp`` ranks). ``refuse_kw``: first a run of other settings
    tries the load, which must fail on every rank and leave it untouched: (message, untouched)."""
    from megatron_dmuon.megatron.checkpoint.job import checkpoint_dir, load_checkpoint

    from .checkpoint_workers import _same, _snapshot

    init_parallel()
    steps = {**DEFAULTS, **kw}["steps"]
    out = {}
    if refuse_kw is not None:
        other = _build(perturb=True, **{**kw, **refuse_kw})
        out["refused"] = _attempt_load(checkpoint_dir(root, resume_at), other, lambda: _snapshot(other), _same)
    run = _build(perturb=True, **kw)
    common = load_checkpoint(checkpoint_dir(root, resume_at), run.chunks, run.opt)
    run.sched.load_state_dict(common["scheduler"])
    out["dmuon_after_load"] = dmuon_state(run)
    rest = _train(run, range(resume_at, steps), data_dp)
    _finish_overlap(run)
    out["dmuon"] = {"losses": rest["losses"], "params": _params(run), "state": dmuon_state(run)}
    return out


def _layerwise_snapshot(run) -> list:
    """Copies of a LayerWise run's model params and fp32 masters (its optimizer state is created,
    zero, by Megatron's own load request before any check can run)."""
    layerwise, distopt = run.opt.chained_optimizers
    masters = [m for inner in layerwise.chained_optimizers for g in inner.fp32_from_float16_groups for m in g]
    masters += [m for g in distopt.shard_fp32_from_float16_groups for m in g]
    return [t.detach().clone() for t in [*run.model.parameters(), *masters]]


def dmuon_to_layerwise(rank, world_size, resume_at=3, root=None, refuse_kw=None, **kw):
    """The reverse: DMuon ``resume_at`` steps, save, DMuon on to the end (the run that never
    switched); a fresh LayerWise run loads DMuon's checkpoint and trains the same steps.
    ``refuse_kw``: first a LayerWise run of other settings tries the load, which must fail on every
    rank and leave its state untouched: (message, untouched)."""
    from megatron_dmuon.megatron.checkpoint.job import checkpoint_dir, load_checkpoint, save_checkpoint

    init_parallel()
    steps = {**DEFAULTS, **kw}["steps"]
    out = {}
    run = _build(**kw)
    first = _train(run, range(resume_at))
    _finish_overlap(run)
    out["dmuon_at_save"] = dmuon_state(run)
    save_checkpoint(root, resume_at, run.chunks, run.opt, extra={"scheduler": run.sched.state_dict()})
    rest = _train(run, range(resume_at, steps))
    _finish_overlap(run)
    out["dmuon"] = {"losses": first["losses"] + rest["losses"], "params": _params(run), "state": dmuon_state(run)}
    if refuse_kw is not None:
        other = _build_layerwise(**{**kw, **refuse_kw})
        out["refused"] = _attempt_load(checkpoint_dir(root, resume_at), other, lambda: _layerwise_snapshot(other),
                                       lambda a, b: len(a) == len(b) and all(map(torch.equal, a, b)))
    if refuse_kw is not None:  # Megatron's --optimizer adam has no Muon matrices to take the momenta
        adam = _build(mode="adam", **kw)
        out["refused_adam"] = _attempt_load(checkpoint_dir(root, resume_at), adam, lambda: _params(adam),
                                            lambda a, b: all(torch.equal(a[k], b[k]) for k in a))
    lw = _build_layerwise(**kw)
    common = load_checkpoint(checkpoint_dir(root, resume_at), lw.chunks, lw.opt)
    lw.sched.load_state_dict(common["scheduler"])
    out["layerwise_after_load"] = layerwise_state(lw)
    out["layerwise_params_after_load"] = _params(lw)
    rest = _train(lw, range(resume_at, steps))
    out["layerwise"] = {"losses": rest["losses"], "params": _params(lw), "state": layerwise_state(lw)}
    return out
