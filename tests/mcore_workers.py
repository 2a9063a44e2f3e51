"""Functions run on each gloo rank by the multi-process tests (imported in child processes)."""
from __future__ import annotations

import torch


def init_parallel(tp=1, pp=1, seed=1234):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tp, pp)
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
