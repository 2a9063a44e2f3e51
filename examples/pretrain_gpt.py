"""Pretrain a megatron-core GPT with DMuon (or Megatron's AdamW) — the project's main job.

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --optimizer dmuon        # 2 CPU ranks (gloo)
    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --optimizer dmuon --bf16 # all GPUs (NCCL)

Data: byte-level tokens of the Python standard library's source (on every machine), or a Megatron
indexed dataset with --data-path PREFIX (the .bin/.idx pair); the last 5% held out (--split) for the
validation loss. Prints Megatron-style progress lines. Every flag, the data, the paths and a memory
bound are checked before anything is built (examples/job_checks.py; --parse-only stops there).

Checkpoints as Megatron-LM's: --save DIR --save-interval N writes DIR/iter_NNNNNNN (torch_dist:
model, DMuon's per-parameter optimizer state, scheduler) and DIR/latest_checkpointed_iteration.txt;
--load DIR resumes from the latest one (and starts fresh if DIR holds none, so one command line
serves a first run and its restarts under `torchrun --max-restarts`). One run writes a --save
directory at a time (a lock file in it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.job_checks import JobArgumentParser, SaveLock, token_source, validate_args  # noqa: E402

# The main job's Muon settings (what the launch recipes use): momentum 0.95 with Nesterov, and
# Megatron's 'spectral' scale sqrt(max(rows, cols)) times 0.2, which gives a Muon update the RMS of
# an AdamW one (Moonlight), so one --lr serves the Muon matrices and the AdamW params alike.
# bench/quality.py measured them (docs/quality.md). The library's DMuonConfig() and the
# Megatron-LM hook keep Megatron's own defaults (0.9, no Nesterov, extra scale 1).
# --lr when none is given: each optimizer at its best lr of bench/quality.py's sweeps on the GPU
# models (6 x 512 at 800 iterations and 12 x 768: DMuon 3e-3 on both; AdamW 1e-3 and 3e-4;
# docs/quality.md). This job's tiny default model would take more (1.2e-2), larger models less.
DEFAULT_LR = {"dmuon": 3e-3, "adam": 1e-3}
MAIN_JOB_MUON_DEFAULTS = dict(muon_momentum=0.95, muon_nesterov=True, muon_scale_mode="spectral",
                              muon_extra_scale_factor=0.2)


def parse_args(argv=None):
    from megatron_dmuon.megatron.config import add_dmuon_args
    from megatron_dmuon.megatron.gpt import FP8_FORMATS, FP8_RECIPES, TRANSFORMER_IMPLS

    p = JobArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--optimizer", default="dmuon", choices=["dmuon", "adam"])
    add_dmuon_args(p, validate=False)  # Megatron's --muon-* flags and DMuon's --dmuon-* flags (checked below)
    p.set_defaults(**MAIN_JOB_MUON_DEFAULTS)
    a("--muon-no-nesterov", dest="muon_nesterov", action="store_false",
      help="plain momentum (Megatron's default; this job's default is Nesterov)")
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=128)
    a("--ffn-hidden-size", type=int, default=352)
    a("--num-attention-heads", type=int, default=4)
    a("--num-query-groups", type=int, default=2)
    a("--seq-length", type=int, default=128)
    a("--vocab-size", type=int, default=256, help="256 for the byte-level default data")
    a("--micro-batch-size", type=int, default=4)
    a("--global-batch-size", type=int, default=16)
    a("--train-iters", type=int, default=60)
    a("--lr", type=float, default=None,
      help=f"peak lr (default: each optimizer's best of bench/quality.py's sweeps: {DEFAULT_LR})")
    a("--min-lr", type=float, default=None, help="final lr of the cosine decay (default: --lr / 10)")
    a("--lr-warmup-iters", type=int, default=5)
    a("--decoupled-lr", type=float, default=None,
      help="peak lr of the input embedding and output layer (Megatron-LM's flag; default: --lr)")
    a("--decoupled-min-lr", type=float, default=None, help="their final lr (Megatron-LM's flag)")
    a("--weight-decay", type=float, default=0.1)
    a("--clip-grad", type=float, default=1.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.95)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--bf16", action="store_true")
    a("--transformer-impl", choices=TRANSFORMER_IMPLS, default=None,
      help="the layers: Transformer Engine's (Megatron-LM's default; the default here where transformer_engine "
           "imports on a GPU) or megatron-core's local ones (the default elsewhere)")
    a("--fp8-format", choices=FP8_FORMATS, default=None,
      help="FP8 GEMMs through Transformer Engine (needs --bf16 and TE layers), as Megatron-LM's flag")
    a("--fp8-recipe", choices=FP8_RECIPES, default="delayed",
      help="FP8 scaling: delayed (amax history) or tensorwise (current scaling)")
    a("--fp8-param-gather", action="store_true",
      help="keep TE's params in FP8: owners re-quantize them from their fp32 masters and the param all-gather "
           "moves FP8 bytes (needs --fp8-format)")
    a("--gradient-accumulation-fusion", action="store_true",
      help="TE layers accumulate wgrad straight into the owner-aligned grad buffers (Megatron-LM's default with TE); "
           "the output layer then needs Apex's fused_weight_gradient_mlp_cuda (launch/build_apex_wgrad.sh)")
    a("--overlap-grad-reduce", action="store_true")
    a("--overlap-param-gather", action="store_true")
    a("--data-path", default=None, help="Megatron indexed dataset prefix (.bin/.idx)")
    a("--split", default="95,5", help="train,valid[,test] weights as Megatron-LM's: the last share of the data "
      "(the stdlib files last in name order, or the dataset's last documents) is held out for validation")
    a("--eval-interval", type=int, default=None,
      help="validation loss every N iterations (and after the last); default: after the last only")
    a("--eval-iters", type=int, default=4, help="validation batches (each --global-batch-size windows) per evaluation; 0: none")
    a("--seed", type=int, default=1234)
    a("--log-interval", type=int, default=10)
    a("--timing-json", default=None, help="write per-iteration timings here (rank 0)")
    a("--profile-optimizer-at", type=int, default=None, metavar="ITER",
      help="profile the optimizer step of this iteration (torch.profiler, rank 0): a kernel table on stdout, "
           "and a Chrome trace at --profile-out")
    a("--profile-out", default=None, help="Chrome trace file for --profile-optimizer-at")
    a("--exit-after-skipped-iterations", type=int, default=10, metavar="K",
      help="stop with an error after K consecutive iterations whose update was skipped (non-finite gradients) "
           "or whose loss was not finite; 0: never")
    a("--parse-only", action="store_true", help="check the arguments (and the data, paths, memory bound) and exit")
    add_checkpoint_args(p)
    args = p.parse_args(argv)
    validate_args(p, args, DEFAULT_LR)
    # what Megatron-LM reads from --use-distributed-optimizer: DMuon's owners need it, the
    # all-reduce baseline must not have it
    args.use_distributed_optimizer = not (args.optimizer == "dmuon" and args.dmuon_mode == "gather_then_compute")
    return args


def inner_optimizer_name(opt) -> str:
    """The element-wise optimizer Megatron built (TE's FusedAdam where TE imports, else torch's AdamW)."""
    inner = getattr(getattr(opt, "chained_optimizers", [opt])[0], "optimizer", None)
    return f"{type(inner).__module__}.{type(inner).__name__}"


def layers_label(args) -> str:
    """The layers and precision a run uses, in words (progress line, summary)."""
    text = "TE" if args.transformer_impl == "transformer_engine" else "local"
    if args.fp8_format:
        text += f" fp8 {args.fp8_format}/{args.fp8_recipe}" + (" fp8-params" if args.fp8_param_gather else "")
    else:
        text += " bf16" if args.bf16 else " fp32"
    return text + (" fused-wgrad" if args.gradient_accumulation_fusion else "")


def profiled(step, trace_path=None):
    """Run ``step()`` under torch.profiler; print the kernels by total device time (and the
    record_function ranges), optionally export a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        out = step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print("> profile of the optimizer step\n" + prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=90),
          flush=True)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return out


