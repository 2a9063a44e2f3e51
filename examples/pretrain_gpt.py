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
import os
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--optimizer", default="dmuon", choices=["dmuon", "adam"])
    a("--dmuon-mode", default="dmuon", choices=["dmuon", "gather_then_compute", "megatron_layerwise"])
    a("--dmuon-ns-method", default="auto", choices=["standard", "gram", "auto"])
    a("--dmuon-ns-steps", type=int, default=5)
    a("--dmuon-coefficients", default="keller",
      help="keller | polar_express | you | adaptive (per shape: 5-step Polar Express, 6 steps for square)")
    a("--dmuon-ns-launch", default="eager", choices=["eager", "streams", "graph"],
      help="GPU: the owner's per-shape NS calls one by one, on concurrent streams, or as one CUDA graph")
    a("--dmuon-momentum", type=float, default=0.95)
    a("--dmuon-no-nesterov", action="store_true")
    a("--dmuon-ranks-per-node", type=int, default=0,
      help="> 0: two-level (intra-node, inter-node) reduce/publish with this many ranks per node")
    a("--dmuon-split-qkv", action="store_true", help="orthogonalize Q, K, V separately (Megatron's Muon default)")
    a("--dmuon-split-heads", action="store_true", help="orthogonalize every attention head separately")
    a("--dmuon-split-glu", action="store_true", help="orthogonalize SwiGLU gate and up separately")
    a("--dmuon-scale-mode", default="match_rms_adamw", choices=["spectral", "match_rms_adamw", "none"])
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
    a("--muon-tp-mode", default="blockwise", choices=["blockwise", "duplicated", "distributed"],
      help="--dmuon-mode megatron_layerwise only: Megatron's own Muon TP mode")
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


def main(argv=None):
    args = parse_args(argv)
    rank, world, backend = setup_distributed()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_dmuon.megatron.gpt import GPTShape, build_gpt, on_gpu, train_step, wire_sync_funcs
    from megatron_dmuon.megatron.layout import build_dmuon_ddp
    from megatron_dmuon.megatron.optimizer import DMuonConfig, comm_bytes_per_step, get_dmuon_optimizer
    from megatron_dmuon.runtime.owner_step import MuonSettings

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
    gtc = args.optimizer == "dmuon" and args.dmuon_mode == "gather_then_compute"
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=not gtc, grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather and not gtc)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
        bf16=args.bf16, params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=not gtc, muon_tp_mode=args.muon_tp_mode)
    if args.optimizer == "dmuon" and not gtc:
        ddp = build_dmuon_ddp(model.config, ddp_config, model, ranks_per_node=args.dmuon_ranks_per_node)
    else:
        ddp = DistributedDataParallel(model.config, ddp_config, model)
    ddp.broadcast_params()
    wire_sync_funcs([ddp], ddp_config)
    if args.optimizer == "dmuon":
        muon = MuonSettings(momentum=args.dmuon_momentum, nesterov=not args.dmuon_no_nesterov,
                            ns_method=args.dmuon_ns_method, coefficients=args.dmuon_coefficients,
                            ns_steps=args.dmuon_ns_steps, scale_mode=args.dmuon_scale_mode,
                            ns_launch=args.dmuon_ns_launch)
        opt = get_dmuon_optimizer(opt_config, [ddp], DMuonConfig(
            mode=args.dmuon_mode, muon=muon, split_qkv=args.dmuon_split_qkv or args.dmuon_split_heads,
            split_per_head=args.dmuon_split_heads, split_glu=args.dmuon_split_glu))
    else:
        opt = get_megatron_optimizer(opt_config, [ddp])
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
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        if rank == 0 and (it % args.log_interval == 0 or it == 1):
            lr = opt.param_groups[0]["lr"]
            print(f" iteration {it:8d}/{args.train_iters:8d} | consumed samples: {it * args.global_batch_size:10d} | "
                  f"elapsed time per iteration (ms): {step_ms:.1f} | optimizer (ms): {opt_ms[-1]:.1f} | "
                  f"learning rate: {lr:.6E} | global batch size: {args.global_batch_size:5d} | "
                  f"lm loss: {loss:.6E} | grad norm: {float(grad_norm):.3f} |", flush=True)
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
