"""What the main job prints about itself: the start line, the closing ``> summary`` JSON (what ran,
losses, NS paths, median step times of every rank, memory and bytes), and the --timing-json file."""
from __future__ import annotations

import json

import torch


# how every --timing-json this job writes begins (json.dump(indent=1) of {"summary": {"optimizer": ...}, ...}):
# an existing file is replaced only if it begins so (output_paths.check_outputs_against_inputs)
TIMING_JSON_HEAD = '{\n "summary": {\n  "optimizer": '


def is_timing_json(path: str) -> bool:
    """Whether ``path`` begins as a --timing-json of this job does (its head only: any size is cheap)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(TIMING_JSON_HEAD)) == TIMING_JSON_HEAD.encode()
    except OSError:
        return False


def layers_label(args) -> str:
    """The layers and precision a run uses, in words (progress line, summary)."""
    text = "TE" if args.transformer_impl == "transformer_engine" else "local"
    if args.fp8_format:
        text += f" fp8 {args.fp8_format}/{args.fp8_recipe}" + (" fp8-params" if args.fp8_param_gather else "")
    else:
        text += " bf16" if args.bf16 else " fp32"
    return text + (" fused-wgrad" if args.gradient_accumulation_fusion else "")


def inner_optimizer_name(opt) -> str:
    """The element-wise optimizer Megatron built (TE's FusedAdam where TE imports, else torch's AdamW)."""
    inner = getattr(getattr(opt, "chained_optimizers", [opt])[0], "optimizer", None)
    return f"{type(inner).__module__}.{type(inner).__name__}"


def print_start_line(job) -> None:
    """Rank 0: the optimizer, backend, parallel sizes, size, layers and the bytes each step moves."""
    from megatron_dmuon.megatron.optimizer import comm_bytes_per_step

    args = job.args
    nparams = sum(p.numel() for p in job.model.parameters())
    gtc = not args.use_distributed_optimizer
    if job.rank == 0:
        mode = args.optimizer if args.optimizer == "adam" else f"dmuon/{args.dmuon_mode}"
        print(f"> {mode} | backend {job.backend} | DP {job.dp_size} TP {args.tensor_model_parallel_size} "
              f"PP {args.pipeline_model_parallel_size} | grad accum {job.grad_accum} | params {nparams/1e6:.2f}M | "
              f"layers {layers_label(args)} | "
              f"bytes/step {json.dumps(comm_bytes_per_step([job.ddp], all_reduce=gtc))}",
              flush=True)


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
           "publish_bytes": comm_bytes_per_step([ddp])["publish_bytes"] if hasattr(ddp, "buffers") else None,
           "publish_gathered_bytes": _gathered_bytes(ddp)}
    if torch.cuda.is_available():
        out["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    return out


def report(job, run):
    """Every rank: its median optimizer step to rank 0; rank 0: the summary line and --timing-json.
    Returns, on rank 0, why --timing-json could not be written (None: written, or not asked)."""
    args, opt, ddp, start = job.args, job.opt, job.ddp, run.start
    timings = run.timings
    steady = timings[len(timings) // 2:] or timings
    median = (lambda key: sorted(t[key] for t in steady)[len(steady) // 2]) if steady else (lambda key: None)
    # every rank's median optimizer step: an owner with more NS work than rank 0 shows up here
    # (the others then wait for its bucket in the next forward's param all-gather)
    per_rank_opt = [None] * job.world
    torch.distributed.all_gather_object(per_rank_opt, median("optimizer_ms"))
    if job.rank != 0:
        return None
    summary = {"optimizer": args.optimizer, "mode": args.dmuon_mode if args.optimizer == "dmuon" else "adam",
               "transformer_impl": args.transformer_impl, "fp8": args.fp8_format and {
                   "format": args.fp8_format, "recipe": args.fp8_recipe, "param_gather": args.fp8_param_gather},
               "gradient_accumulation_fusion": args.gradient_accumulation_fusion,
               "adam_impl": inner_optimizer_name(opt) if args.optimizer == "adam" else None,
               "dp": job.dp_size, "tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
               "iteration": max(start, args.train_iters) if timings or start else 0,
               "trained_iterations": len(timings), "consumed_samples": run.consumed,
               "first_loss": run.first_loss, "last_loss": run.last_loss, "skipped_iterations": run.skipped,
               "val_loss": run.validation[-1]["loss"] if run.validation else None,
               **({k: v for k, v in opt.dmuon_stats().items() if k.startswith(("ns_", "overlap_"))} if hasattr(opt, "dmuon_stats")
                  else {}),
               **({"ns_paths": {"every matrix": opt.megatron_ns_path}} if hasattr(opt, "megatron_ns_path") else {}),
               "median_step_ms": median("step_ms"), "median_optimizer_ms": median("optimizer_ms"),
               "median_optimizer_ms_per_rank": per_rank_opt,
               **_memory_summary(opt, ddp, job.dp_size)}
    print("> summary " + json.dumps(summary), flush=True)
    if args.timing_json:
        plan = json.loads(ddp.dmuon_plan.to_json()) if hasattr(ddp, "dmuon_plan") else None
        try:
            with open(args.timing_json, "w") as f:
                json.dump({"summary": summary, "iterations": timings, "validation": run.validation, "args": vars(args),
                           "dmuon_plan": plan}, f, indent=1)  # dmuon plan --show <this file> prints the plan
        except OSError as e:
            return (f"--timing-json {args.timing_json} could not be written ({e.strerror or e}); the summary line "
                    "above holds the run's figures")
    return None