def add_checkpoint_args(p):
    a = p.add_argument
    a("--save", default=None, help="checkpoint directory (Megatron-LM torch_dist layout)")
    a("--save-interval", type=int, default=None, help="save every N iterations (and after the last one)")
    a("--load", default=None, help="resume from the latest checkpoint in this directory (none there: start fresh)")
    a("--fail-at-iteration", type=int, default=None,
      help="fault injection: SIGKILL --fail-rank at the start of this iteration, on the first torchrun attempt only")
    a("--fail-rank", type=int, default=-1, help="global rank --fail-at-iteration kills (-1: the last)")


def setup_distributed():
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        from megatron_dmuon.testing import cpu_shim  # CPU runs only: megatron-core hard-codes CUDA calls

        cpu_shim.install()
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


def load_if_requested(args, ddp, opt, sched, rank) -> int:
    """Resume from --load's latest checkpoint; the iteration to continue after (0: fresh start)."""
    from megatron_dmuon.megatron.checkpoint_io import checkpoint_dir, latest_iteration, load_checkpoint

    if not args.load:
        return 0
    iteration = latest_iteration(args.load)
    if iteration is None:
        if rank == 0:
            print(f"> no checkpoint in {args.load}: starting from scratch", flush=True)
        return 0
    common = load_checkpoint(checkpoint_dir(args.load, iteration), [ddp], opt)
    sched.load_state_dict(common["opt_param_scheduler"])
    if rank == 0:
        print(f"> loaded checkpoint {checkpoint_dir(args.load, iteration)} at iteration {iteration}", flush=True)
    if hasattr(ddp, "dmuon_plan"):
        from megatron_dmuon.megatron.replicas import check_replicas

        report = check_replicas([ddp])
        if rank == 0:
            print(f"> {report}", flush=True)
        if not report.ok:
            raise RuntimeError(f"after loading {args.load}: {report}")
    return int(common["iteration"])


