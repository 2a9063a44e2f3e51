"""Functions run on each gloo rank by the multi-process tests (imported in child processes)."""
from __future__ import annotations

from typing import List, Optional

import torch


def virtual_stages() -> List[Optional[int]]:
    """The vp_stage of every model chunk this rank builds: [None] without the interleaved
    schedule, else 0 .. VPP-1 (Megatron-LM's get_model builds one chunk per virtual stage)."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else None
    return [None] if vpp is None else list(range(vpp))


def init_parallel(tp=1, pp=1, ep=1, vpp=None, seed=1234, instances=1):
    """Initialise Megatron's parallel state (once per process) and seed every RNG as Megatron does.
    ``vpp``: virtual stages per pipeline rank (Megatron's interleaved 1F1B schedule); ``instances``:
    distributed-optimizer instances (--num-distributed-optimizer-instances)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep,
                                                 virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
                                                 num_distributed_optimizer_instances=instances)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def synthetic_tokens(step, micro, global_rank_offset, mbs, seq, vocab, seed=0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro * 31 + global_rank_offset)
    return torch.randint(0, vocab, (mbs, seq + 1), generator=g)


def megatron_adam_dp(rank, world_size, steps=6, grad_accum=2, mbs=2):
    """Tiny GPT + megatron-core DDP(use_distributed_optimizer) + DistributedOptimizer(Adam)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, train_step, wire_sync_funcs

    init_parallel()
    shape = GPTShape()
    model = build_gpt(shape)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    ddp.broadcast_params()
    wire_sync_funcs([ddp], ddp_config)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.01, use_distributed_optimizer=True, clip_grad=1.0),
        [ddp],
    )
    losses = []
    for step in range(steps):
        mbs_list = [synthetic_tokens(0, m, rank, mbs, shape.seq_length, shape.vocab_size) for m in range(grad_accum)]
        loss, grad_norm, _, ok = train_step([ddp], opt, mbs_list, shape.seq_length, mbs)
        losses.append(loss)
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return {"losses": losses, "params": params}


# ---------------------------------------------------------------- DMuon vs single-process reference
DEFAULTS = dict(lr=2e-2, weight_decay=0.1, clip_grad=0.0, steps=10, grad_accum=2, mbs=2)


def _muon_settings(ns_dtype="float32", ns_method="standard", coefficients="keller", **kw):
    from megatron_dmuon.runtime.owner_step import MuonSettings

    if isinstance(kw.get("momentum_dtype"), str):
        kw["momentum_dtype"] = getattr(torch, kw["momentum_dtype"])

    return MuonSettings.torch_muon(ns_dtype=getattr(torch, ns_dtype), ns_method=ns_method, coefficients=coefficients,
                                   **kw)


def _shape(**kw):
    from megatron_dmuon.megatron.gpt import GPTShape

    return GPTShape(**kw)


def _freeze(model, freeze):
    if freeze:
        for n, p in model.named_parameters():
            if freeze in n:
                p.requires_grad_(False)


def expected_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, vp_stage: int):
    """0-based global layers of virtual stage ``vp_stage`` on pipeline rank ``pp_rank`` under
    Megatron's interleaved assignment (stated here, not asked of Megatron: model chunk v of rank p
    holds the (v x pp + p)-th of pp x vpp equal runs of layers)."""
    per_chunk = num_layers // (pp * vpp)
    first = (vp_stage * pp + pp_rank) * per_chunk
    return list(range(first, first + per_chunk))


def _check_layer_assignment(chunks, shape) -> None:
    from megatron.core import parallel_state as ps

    vpp = len(chunks)
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    for v, model in enumerate(chunks):
        got = [layer.layer_number - 1 for layer in model.decoder.layers]
        want = expected_layers(shape.num_layers, pp, vpp, pp_rank, v) if vpp > 1 else got
        if got != want:
            raise AssertionError(f"PP rank {pp_rank} chunk {v} holds layers {got}, the interleaved schedule's {want}")


def _build(mode="dmuon", overlap=False, shape_kw=None, ns_dtype="float32", freeze=None, ranks_per_node=0,
           split=None, coefficients="keller", muon_kw=None, blockwise=False, perturb=False, balance="cost",
           grad_reduce_in_fp32=None, publish_dtype="param", optimizer_publish=None, megabatch=False,
           fold_clipping=True, align_param_gather=False, config_kw=None, dp_layout="auto", instances=1,
           shared_ns=False, **kw):
    """Model chunks, DDPs, optimizer and scheduler of one run (parallel state already initialized):
    one chunk, or under the interleaved schedule one per virtual stage, each in its own DDP (as
    Megatron-LM's get_model: bucketing off for every chunk but the first).
    ``perturb``: scale the weights (a 'fresh' model that differs from the saved one).
    ``align_param_gather``: under --overlap-param-gather the schedule starts each chunk's param
    all-gather (config.param_sync_func), as Megatron-LM sets it for the interleaved schedule.
    ``config_kw``: TransformerConfig fields on top of the shape's (e.g. qk_clip=True)."""
    from types import SimpleNamespace

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_dmuon.megatron.gpt import build_gpt, transformer_config, wire_sync_funcs
    from megatron_dmuon.megatron.ddp import build_dmuon_ddp
    from megatron_dmuon.megatron.config import LayoutOptions
    from megatron_dmuon.megatron.optimizer import DMuonConfig, get_dmuon_optimizer
    from megatron_dmuon.testing.global_params import init_params_by_name

    o = {**DEFAULTS, **kw}
    shape = _shape(**(shape_kw or {}))
    model_config = transformer_config(shape, **(config_kw or {}))  # one config for every chunk (the schedule reads chunk 0's)
    models = [build_gpt(shape, model_config, vp_stage=v) for v in virtual_stages()]
    _check_layer_assignment(models, shape)
    for model in models:
        init_params_by_name(model)
        if perturb:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5).add_(0.01)
        _freeze(model, freeze)
    dist_opt = mode == "dmuon" or mode == "adam"
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt,
        grad_reduce_in_fp32=not shape.fp64 if grad_reduce_in_fp32 is None else grad_reduce_in_fp32,
        overlap_grad_reduce=overlap, overlap_param_gather=overlap and dist_opt,
        align_param_gather=align_param_gather, bucket_size=o.get("bucket_size"),
        fp8_param_gather=shape.fp8_param,  # (Megatron-LM sets it from --fp8-param-gather)
        num_distributed_optimizer_instances=instances,
    )
    if mode != "adam":  # one DMuonConfig for the DDP's plan and the optimizer (as a run parses it once)
        cfg = DMuonConfig(mode=mode, muon=_muon_settings(ns_dtype, coefficients=coefficients, **(muon_kw or {})),
                          publish_dtype=optimizer_publish or publish_dtype, fold_clipping=fold_clipping,
                          layout=LayoutOptions(ranks_per_node=ranks_per_node, balance=balance, megabatch=megabatch,
                                               dp_layout=dp_layout, ns_teams="auto" if shared_ns else "off"),
                          **_split_kwargs(split))
    chunks = []
    for i, model in enumerate(models):
        if mode == "dmuon":
            ddp = build_dmuon_ddp(model_config, ddp_config, model, disable_bucketing=i > 0, dmuon=cfg,
                                  publish_dtype=publish_dtype)
        else:
            ddp = DistributedDataParallel(model_config, ddp_config, model, disable_bucketing=i > 0)
        ddp.broadcast_params()
        chunks.append(ddp)
    wire_sync_funcs(chunks, ddp_config)
    opt_config = OptimizerConfig(optimizer="adam", lr=o["lr"], min_lr=o["lr"], weight_decay=o["weight_decay"],
                                 use_distributed_optimizer=dist_opt, clip_grad=o["clip_grad"],
                                 bf16=bool((shape_kw or {}).get("bf16")),
                                 fp8_recipe=shape.fp8_recipe if shape.fp8 else None)
    if mode == "adam":
        from megatron.core.optimizer import get_megatron_optimizer

        opt = get_megatron_optimizer(opt_config, chunks)
    else:
        opt = get_dmuon_optimizer(opt_config, chunks, cfg)
    sched = OptimizerParamScheduler(
        opt, init_lr=o["lr"], max_lr=o["lr"], min_lr=o["lr"], lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="constant", start_wd=o["weight_decay"], end_wd=o["weight_decay"],
        wd_incr_steps=100, wd_incr_style="constant",
    )
    parts = [] if mode == "adam" else opt.chained_optimizers
    if blockwise:  # Megatron's inexact 'blockwise' TP mode, for contrast: every TP shard is its own matrix
        from megatron_dmuon.runtime.owner_step import MatrixInfo, with_ns_choices
        from megatron_dmuon.runtime.tp_exchange import TPExchange

        for part in parts:
            inner = part.optimizer
            inner.tp = TPExchange(None)
            shards = [MatrixInfo(i.name, i.local_shape) for i in inner.matrix_info.values()]
            device = next(iter(inner.matrix_info)).device if shards else "cpu"
            inner.matrix_info = dict(zip(inner.matrix_info, with_ns_choices(shards, inner.muon, device)))
    # ``ddp``/``model``: the one chunk of a run without virtual stages (None with several)
    one = len(chunks) == 1
    return SimpleNamespace(chunks=chunks, ddp=chunks[0] if one else None, model=models[0] if one else None,
                           ddp_config=ddp_config, opt=opt, sched=sched, parts=parts, shape=shape, mode=mode, o=o)


