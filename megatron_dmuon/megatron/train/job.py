"""The main job's ``main``: check the flags, set up the processes, build model, DDP, optimizer and
scheduler as Megatron-LM's hook does, train (loop.py), report (summary.py).

``main`` runs wherever torch.distributed can start: NCCL on CUDA GPUs; on CPUs (gloo) only after
megatron_dmuon.testing.cpu_shim is installed, which ``python -m megatron_dmuon.testing.cpu_train``
does. ``python -m megatron_dmuon.megatron.train`` (``dmuon-train``) is the GPU entry.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os

import torch

from megatron_dmuon.logs import log_to

from ...planning.overlap_mode import OverlapMode
from ...runtime.overlapped_step import model_priority_stream
from .args import parse_args
from .checkpoints import hold_save_lock
from .checks import schedule_of
from .run_errors import job_error
from .data import TokenSource, token_source
from .loop import train
from .summary import print_start_line, report


@dataclasses.dataclass
class Job:
    """One process's share of the run: the flags, its place in the process groups, what it trains."""

    args: argparse.Namespace
    rank: int
    world: int
    backend: str
    dp_size: int
    dp_rank: int
    grad_accum: int
    shape: object  # megatron_dmuon.megatron.gpt.GPTShape
    model: torch.nn.Module
    ddp: torch.nn.Module
    opt: object  # Megatron's (chained) optimizer
    sched: object  # OptimizerParamScheduler
    data: TokenSource


def main(argv=None) -> None:
    from ..child_processes import die_with_torchrun

    die_with_torchrun()  # a SIGKILLed torchrun takes this rank with it (it cannot signal it any more)
    args = parse_args(argv)
    if args.parse_only:
        if os.environ.get("RANK", "0") == "0":
            print("> arguments checked", flush=True)
        return
    log_to()  # the package's log lines (the NS check's report) on stdout, as Megatron-LM's logging shows them
    rank, world, backend = setup_distributed()
    hold_save_lock(args, rank)
    job = build(args, rank, world, backend)
    print_start_line(job)
    overlapped = args.optimizer == "dmuon" and OverlapMode(args.dmuon_overlap_step).overlaps
    with model_priority_stream(overlapped):  # the overlapped step's NS fills what the model leaves of the GPU
        run = train(job)
    problem = [report(job, run)]  # rank 0's: an unwritable --timing-json
    torch.distributed.broadcast_object_list(problem, src=0)
    if problem[0]:
        job_error(problem[0], 1)
    if run.timings and not (run.last_ok and math.isfinite(run.last_loss)):
        what = "its update was skipped (non-finite gradients)" if not run.last_ok else \
            f"its loss is {run.last_loss}"
        job_error(f"the run did not train to its end: at iteration {run.timings[-1]['iteration']}, the last, {what}; "
                  f"{run.skipped} of {len(run.timings)} iterations were skipped. Lower --lr, keep --clip-grad on, or "
                  "check the data", 1)
    torch.distributed.destroy_process_group()


def setup_distributed():
    """(rank, world size, backend): NCCL on the GPU of LOCAL_RANK, else gloo."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(world, 1)))
        backend = "gloo"
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    else:  # under torchrun: a restarted attempt must not read the previous attempt's keys (gloo
        # addresses of dead ranks) from torchrun's store, which outlives the workers
        from torch.distributed.rendezvous import rendezvous

        store, rank, world = next(rendezvous("env://"))
        store = torch.distributed.PrefixStore(f"dmuon_attempt_{attempt}", store)
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world)
    return rank, world, backend


def build(args, rank, world, backend) -> Job:
    """Model parallel groups, seeds, the GPT, DDP (DMuon's layout where DMuon runs), the optimizer
    and Megatron's scheduler, built from the flags as Megatron-LM's hook builds them."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dmuon.megatron.config import config_from_args
    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, wire_sync_funcs
    from megatron_dmuon.megatron.megatron_lm import ddp_class_for, optimizer_factory_for

    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                             num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    torch.manual_seed(args.seed)  # CPU-side init (use_cpu_initialization), as Megatron's _set_random_seed
    model_parallel_cuda_manual_seed(args.seed)
    if args.global_batch_size % (args.micro_batch_size * dp_size):
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"--micro-batch-size x DP = {args.micro_batch_size * dp_size}")
    shape = GPTShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                     ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size,
                     seq_length=args.seq_length, bf16=args.bf16, transformer_impl=args.transformer_impl,
                     fp8=args.fp8_format, fp8_recipe=args.fp8_recipe, fp8_param=args.fp8_param_gather,
                     gradient_accumulation_fusion=args.gradient_accumulation_fusion)
    model = build_gpt(shape)
    # the same construction Megatron-LM's hook wires: DDP class and optimizer factory from the flags
    ddp_config = config_from_args(DistributedDataParallelConfig, args, grad_reduce_in_fp32=True)
    ddp_config.overlap_param_gather = args.overlap_param_gather and args.use_distributed_optimizer
    ddp = (ddp_class_for(args) or DistributedDataParallel)(config=model.config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()
    wire_sync_funcs([ddp], ddp_config)
    # (the AdamW baseline is megatron-core's Adam: Transformer Engine's FusedAdam where TE imports)
    opt_config = config_from_args(OptimizerConfig, args,
                                  params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                  fp8_recipe=args.fp8_recipe if args.fp8_format else None)
    opt = optimizer_factory_for(args, get_megatron_optimizer)(opt_config, [ddp])
    sched = OptimizerParamScheduler(  # a resume's other schedule needs one of the two flags (checks.py)
        opt, init_lr=0.0, **schedule_of(args), override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler)
    return Job(args=args, rank=rank, world=world, backend=backend, dp_size=dp_size, dp_rank=dp_rank,
               grad_accum=args.global_batch_size // (args.micro_batch_size * dp_size), shape=shape, model=model,
               ddp=ddp, opt=opt, sched=sched, data=token_source(args))