def save(args, iteration, ddp, opt, sched, rank) -> None:
    from megatron_dmuon.megatron.checkpoint_io import save_checkpoint

    path = save_checkpoint(args.save, iteration, [ddp], opt, extra={"opt_param_scheduler": sched.state_dict()})
    if rank == 0:
        print(f"> saved checkpoint {path}", flush=True)


def maybe_fail(args, iteration, rank, world) -> None:
    """--fail-at-iteration: the chosen rank dies as a crashed node would (first attempt only)."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.fail_at_iteration == iteration and first_attempt and rank == args.fail_rank % world:
        print(f"> fault injection: SIGKILL rank {rank} at iteration {iteration}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class IntervalLog:
    """Megatron-style progress line: averages over the log interval (ms, optimizer ms, throughput
    per GPU, lm loss), the last iteration's lr and grad norm (as Megatron-LM prints them), and the
    interval's skipped (update not applied) and NaN/Inf-loss iteration counts."""

    def __init__(self, args, world: int, flops_per_iter: float):
        self.args, self.world, self.flops = args, world, flops_per_iter
        self.tokens = args.global_batch_size * args.seq_length
        self._reset()

    def _reset(self):
        self.n = self.skipped = self.nan = self.finite = 0
        self.step_ms = self.opt_ms = self.loss = 0.0

    def add(self, step_ms, opt_ms, loss, ok):
        self.n += 1
        self.step_ms += step_ms
        self.opt_ms += opt_ms
        self.skipped += int(not ok)
        if math.isfinite(loss):
            self.loss += loss
            self.finite += 1
        else:
            self.nan += 1

    def line(self, it, lr, grad_norm, consumed_samples: int) -> str:
        a, ms = self.args, self.step_ms / self.n
        loss = self.loss / self.finite if self.finite else float("nan")
        out = (f" iteration {it:8d}/{a.train_iters:8d} | consumed samples: {consumed_samples:10d} | "
               f"elapsed time per iteration (ms): {ms:.1f} | optimizer (ms): {self.opt_ms / self.n:.1f} | "
               f"throughput per GPU (TFLOP/s/GPU): {self.flops / (ms / 1e3) / self.world / 1e12:.2f} | "
               f"tokens per second per GPU: {self.tokens / (ms / 1e3) / self.world:.0f} | "
               f"learning rate: {lr:.6E} | global batch size: {a.global_batch_size:5d} | "
               f"lm loss: {loss:.6E} | grad norm: {float('nan') if grad_norm is None else float(grad_norm):.3f} | "
               f"number of skipped iterations: {self.skipped:3d} | number of nan iterations: {self.nan:3d} |")
        self._reset()
        return out