def _micro_batches(run, step, data_dp=None, nan=False):
    """This rank's micro-batches of a step. The global batch is data_dp x grad_accum micro-batches
    (data_dp: the DP size the data stream is defined for, default this run's): every DP rank takes a
    contiguous share, so runs at other DP sizes (resharded resumes) see the same global batch."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    data_dp = data_dp or dp
    ga, mbs, shape = run.o["grad_accum"], run.o["mbs"], run.shape
    total = data_dp * ga
    if total % dp:
        raise ValueError(f"the global batch of {total} micro-batches does not split over DP={dp}")
    share = total // dp
    return [synthetic_tokens(step, i % ga, i // ga, mbs, shape.seq_length, shape.vocab_size)
            for i in range(dp_rank * share, (dp_rank + 1) * share)]


def _train(run, steps, data_dp=None, count_bytes_at=None, nan_at=None, skip_steps=(), ns_counts=None,
           after_step=None):
    """Train ``steps`` (an iterable of step numbers). ``nan_at=(step, rank)``: that rank's gradient
    of one matrix is NaN at that step; ``skip_steps``: steps whose batch is never seen;
    ``after_step(step)``: called right after each optimizer step (where Megatron-LM runs its QK-clip)."""
    from megatron_dmuon.megatron.gpt import on_gpu, train_step

    losses, grad_norms, updated, counted, local_ns = [], [], [], {}, []
    for step in steps:
        if step in skip_steps:
            continue
        micro = _micro_batches(run, step, data_dp)
        hook = None
        if nan_at is not None and step == nan_at[0] and torch.distributed.get_rank() == nan_at[1]:
            hook = _nan_grad_hook(run)
        if step == count_bytes_at:  # the bytes the buffers really moved in one step
            from megatron_dmuon.testing.comm_counter import count_bucket_bytes

            with count_bucket_bytes(run.chunks) as counts:
                loss, grad_norm, _, ok = train_step(run.chunks, run.opt, micro, run.shape.seq_length, run.o["mbs"])
            counted = dict(counts)  # (without overlap the publish runs inside optimizer.step)
        else:
            loss, grad_norm, _, ok = train_step(run.chunks, run.opt, micro, run.shape.seq_length, run.o["mbs"])
        if hook is not None:
            hook.remove()
        if after_step is not None:
            after_step(step)
        if ok:
            run.sched.step(increment=1)
        losses.append(loss)
        grad_norms.append(float(grad_norm) if grad_norm is not None else None)
        updated.append(bool(ok))
        if run.parts and ns_counts is not None:  # matrices orthogonalized this step: this rank's, the world's
            mine = sum(p.optimizer.stats["ns_matrices"] for p in run.parts) if ok else 0
            n = torch.tensor([mine], device="cuda" if on_gpu() else "cpu")
            torch.distributed.all_reduce(n)
            ns_counts.append(int(n))
            local_ns.append(mine)
    return {"losses": losses, "grad_norms": grad_norms, "updated": updated, "counted_bytes": counted,
            "local_ns_counts": local_ns}


def _nan_grad_hook(run):
    """A hook that makes one matrix's gradient NaN (the first linear_fc2). Under fused wgrad accumulation
    (TE writes the wgrad straight into main_grad, no .grad hook runs) the layer's output gradient is made
    NaN instead, which its wgrad and everything below inherit."""
    name, target = next((n, p) for c in run.chunks for n, p in c.module.named_parameters()
                        if n.endswith("linear_fc2.weight"))
    if not run.chunks[0].module.config.gradient_accumulation_fusion:
        return target.register_hook(lambda g: torch.full_like(g, float("nan")))
    module = next(m for c in run.chunks for n, m in c.module.named_modules() if n + ".weight" == name)
    return module.register_full_backward_pre_hook(
        lambda m, grad_output: tuple(None if g is None else torch.full_like(g, float("nan")) for g in grad_output))


def _finish_overlap(run):
    if run.ddp_config.overlap_param_gather:  # the last publish is still pending in the forward hooks
        for chunk in run.chunks:
            chunk.disable_forward_pre_hook(param_sync=True)


def _global_names(run) -> dict:
    """{model param: its global name} over every chunk of the run."""
    from megatron_dmuon.testing.global_params import global_names

    out = {}
    for chunk in run.chunks:
        names = global_names(chunk.module)
        out.update({p: names[n] for n, p in chunk.module.named_parameters()})
    return out


def optimizer_state_shards(run) -> dict:
    """{global name: {'numel', 'start', 'end', 'tp_rank', 'tp_size', 'partition_dim', 'stride',
    'state': {key: 1-D tensor}}} of this rank's optimizer pieces (fp32 master 'param', momentum or
    AdamW moments, and 'step'); a TP-replicated matrix's momentum only from its TP owner."""
    from megatron_dmuon.megatron.checkpoint import local_pieces
    from megatron_dmuon.testing.global_params import _tp_of

    names = _global_names(run)
    out = {}
    for part in run.parts:
        for piece in local_pieces(part):
            p = piece.model_param
            state = {k: t.detach().double().cpu().clone() for k, t in piece.tensors.items()
                     if k != "momentum_buffer" or piece.holds_momentum}
            main = piece.tensors["param"]
            if not piece.muon:
                state["step"] = part.optimizer.state[main]["step"].detach().double().reshape(1).cpu().clone()
            tp_size, tp_rank = _tp_of(p)
            out.setdefault(names[p], []).append({
                "numel": p.numel(), "start": piece.start, "end": piece.end, "shape": tuple(p.shape),
                "tp_rank": tp_rank, "tp_size": tp_size, "partition_dim": getattr(p, "partition_dim", 0),
                "stride": getattr(p, "partition_stride", 1), "state": state})
    return out


