"""Functions run on each gloo rank by the multi-process tests (imported in child processes)."""
from __future__ import annotations

import torch


def init_parallel(tp=1, pp=1, ep=1, seed=1234):
    """Initialise Megatron's parallel state (once per process) and seed every RNG as Megatron does."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep)
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

    return MuonSettings(ns_dtype=getattr(torch, ns_dtype), ns_method=ns_method, coefficients=coefficients, **kw)


def _shape(**kw):
    from megatron_dmuon.megatron.gpt import GPTShape

    return GPTShape(**kw)


def _freeze(model, freeze):
    if freeze:
        for n, p in model.named_parameters():
            if freeze in n:
                p.requires_grad_(False)


def dmuon_train(rank, world_size, mode="dmuon", overlap=False, shape_kw=None, ns_dtype="float32",
                return_params=True, freeze=None, ranks_per_node=0, split=None, coefficients="keller",
                tp=1, pp=1, ep=1, muon_kw=None, blockwise=False, count_bytes=False, balance="cost",
                record_grads=False, **kw):
    """Train the tiny GPT with DMuon (or a baseline mode) on world_size = dp x tp x pp ranks
    (experts over ep); report losses, norms, NS counts, plans and every rank's parameter shards."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_dmuon.megatron.gpt import build_gpt, on_gpu, train_step, wire_sync_funcs
    from megatron_dmuon.megatron.layout import build_dmuon_ddp
    from megatron_dmuon.megatron.optimizer import DMuonConfig, comm_bytes_per_step, get_dmuon_optimizer
    from megatron_dmuon.testing.global_params import init_params_by_name, local_shards

    o = {**DEFAULTS, **kw}
    init_parallel(tp, pp, ep)
    shape = _shape(**(shape_kw or {}))
    model = build_gpt(shape)
    init_params_by_name(model)
    _freeze(model, freeze)
    dist_opt = mode == "dmuon" or mode == "adam"
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=not shape.fp64,
        overlap_grad_reduce=overlap, overlap_param_gather=overlap and dist_opt,
        bucket_size=o.get("bucket_size"),
    )
    if mode == "dmuon":
        ddp = build_dmuon_ddp(model.config, ddp_config, model, ranks_per_node=ranks_per_node, balance=balance)
    else:
        ddp = DistributedDataParallel(model.config, ddp_config, model)
    ddp.broadcast_params()
    wire_sync_funcs([ddp], ddp_config)
    opt_config = OptimizerConfig(optimizer="adam", lr=o["lr"], min_lr=o["lr"], weight_decay=o["weight_decay"],
                                 use_distributed_optimizer=dist_opt, clip_grad=o["clip_grad"],
                                 bf16=bool((shape_kw or {}).get("bf16")))
    if mode == "adam":
        from megatron.core.optimizer import get_megatron_optimizer

        opt = get_megatron_optimizer(opt_config, [ddp])
    else:
        muon = _muon_settings(ns_dtype, coefficients=coefficients, **(muon_kw or {}))
        opt = get_dmuon_optimizer(opt_config, [ddp], DMuonConfig(mode=mode, muon=muon, **_split_kwargs(split)))
    sched = OptimizerParamScheduler(
        opt, init_lr=o["lr"], max_lr=o["lr"], min_lr=o["lr"], lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="constant", start_wd=o["weight_decay"], end_wd=o["weight_decay"],
        wd_incr_steps=100, wd_incr_style="constant",
    )
    dp_rank = ps.get_data_parallel_rank()
    parts = [] if mode == "adam" else opt.chained_optimizers
    if blockwise:  # Megatron's inexact 'blockwise' TP mode, for contrast: every TP shard is its own matrix
        from megatron_dmuon.runtime.owner_step import MatrixInfo
        from megatron_dmuon.runtime.tp_exchange import TPExchange

        for part in parts:
            inner = part.dmuon_inner
            inner.tp = TPExchange(None)
            inner.matrix_info = {p: MatrixInfo(i.name, i.local_shape) for p, i in inner.matrix_info.items()}
    losses, ns_counts, grad_norms = [], [], []
    counted = {}
    recorded = _record_reduced_grads(parts, ddp) if record_grads else None
    for step in range(o["steps"]):
        micro = [synthetic_tokens(step, m, dp_rank, o["mbs"], shape.seq_length, shape.vocab_size)
                 for m in range(o["grad_accum"])]
        if count_bytes and step == o["steps"] - 1:  # the bytes the buffers really moved in one step
            from megatron_dmuon.testing.comm_counter import count_bucket_bytes

            with count_bucket_bytes([ddp]) as counts:
                loss, grad_norm, _, ok = train_step([ddp], opt, micro, shape.seq_length, o["mbs"])
            counted = dict(counts)  # (without overlap the publish runs inside optimizer.step)
        else:
            loss, grad_norm, _, ok = train_step([ddp], opt, micro, shape.seq_length, o["mbs"])
        assert ok
        sched.step(increment=1)
        losses.append(loss)
        grad_norms.append(float(grad_norm))
        if parts:  # matrices orthogonalized this step, summed over the whole world
            n = torch.tensor([sum(p.dmuon_inner.stats["ns_matrices"] for p in parts)],
                             device="cuda" if on_gpu() else "cpu")
            torch.distributed.all_reduce(n)
            ns_counts.append(int(n))
    if ddp_config.overlap_param_gather:
        ddp.disable_forward_pre_hook(param_sync=True)
    from megatron_dmuon.planning.params import is_muon_param

    out = {
        "losses": losses, "grad_norms": grad_norms, "ns_counts": ns_counts,
        "bytes": comm_bytes_per_step([ddp], "gather_then_compute" if mode == "gather_then_compute" else "dmuon"),
        "counted_bytes": counted,
        "ranks": {"dp": dp_rank, "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                  "ep": ps.get_expert_model_parallel_rank()},
    }
    if return_params:
        out["shards"] = local_shards(ddp.module)
    if recorded is not None:
        out["reduced_grads"] = recorded
    if parts:
        out["muon_states"] = sum(1 for part in parts for p in part.dmuon_inner.matrix_info
                                 if "momentum_buffer" in part.dmuon_inner.state.get(p, {}))
        out["tp_bytes"] = sum(part.dmuon_inner.stats["tp_bytes"] for part in parts)
    if mode == "dmuon":
        try:
            parts[0].sharded_state_dict({})
            out["checkpoint_error"] = None
        except NotImplementedError as e:
            out["checkpoint_error"] = str(e)
        topo = ddp.dmuon_topology
        my_shard = topo.shard_index if topo is not None else None
        plans = ddp.dmuon_owner_plans
        # momentum lives with the DP owner: every TP shard of a sharded matrix, a replicated
        # matrix on its TP owner only
        expected = 0
        for key, plan in plans.items():
            dp_me = (my_shard if (my_shard is not None and not key.is_expert_parallel)
                     else (ps.get_expert_data_parallel_rank() if key.is_expert_parallel else dp_rank))
            tp_me = ps.get_expert_tensor_parallel_rank() if key.is_expert_parallel else ps.get_tensor_model_parallel_rank()
            params = {n: p for p, n in ddp.dmuon_param_names.items()}
            for name, owner in plan.owners.items():
                sharded = getattr(params[name], "tensor_model_parallel", False) and plan.tp_size > 1
                expected += owner == dp_me and (sharded or plan.tp_owners.get(name, 0) == tp_me)
        out["owned"] = expected
        out["owners"] = {str(k): v.owners for k, v in plans.items()}
        out["layouts"] = [v.to_json() for v in plans.values()]
    return out


def _record_reduced_grads(parts, ddp):
    """Per step, this rank's pieces of the reduced gradients the optimizer steps with (DP only):
    [{global name: [(flat start, flat end, values)]}] (the replay oracle's input)."""
    from megatron_dmuon.testing.global_params import global_names

    names = global_names(ddp.module)
    local_name = {p: n for n, p in ddp.module.named_parameters()}
    steps = []
    for part in parts:
        pairs = [(m, s) for mg, sg in ((part.model_float16_groups, part.shard_fp32_from_float16_groups),
                                        (part.model_fp32_groups, part.shard_fp32_groups))
                 for gm, gs in zip(mg, sg) for m, s in zip(gm, gs)]
        inner_step = part.dmuon_inner.step

        def step(*a, _pairs=pairs, _part=part, _inner=inner_step, **k):
            if not steps or _part is parts[0]:
                steps.append({})
            for model_param, main_param in _pairs:
                r = _part._get_model_param_range_map(model_param)["param"]
                steps[-1].setdefault(names[local_name[model_param]], []).append(
                    (r.start, r.end, main_param.grad.detach().clone().view(-1)))
            return _inner(*a, **k)

        part.dmuon_inner.step = step
    return steps


def _split_kwargs(split):
    return {"split_qkv": split in ("qkv", "heads"), "split_per_head": split == "heads", "split_glu": split == "glu"}


RUN_ONLY = ("tp", "pp", "ep", "overlap", "bucket_size", "mode", "return_params", "balance", "count_bytes",
            "blockwise")  # shape the run, not the math


def reference(rank, world_size, dp, shape_kw=None, ns_dtype="float32", layouts=None, freeze=None,
              ranks_per_node=0, split=None, coefficients="keller", muon_kw=None, rules="project",
              replay_grads=None, **kw):
    """The single-process TP=PP=EP=1 reference for a run with `dp` data-parallel ranks (world_size
    must be 1). Returns losses, grad norms, full params by global name and the matrix count."""
    from megatron_dmuon.megatron.gpt import build_gpt
    from megatron_dmuon.planning.params import is_muon_param
    from megatron_dmuon.testing.global_params import init_params_by_name
    from megatron_dmuon.testing.reference import reference_train

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

    chunks = None
    if layouts is not None:
        shapes = {n: p.shape for n, p in model.named_parameters()}
        chunks = reduce_chunks_from_layout([OwnerLayout.from_json(j) for j in layouts], shapes)
    out = reference_train(model, batches, o["steps"], lr=o["lr"], weight_decay=o["weight_decay"],
                          clip_grad=o["clip_grad"],
                          muon_settings=_muon_settings(ns_dtype, coefficients=coefficients, **(muon_kw or {})),
                          reduce_chunk_of=chunks, ranks_per_node=ranks_per_node,
                          split_rule_for=_split_rule_for(model.config, split), rules=rules,
                          replay_grads=replay_grads)
    out["num_matrices"] = sum(is_muon_param(n, p) for n, p in model.named_parameters() if p.requires_grad)
    return out


def _split_rule_for(model_config, split):
    if split is None:
        return None
    from megatron_dmuon.algorithms.splitting import rule_for_megatron_param

    k = _split_kwargs(split)
    return lambda name, shape: rule_for_megatron_param(name, shape, model_config, split_qkv=k["split_qkv"],
                                                       per_head=k["split_per_head"], split_glu=k["split_glu"])