def _gathered_bytes(ddp):
    """Size of what the param all-gathers deliver per step (FP8: the packed blocks), at any DP."""
    from megatron_dmuon.megatron.publish import publish_layouts

    if not getattr(ddp, "buffers", None) or not ddp.ddp_config.use_distributed_optimizer:
        return None
    packed = publish_layouts(ddp)
    return sum(packed[id(b)].recv_bytes if id(b) in packed else b.param_data.numel() * b.param_data.element_size()
               for buf in ddp.buffers + ddp.expert_parallel_buffers for b in buf.buckets)


def _memory_summary(opt, ddp, dp_size) -> dict:
    """Rank 0's optimizer state (counted from its tensors) next to Megatron AdamW's figure, the
    publish bytes per step, and the peak memory the allocator saw (GPU)."""
    from megatron_dmuon.megatron.memory import megatron_adamw_state_bytes, optimizer_state_bytes
    from megatron_dmuon.megatron.optimizer import comm_bytes_per_step

    out = {"optimizer_state_bytes": optimizer_state_bytes(opt)["total"],
           "adamw_distopt_state_bytes": megatron_adamw_state_bytes([ddp], dp_size),
           "publish_bytes": comm_bytes_per_step([ddp], "dmuon")["publish_bytes"] if hasattr(ddp, "buffers") else None,
           "publish_gathered_bytes": _gathered_bytes(ddp)}
    if torch.cuda.is_available():
        out["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return out


_SAVE_LOCKS = {}  # held until the process ends


def validation_runner(args, data, dp_size, dp_rank, rank, loss_of):
    """``evaluate(iteration) -> loss`` over the held-out split (printed as Megatron-LM prints it),
    or None when validation is off. Every evaluation reads the same --eval-iters x
    --global-batch-size windows, this DP rank its share of each, in micro-batches."""
    if args.eval_iters == 0:
        return None
    if not data.has_validation():
        if rank == 0:
            print(f"> no validation: the held-out split of --split {args.split} is shorter than one window "
                  f"(--seq-length {args.seq_length} + 1 tokens)", flush=True)
        return None
    per_rank = args.global_batch_size // dp_size
    micro = [m for batch in data.validation_batches(args.eval_iters, args.global_batch_size)
             for m in batch[dp_rank * per_rank:(dp_rank + 1) * per_rank].split(args.micro_batch_size)]

    def evaluate(iteration: int) -> float:
        loss = loss_of(micro)
        if rank == 0:
            text = (f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                    f"lm loss PPL: {math.exp(min(loss, 700)):.6E} | ")
            print("-" * len(text) + "\n" + text + "\n" + "-" * len(text), flush=True)
        return loss

    return evaluate


def main(argv=None):
    args = parse_args(argv)
    if args.parse_only:
        if os.environ.get("RANK", "0") == "0":
            print("> arguments checked", flush=True)
        return
    rank, world, backend = setup_distributed()
    if args.save:  # one writer per --save directory (rank 0 holds the lock for the run)
        holder = [_SAVE_LOCKS.setdefault(args.save, SaveLock(args.save)).acquire() if rank == 0 else None]
        torch.distributed.broadcast_object_list(holder, src=0)
        if holder[0]:
            job_error(f"--save {args.save} is being written by another run ({holder[0]}, "
                      f"{os.path.join(args.save, SaveLock.NAME)}): wait for it, or save elsewhere", 2)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dmuon.megatron.config import config_from_args
    from megatron_dmuon.megatron.gpt import (GPTShape, build_gpt, eval_loss, gpt_training_flops, on_gpu, train_step,
                                             wire_sync_funcs)
    from megatron_dmuon.megatron.megatron_lm import ddp_class_for, optimizer_factory_for
    from megatron_dmuon.megatron.optimizer import comm_bytes_per_step

    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    torch.manual_seed(args.seed)  # CPU-side init (use_cpu_initialization), as Megatron's _set_random_seed
    model_parallel_cuda_manual_seed(args.seed)
    if args.global_batch_size % (args.micro_batch_size * dp_size):
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"--micro-batch-size x DP = {args.micro_batch_size * dp_size}")
    grad_accum = args.global_batch_size // (args.micro_batch_size * dp_size)
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
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,  # Megatron counts samples
        lr_decay_steps=args.train_iters * args.global_batch_size, lr_decay_style="cosine",
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style="constant")
    data = token_source(args)
    sync = torch.cuda.synchronize if on_gpu() else (lambda: None)
    # time the optimizer step inside train_step by wrapping step()
    opt_ms = []
    inner_step = opt.step

    def timed_step():
        sync()
        t = time.perf_counter()
        if rank == 0 and args.profile_optimizer_at == len(opt_ms) + start + 1:
            out = profiled(inner_step, args.profile_out)
        else:
            out = inner_step()
        sync()
        opt_ms.append((time.perf_counter() - t) * 1e3)
        return out

    opt.step = timed_step
    nparams = sum(p.numel() for p in model.parameters())
    gtc = not args.use_distributed_optimizer
    log = IntervalLog(args, world, gpt_training_flops(shape, args.global_batch_size))
    if rank == 0:
        mode = args.optimizer if args.optimizer == "adam" else f"dmuon/{args.dmuon_mode}"
        print(f"> {mode} | backend {backend} | DP {dp_size} TP {args.tensor_model_parallel_size} "
              f"PP {args.pipeline_model_parallel_size} | grad accum {grad_accum} | params {nparams/1e6:.2f}M | "
              f"layers {layers_label(args)} | "
              f"bytes/step {json.dumps(comm_bytes_per_step([ddp], 'gather_then_compute' if gtc else 'dmuon'))}",
              flush=True)
    timings, validation, first_loss, last_loss, skipped = [], [], None, None, 0
    evaluate = validation_runner(args, data, dp_size, dp_rank, rank, lambda micro: eval_loss(
        [ddp], micro, args.seq_length, args.micro_batch_size))
    start = load_if_requested(args, ddp, opt, sched, rank)
    if start >= args.train_iters and rank == 0:
        print(f"> the checkpoint is at iteration {start} and --train-iters is {args.train_iters}: nothing to train "
              "(raise --train-iters to continue)", flush=True)
    streak = 0  # consecutive iterations without a finite loss and an applied update
    for it in range(start + 1, args.train_iters + 1):
        maybe_fail(args, it, rank, world)
        sync()
        t0 = time.perf_counter()
        micro = [data.batch(it, dp_rank, m, args.micro_batch_size) for m in range(grad_accum)]
        loss, grad_norm, _, ok = train_step([ddp], opt, micro, args.seq_length, args.micro_batch_size)
        sync()
        step_ms = (time.perf_counter() - t0) * 1e3
        if ok:
            sched.step(increment=args.global_batch_size)  # Megatron counts samples (consumed samples)
        skipped += not ok  # a non-finite gradient: skipped on every rank, nothing changed
        streak = 0 if ok and math.isfinite(loss) else streak + 1
        stop_if_not_learning(args, it, streak, loss, ok, opt, rank)
        if args.save and ((args.save_interval and it % args.save_interval == 0) or it == args.train_iters):
            if not params_finite(opt):
                job_error(f"the parameters are not finite after iteration {it}: not saved (the last checkpoint in "
                          f"{args.save} is still the latest); lower --lr or keep --clip-grad on", 1)
            save(args, it, ddp, opt, sched, rank)
        timings.append({"iteration": it, "step_ms": step_ms, "optimizer_ms": opt_ms[-1], "loss": loss})
        log.add(step_ms, opt_ms[-1], loss, ok)
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        if it % args.log_interval == 0 or it == 1 or it == args.train_iters:
            line = log.line(it, opt.param_groups[0]["lr"], grad_norm, sched.num_steps)
            if rank == 0:
                print(line, flush=True)
        if evaluate and (it == args.train_iters or (args.eval_interval and it % args.eval_interval == 0)):
            validation.append({"iteration": it, "loss": evaluate(it)})
    if evaluate and not timings:  # nothing trained: the loaded model's validation loss
        validation.append({"iteration": start, "loss": evaluate(start)})
    steady = timings[len(timings) // 2:] or timings
    median = (lambda key: sorted(t[key] for t in steady)[len(steady) // 2]) if steady else (lambda key: None)
    # every rank's median optimizer step: an owner with more NS work than rank 0 shows up here
    # (the others then wait for its bucket in the next forward's param all-gather)
    per_rank_opt = [None] * world
    torch.distributed.all_gather_object(per_rank_opt, median("optimizer_ms"))
    if rank == 0:
        summary = {"optimizer": args.optimizer, "mode": args.dmuon_mode if args.optimizer == "dmuon" else "adam",
                   "transformer_impl": args.transformer_impl, "fp8": args.fp8_format and {
                       "format": args.fp8_format, "recipe": args.fp8_recipe, "param_gather": args.fp8_param_gather},
                   "gradient_accumulation_fusion": args.gradient_accumulation_fusion,
                   "adam_impl": inner_optimizer_name(opt) if args.optimizer == "adam" else None,
                   "dp": dp_size, "tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                   "iteration": max(start, args.train_iters) if timings or start else 0,
                   "trained_iterations": len(timings), "consumed_samples": sched.num_steps,
                   "first_loss": first_loss, "last_loss": last_loss, "skipped_iterations": skipped,
                   "val_loss": validation[-1]["loss"] if validation else None,
                   **({k: v for k, v in opt.dmuon_stats().items() if k.startswith("ns_")} if hasattr(opt, "dmuon_stats")
                      else {}),
                   **({"ns_paths": {"every matrix": opt.megatron_ns_path}} if hasattr(opt, "megatron_ns_path") else {}),
                   "median_step_ms": median("step_ms"), "median_optimizer_ms": median("optimizer_ms"),
                   "median_optimizer_ms_per_rank": per_rank_opt,
                   **_memory_summary(opt, ddp, dp_size)}
        print("> summary " + json.dumps(summary), flush=True)
        if args.timing_json:
            with open(args.timing_json, "w") as f:
                plan = json.loads(ddp.dmuon_plan.to_json()) if hasattr(ddp, "dmuon_plan") else None
                json.dump({"summary": summary, "iterations": timings, "validation": validation, "args": vars(args),
                           "dmuon_plan": plan}, f, indent=1)  # dmuon plan --show <this file> prints the plan
    torch.distributed.destroy_process_group()


def job_error(message: str, code: int) -> None:
    """A run-time error every rank reached together: rank 0 prints it once, every rank exits."""
    if torch.distributed.get_rank() == 0:
        sys.stderr.write(f"pretrain_gpt.py: error: {message}\n")
        sys.stderr.flush()
    torch.distributed.destroy_process_group()
    raise SystemExit(code)


@torch.no_grad()
def params_finite(opt) -> bool:
    """Whether every parameter the optimizer holds (the main params: fp32 shards) is finite on
    every rank (one all-reduce)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    device = params[0].device if params else torch.device("cpu")
    bad = torch.zeros(1, device=device)
    for p in params:
        if p.numel() and not bool(torch.isfinite(p).all()):
            bad.fill_(1.0)
            break
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return not bool(bad.item())


def stop_if_not_learning(args, it, streak, loss, ok, opt, rank) -> None:
    """--exit-after-skipped-iterations: K consecutive iterations without a finite loss and an
    applied update stop the run; an applied update after a non-finite loss (Megatron's AdamW does
    not skip it) stops it at once if it made the parameters non-finite."""
    limit = args.exit_after_skipped_iterations
    if limit and streak >= limit:
        job_error(f"{streak} consecutive iterations up to {it} had non-finite gradients or loss (the updates were "
                  f"skipped): the run cannot recover; lower --lr, check the data, or raise "
                  f"--exit-after-skipped-iterations", 1)
    if ok and not math.isfinite(loss) and not params_finite(opt):
        job_error(f"iteration {it} had a non-finite loss and its update made the parameters non-finite: the "
                  f"run cannot recover (nothing saved after it); lower --lr or keep --clip-grad on", 1)


if __name__ == "__main__":
    main()