def _report(run, rank, trained, ns_counts, return_params=True):
    from megatron.core import parallel_state as ps

    from megatron_dmuon.megatron.modes import MODE_TRAITS
    from megatron_dmuon.megatron.optimizer import comm_bytes_per_step
    from megatron_dmuon.testing.global_params import local_shards

    # (the rank inside this distributed-optimizer instance: what the plans' owners count)
    chunks, parts, dp_rank = run.chunks, run.parts, ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True)
    out = {
        **trained, "ns_counts": ns_counts,
        # (mode 'adam': Megatron's DistributedOptimizer, reduce-scattered)
        "bytes": comm_bytes_per_step(chunks, all_reduce=run.mode in MODE_TRAITS and MODE_TRAITS[run.mode].all_reduces),
        "ranks": {"dp": dp_rank, "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                  "ep": ps.get_expert_model_parallel_rank()},
    }
    if return_params:
        out["shards"] = {name: s for chunk in chunks for name, s in local_shards(chunk.module).items()}
    if parts:
        out["muon_states"] = sum(1 for part in parts for p in part.optimizer.matrix_info
                                 if part.optimizer.holds_momentum(part.optimizer.matrix_info[p]))
        out["tp_bytes"] = sum(part.optimizer.stats["tp_bytes"] for part in parts)
        out["dp_bytes"] = sum(part.optimizer.stats["dp_bytes"] for part in parts)
        out["row_variance_states"] = sum("row_variance" in part.optimizer.state.get(p, {}) for part in parts
                                         for p in part.optimizer.matrix_info)
        out["skipped_iterations"] = run.opt.dmuon_stats()["skipped_iterations"]
        from megatron_dmuon.megatron.memory import megatron_adamw_state_bytes, optimizer_state_bytes

        out["state_bytes"] = optimizer_state_bytes(run.opt)
        out["adamw_state_bytes"] = megatron_adamw_state_bytes(chunks, ps.get_data_parallel_world_size())
    if run.mode == "dmuon":
        out["optimizer_state"] = optimizer_state_shards(run)
        out.update(_ownership(run, dp_rank))
    return out


def _ownership(run, dp_rank) -> dict:
    """What the chunks' plans give this rank: 'owned' (Muon momenta it holds: the DP owner holds
    every TP shard of a sharded matrix, a replicated matrix's TP owner alone), 'ns_owned' (global
    names of the matrices it orthogonalizes: DP and TP owner), owners per chunk, and the owner
    layouts with every param under its global name (the reference reproduces their reduce order)."""
    import dataclasses

    from megatron.core import parallel_state as ps

    out = {"owned": 0, "ns_owned": [], "owners": {}, "layouts": []}
    names = _global_names(run)
    for i, chunk in enumerate(run.chunks):
        topo = chunk.node_topology
        my_shard = topo.shard_index if topo is not None else None
        plan = chunk.dmuon_plan
        param_of = chunk.param_names()
        by_name = {n: p for p, n in param_of.items()}
        for r in plan.matrices():
            dp_me = (my_shard if (my_shard is not None and not r.expert)
                     else (ps.get_expert_data_parallel_rank(partial_expert_data_parallel=True) if r.expert else dp_rank))
            tp_me = ps.get_expert_tensor_parallel_rank() if r.expert else ps.get_tensor_model_parallel_rank()
            sharded = r.partition_dim is not None
            layout = plan.layouts[r.buffer]  # split layout: every holder of a piece keeps its momentum
            holds = (any(rank == dp_me for rank, _, _ in layout.pieces(r.name)) if layout.scheme == "split"
                     else r.dp_owner == dp_me)
            out["owned"] += holds and (sharded or r.tp_owner == tp_me)
            if r.dp_owner == dp_me and r.tp_owner == tp_me:
                out["ns_owned"].append(names[by_name[r.name]])
        prefix = "" if len(run.chunks) == 1 else f"chunk{i}/"
        out["owners"].update({prefix + k: v.owners for k, v in plan.layouts.items()})
        out["layouts"] += [dataclasses.replace(v, param_ranges={names[by_name[n]]: r for n, r in v.param_ranges.items()})
                           .to_json() for v in plan.layouts.values()]
    return out


def dmuon_train(rank, world_size, narrow_directions=None, typed_ns=False, **kw):
    """``_dmuon_train`` with the split layout's way back set: ``narrow_directions`` is
    OwnerMuonAdamW.narrow_directions; ``typed_ns``: the NS returns its compute dtype, as the CUDA path
    does (the CPU path returns the input's dtype). Both undone after (a forked rank runs other tests)."""
    from megatron_dmuon.runtime import owner_step

    run_ns = owner_step.run_ns
    owner_step.OwnerMuonAdamW.narrow_directions = narrow_directions
    if typed_ns:
        owner_step.run_ns = lambda stack, choice: run_ns(stack, choice).to(choice.compute_dtype)
    try:
        return _dmuon_train(rank, **kw)
    finally:
        owner_step.OwnerMuonAdamW.narrow_directions, owner_step.run_ns = None, run_ns


def _dmuon_train(rank, tp=1, pp=1, ep=1, vpp=None, return_params=True, count_bytes=False, nan_at=None,
                 skip_steps=(), data_dp=None, record_grads=False, instances=1, **kw):
    """Train the tiny GPT with DMuon (or a baseline mode) on world_size = dp x tp x pp ranks
    (experts over ep; vpp virtual stages per pipeline rank; ``instances`` distributed-optimizer
    instances); report losses, norms, NS counts, plans, every rank's parameter shards and optimizer
    state pieces."""
    init_parallel(tp, pp, ep, vpp, instances=instances)
    run = _build(instances=instances, **kw)
    steps = run.o["steps"]
    ns_counts = []
    recorded = _record_reduced_grads(run) if record_grads else None
    trained = _train(run, range(steps), data_dp, steps - 1 if count_bytes else None, nan_at, skip_steps, ns_counts)
    _finish_overlap(run)
    out = _report(run, rank, trained, ns_counts, return_params)
    if recorded is not None:
        out["reduced_grads"] = recorded
    return out


def collective_calls(rank, world_size, layer_counts=(2, 4), configs=None, steps=3, **kw):
    """torch.distributed calls in one steady-state training step (the middle one of ``steps``)
    for every (layer count, config): {config name: {layers: {'calls': {fn: n}, 'buckets': n}}}.
    ``configs``: {name: _build kwargs}; default the bucketed overlap path vs megabatch."""
    from megatron_dmuon.testing.comm_counter import count_collective_calls

    init_parallel()
    configs = configs or {"bucketed": dict(overlap=True, bucket_size=20000),
                          "megabatch": dict(overlap=True, bucket_size=20000, megabatch=True)}
    out = {}
    for name, config in configs.items():
        for layers in layer_counts:
            run = _build(**{**kw, **config, "shape_kw": {**kw.get("shape_kw", {}), "num_layers": layers}})
            _train(run, range(steps // 2))
            with count_collective_calls() as calls:
                _train(run, [steps // 2])
            _train(run, range(steps // 2 + 1, steps))
            _finish_overlap(run)
            out.setdefault(name, {})[layers] = {"calls": dict(calls),
                                                "buckets": sum(len(b.buckets) for b in run.ddp.buffers)}
    return out


def _record_reduced_grads(run):
    """Per step, this rank's pieces of the reduced gradients the optimizer steps with (DP only):
    [{global name: [(flat start, flat end, values)]}] (the replay oracle's input)."""
    parts, names = run.parts, _global_names(run)
    steps = []
    for part in parts:
        pairs = [(m, s) for mg, sg in ((part.model_float16_groups, part.shard_fp32_from_float16_groups),
                                        (part.model_fp32_groups, part.shard_fp32_groups))
                 for gm, gs in zip(mg, sg) for m, s in zip(gm, gs)]
        inner_step = part.optimizer.step

        def step(*a, _pairs=pairs, _part=part, _inner=inner_step, **k):
            if not steps or _part is parts[0]:
                steps.append({})
            for model_param, main_param in _pairs:
                r = _part._get_model_param_range_map(model_param)["param"]
                steps[-1].setdefault(names[model_param], []).append(
                    (r.start, r.end, main_param.grad.detach().clone().view(-1)))
            return _inner(*a, **k)

        part.optimizer.step = step
    return steps


def _split_kwargs(split):
    return {"split_qkv": split in ("qkv", "heads"), "split_per_head": split == "heads", "split_glu": split == "glu"}


RUN_ONLY = ("tp", "pp", "ep", "vpp", "align_param_gather", "overlap", "bucket_size", "mode", "return_params", "balance", "count_bytes", "megabatch",
            "blockwise", "nan_at", "data_dp", "grad_reduce_in_fp32", "publish_dtype")  # shape the run, not the math


def reference(rank, world_size, dp, shape_kw=None, ns_dtype="float32", layouts=None, freeze=None,
              ranks_per_node=0, split=None, coefficients="keller", muon_kw=None, rules="project",
              replay_grads=None, qk_clip=None, **kw):
    """The single-process TP=PP=EP=1 reference for a run with `dp` data-parallel ranks (world_size
    must be 1). Returns losses, grad norms, full params by global name and the matrix count.
    ``qk_clip``: {'threshold', 'alpha'}: after each step the reference's own QK-clip
    (testing/qk_clip_reference.py) with the max logits the distributed run's ranks were given."""
    from megatron_dmuon.megatron.gpt import build_gpt
    from megatron_dmuon.testing.global_params import init_params_by_name
    from megatron_dmuon.testing.reference import is_muon_param, reference_train

    assert world_size == 1
    o = {**DEFAULTS, **{k: v for k, v in kw.items() if k not in RUN_ONLY}}
    init_parallel()
    shape = _shape(**{k: v for k, v in (shape_kw or {}).items() if k != "bf16"})
    model = build_gpt(shape)
    init_params_by_name(model)
    _freeze(model, freeze)

    def batches(step):
        return [[synthetic_tokens(step, m, r, o["mbs"], shape.seq_length, shape.vocab_size)
                 for m in range(o["grad_accum"])] for r in range(dp)]

    from megatron_dmuon.planning.owner_layout import OwnerLayout
    from megatron_dmuon.testing.reference import reduce_chunks_from_layout

    after_step = None
    if qk_clip is not None:
        from megatron_dmuon.testing.qk_clip_reference import reference_qk_clip_step

        after_step = reference_qk_clip_step(model.config, dp, **qk_clip)
    chunks = None
    if layouts is not None:
        shapes = {n: p.shape for n, p in model.named_parameters()}
        chunks = reduce_chunks_from_layout([OwnerLayout.from_json(j) for j in layouts], shapes)
    out = reference_train(model, batches, o["steps"], lr=o["lr"], weight_decay=o["weight_decay"],
                          clip_grad=o["clip_grad"],
                          muon_settings=_muon_settings(ns_dtype, coefficients=coefficients, **(muon_kw or {})),
                          reduce_chunk_of=chunks, ranks_per_node=ranks_per_node,
                          split_rule_for=_split_rule_for(model.config, split), rules=rules,
                          replay_grads=replay_grads, after_step=after_step)
    out["num_matrices"] = sum(is_muon_param(n, p) for n, p in model.named_parameters() if p.requires_grad)
    return out


def _split_rule_for(model_config, split):
    if split is None:
        return None
    from megatron_dmuon.algorithms.splitting import rule_for_megatron_param

    k = _split_kwargs(split)
    return lambda name, shape: rule_for_megatron_param(name, shape, model_config, split_qkv=k["split_qkv"],
                                                       per_head=k["split_per_head"], split_glu=k["split_glu"])
