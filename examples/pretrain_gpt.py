"""Pretrain a megatron-core GPT with DMuon (or Megatron's AdamW) — the project's main job.

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --optimizer dmuon        # 2 CPU ranks (gloo)
    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --optimizer dmuon --bf16 # all GPUs (NCCL)

Data: byte-level tokens of the Python standard library's source (on every machine), or a Megatron
indexed dataset with --data-path PREFIX (the .bin/.idx pair). Prints Megatron-style progress lines.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    from megatron_dmuon.megatron.config import add_dmuon_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--optimizer", default="dmuon", choices=["dmuon", "adam"])
    add_dmuon_args(p)  # Megatron's --muon-* flags and DMuon's --dmuon-* flags, with the library's defaults
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
    a("--lr", type=float, default=3e-3)
    a("--min-lr", type=float, default=3e-4)
    a("--lr-warmup-iters", type=int, default=5)
    a("--weight-decay", type=float, default=0.1)
    a("--clip-grad", type=float, default=1.0)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.95)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--bf16", action="store_true")
    a("--overlap-grad-reduce", action="store_true")
    a("--overlap-param-gather", action="store_true")
    a("--data-path", default=None, help="Megatron indexed dataset prefix (.bin/.idx)")
    a("--seed", type=int, default=1234)
    a("--log-interval", type=int, default=10)
    a("--timing-json", default=None, help="write per-iteration timings here (rank 0)")
    args = p.parse_args(argv)
    if args.lr_warmup_iters >= args.train_iters:
        p.error(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than --train-iters ({args.train_iters})")
    # what Megatron-LM reads from --use-distributed-optimizer: DMuon's owners need it, the
    # all-reduce baseline must not have it
    args.use_distributed_optimizer = not (args.optimizer == "dmuon" and args.dmuon_mode == "gather_then_compute")
    return args


def stdlib_bytes() -> torch.Tensor:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class TokenSource:
    """Random (seq+1)-token windows; deterministic per (iteration, rank, micro-batch)."""

    def __init__(self, args):
        self.seq = args.seq_length
        if args.data_path:
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            ds = IndexedDataset(args.data_path)
            docs = [torch.from_numpy(ds[i].astype("int64")) for i in range(len(ds))]
            self.tokens = torch.cat(docs)
            if int(self.tokens.max()) >= args.vocab_size:
                raise ValueError(f"--vocab-size {args.vocab_size} is smaller than the dataset's max token id "
                                 f"{int(self.tokens.max())}; raise --vocab-size")
        else:
            if args.vocab_size < 256:
                raise ValueError("--vocab-size must be >= 256 for the byte-level default data")
            self.tokens = stdlib_bytes()
        if self.tokens.numel() < self.seq + 2:
            raise ValueError(f"dataset has {self.tokens.numel()} tokens; need more than --seq-length {self.seq}")
        self.seed = args.seed

    def batch(self, it, rank, micro, mbs):
        g = torch.Generator().manual_seed(self.seed * 7919 + it * 104729 + rank * 1299709 + micro)
        starts = torch.randint(0, self.tokens.numel() - self.seq - 1, (mbs,), generator=g)
        return torch.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()])


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
    torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    return rank, world, backend


class IntervalLog:
    """Megatron-style progress line: averages over the log interval, throughput per GPU, and the
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

    def line(self, it, lr, grad_norm) -> str:
        a, ms = self.args, self.step_ms / self.n
        loss = self.loss / self.finite if self.finite else float("nan")
        out = (f" iteration {it:8d}/{a.train_iters:8d} | consumed samples: {it * a.global_batch_size:10d} | "
               f"elapsed time per iteration (ms): {ms:.1f} | optimizer (ms): {self.opt_ms / self.n:.1f} | "
               f"throughput per GPU (TFLOP/s/GPU): {self.flops / (ms / 1e3) / self.world / 1e12:.2f} | "
               f"tokens per second per GPU: {self.tokens / (ms / 1e3) / self.world:.0f} | "
               f"learning rate: {lr:.6E} | global batch size: {a.global_batch_size:5d} | "
               f"lm loss: {loss:.6E} | grad norm: {float(grad_norm):.3f} | "
               f"number of skipped iterations: {self.skipped:3d} | number of nan iterations: {self.nan:3d} |")
        self._reset()
        return out


def main(argv=None):
    args = parse_args(argv)
    rank, world, backend = setup_distributed()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dmuon.megatron.config import config_from_args
    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, gpt_training_flops, on_gpu, train_step, wire_sync_funcs
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
                     seq_length=args.seq_length, bf16=args.bf16)
    model = build_gpt(shape)
    # the same construction Megatron-LM's hook wires: DDP class and optimizer factory from the flags
    ddp_config = config_from_args(DistributedDataParallelConfig, args, grad_reduce_in_fp32=True)
    ddp_config.overlap_param_gather = args.overlap_param_gather and args.use_distributed_optimizer
    ddp = (ddp_class_for(args) or DistributedDataParallel)(config=model.config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()
    wire_sync_funcs([ddp], ddp_config)
    opt_config = config_from_args(OptimizerConfig, args,
                                  params_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    opt = optimizer_factory_for(args, get_megatron_optimizer)(opt_config, [ddp])
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,  # Megatron counts samples
        lr_decay_steps=args.train_iters * args.global_batch_size, lr_decay_style="cosine",
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style="constant")
    data = TokenSource(args)
    sync = torch.cuda.synchronize if on_gpu() else (lambda: None)
    # time the optimizer step inside train_step by wrapping step()
    opt_ms = []
    inner_step = opt.step

    def timed_step():
        sync()
        t = time.perf_counter()
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
              f"bytes/step {json.dumps(comm_bytes_per_step([ddp], 'gather_then_compute' if gtc else 'dmuon'))}",
              flush=True)
    timings, first_loss, last_loss = [], None, None
    for it in range(1, args.train_iters + 1):
        sync()
        t0 = time.perf_counter()
        micro = [data.batch(it, dp_rank, m, args.micro_batch_size) for m in range(grad_accum)]
        loss, grad_norm, _, ok = train_step([ddp], opt, micro, args.seq_length, args.micro_batch_size)
        sync()
        step_ms = (time.perf_counter() - t0) * 1e3
        if ok:
            sched.step(increment=args.global_batch_size)  # Megatron counts samples
        timings.append({"iteration": it, "step_ms": step_ms, "optimizer_ms": opt_ms[-1], "loss": loss})
        log.add(step_ms, opt_ms[-1], loss, ok)
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        if it % args.log_interval == 0 or it == 1:
            line = log.line(it, opt.param_groups[0]["lr"], grad_norm)
            if rank == 0:
                print(line, flush=True)
    if rank == 0:
        steady = timings[len(timings) // 2:] or timings
        summary = {"optimizer": args.optimizer, "mode": args.dmuon_mode if args.optimizer == "dmuon" else "adam",
                   "dp": dp_size, "tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                   "first_loss": first_loss, "last_loss": last_loss,
                   "median_step_ms": sorted(t["step_ms"] for t in steady)[len(steady) // 2],
                   "median_optimizer_ms": sorted(t["optimizer_ms"] for t in steady)[len(steady) // 2]}
        print("> summary " + json.dumps(summary), flush=True)
        if args.timing_json:
            with open(args.timing_json, "w") as f:
                json.dump({"summary": summary, "iterations": timings, "args": vars(args)}, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
