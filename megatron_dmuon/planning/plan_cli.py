"""`dmuon plan`: owner plans of a model side by side, from a description or a Megatron-LM argv.

    dmuon plan --preset qwen2.5-7b --dp 8
    dmuon plan --preset qwen2.5-7b --dp 64 --json
    dmuon plan --megatron-argv "--num-layers 28 --hidden-size 3584 ... --tensor-model-parallel-size 2" --nodes 4
    dmuon plan --preset qwen7b-4l --dp 2 --profile docs/results/kernels/bench_kernels_h200_2026-11-30.json --simulate
    dmuon plan --preset qwen2.5-7b --dp 8 --simulate --overlap-step on --overlap-eta 0.25
    dmuon plan --show timing.json      # the DMuonPlan a run made (main job --timing-json, or a plan JSON)

For round-robin, numel-LPT (Megatron 0.19 LayerWise), the NS-FLOP greedy (ours until now) and the
MILP: per-rank predicted owner time, bytes reduced and published per rank, padding, makespan and
mean, all predicted with one cost model (planning/cost_model.py: analytic by default, or a
measured profile). ``--simulate`` adds the predicted optimizer step on the cluster
(planning/simulate.py); ``--overlap-step on`` adds the NS the overlapped owner step leaves exposed
per iteration, off vs on vs on with the start in the last backward (planning/simulate_overlap.py;
it plans Megatron's buckets of ``--overlap-grad-reduce``, which ``--overlap-param-gather`` needs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from ..algorithms.coefficients import COEFFICIENT_SETS
from ..algorithms.flops import NS_METHODS
from ..algorithms.muon import MOMENTUM_DTYPES
from .cost_model import CostModel, cluster_spec, load_config
from .milp import BACKENDS
from .overlap_mode import OverlapMode
from .models import PRESETS, ModelSpec, ParallelSpec, parse_megatron_argv
from .ns_choice import ADAPTIVE_SCHEDULE
from .dp_schemes import compare_dp_layouts, dp_layout_lines
from .plan_inputs import RANK_MODEL_KINDS, BadProfile, load_profile, load_rank_model, show_plan  # noqa: F401
from .planners import PLANNERS, compare_plans

__all__ = ["main", "build_parser", "load_profile"]


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (exit 2): the flag, the value and the fix; ``-h`` lists the flags."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dmuon plan", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("model (a preset, a Megatron-LM argv, or the shape flags)")
    src.add_argument("--preset", choices=sorted(PRESETS))
    src.add_argument("--megatron-argv", help="a Megatron-LM pretrain_gpt.py command line (quoted)")
    for flag, kw in (("--num-layers", {}), ("--hidden", {}), ("--ffn", {}), ("--heads", {}),
                     ("--query-groups", {}), ("--vocab", {}), ("--experts", {}), ("--moe-ffn", {})):
        src.add_argument(flag, type=int, **kw)
    par = p.add_argument_group("parallel layout")
    par.add_argument("--dp", type=int, help="data-parallel size (default: nodes x GPUs per node / (TP x PP))")
    par.add_argument("--tp", type=int)
    par.add_argument("--pp", type=int)
    par.add_argument("--ep", type=int)
    par.add_argument("--etp", type=int)
    par.add_argument("--nodes", type=int)
    par.add_argument("--gpus-per-node", type=int)
    par.add_argument("--stage", type=int, default=0, help="pipeline stage to plan (default 0)")
    par.add_argument("--overlap-grad-reduce", action="store_true",
                     help="Megatron's buckets (40M elements or more) instead of one bucket per buffer")
    par.add_argument("--bucket-size", type=int)
    cost = p.add_argument_group("cost model and solver")
    cost.add_argument("--cluster", default="h200", help="cluster in the config (default h200; also a800)")
    cost.add_argument("--config", help="cluster config JSON (default: planning/clusters.json)")
    cost.add_argument("--profile", help="measured NS times: a profile cache entry / CostTable JSON, or the "
                                        "kernel benchmark's JSON "
                                        "(docs/results/kernels/bench_kernels_h200_2026-11-30.json)")
    cost.add_argument("--ns-method", default="auto", choices=NS_METHODS)
    cost.add_argument("--ns-teams", default="off", choices=["off", "auto"],
                      help="--dmuon-ns-teams: the split layout may share a large matrix's NS over a team of homes")
    cost.add_argument("--ns-steps", type=int, default=5)
    cost.add_argument("--backend", default="auto", choices=BACKENDS)
    cost.add_argument("--time-limit", type=float, default=10.0, help="MILP seconds (default 10)")
    cost.add_argument("--planners", nargs="+", default=list(PLANNERS), choices=PLANNERS)
    rank = p.add_argument_group("the whole owner step per GPU (planning/rank_cost.py: NS pieces + AdamW shards)")
    rank.add_argument("--rank-model", metavar="analytic|FILE", default=None,
                      help="also plan greedy / numel-LPT / Megatron's LPT / the MILP as a job runs them and predict "
                           "each GPU's whole owner step: 'analytic' (the cluster config's rates) or a rank cost model "
                           "JSON (RankCostModel.to_json, a start-up profile cache entry, or bench/rank_balance.py "
                           "calibrate's JSON)")
    rank.add_argument("--muon-no-split-qkv", dest="split_qkv", action="store_false",
                      help="as the job flag: orthogonalize QKV whole (default: q, k, v apart)")
    rank.add_argument("--dmuon-split-glu", action="store_true", help="as the job flag: gate and up apart")
    rank.add_argument("--dmuon-split-heads", action="store_true", help="as the job flag: every head apart")
    rank.add_argument("--dmuon-coefficients", default="you", choices=COEFFICIENT_SETS + (ADAPTIVE_SCHEDULE,), help="the job's NS schedule (the greedy's FLOP costs; "
                                                                   "default Megatron's 'you', e.g. adaptive)")
    mem = p.add_argument_group("optimizer state (bytes per rank, next to Megatron AdamW DistributedOptimizer's)")
    mem.add_argument("--fp32-params", action="store_true",
                     help="fp32 model params (their own masters); default: a --bf16 model with fp32 masters")
    mem.add_argument("--dmuon-momentum-dtype", default="fp32", choices=tuple(MOMENTUM_DTYPES),
                     help="as the training flag: bf16 halves the Muon momentum")
    lay = p.add_argument_group("DP layouts and instances (planning/dp_schemes.py; the dense buffer)")
    lay.add_argument("--instances", type=int, nargs="+", default=None, metavar="N",
                     help="distributed-optimizer instance counts to compare (default: the powers of two dividing DP, "
                          "up to 64)")
    lay.add_argument("--global-batch", type=int, default=1024,
                     help="sequences per iteration, for the modelled iteration (default 1024: 4M tokens at 4096)")
    lay.add_argument("--dp-layouts", action="store_true", help="also for a MoE model (its dense buffer only)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help='print {"plans": {...}, ...} as JSON')
    out.add_argument("--simulate", action="store_true", help="also predict the optimizer step on the cluster")
    out.add_argument("--flat", action="store_true", help="simulate flat instead of two-level collectives")
    ovl = p.add_argument_group("overlapped owner step (--dmuon-overlap-step; implies --simulate and --overlap-grad-reduce)")
    ovl.add_argument("--overlap-step", default="off", choices=["off", "on"],
                     help="on: also simulate the owner NS beside the next forward / last backward")
    ovl.add_argument("--overlap-eta", type=float, default=None,
                     help="co-run efficiency: the fraction of its standalone speed NS keeps beside the model's "
                          "kernels, 0..1 (default: simulate_overlap.DEFAULT_ETA, 0.25: low on purpose, docs/load_balancing.md)")
    ovl.add_argument("--seq-length", type=int, default=4096)
    ovl.add_argument("--micro-batch-size", type=int, default=1)
    ovl.add_argument("--micro-batches", type=int, default=4, help="micro-batches per GPU per iteration (default 4)")
    ovl.add_argument("--model-tflops", type=float, default=None,
                     help="achieved forward+backward TFLOP/s per GPU (default: the device's model_tflops in the config)")
    out.add_argument("--plot", metavar="FILE.png", default=None,
                     help="also draw each GPU's predicted NS and bytes under each planner and the DP layouts' "
                          "candidates (matplotlib)")
    out.add_argument("--show", metavar="FILE", default=None,
                     help="print the DMuonPlan a run built (planning/plan.py) from a plan JSON or the main job's "
                          "--timing-json file, instead of planning a model")
    return p


def _rank_lines(report: dict) -> list:
    plans = report["plans"]
    names = list(plans)
    lines = [f"\nwhole owner step per GPU, ms (rank cost model: {report['rank_model'].get('source')}; pieces "
             f"{report['split']}; AdamW fragments of each GPU's shards)",
             "| GPU | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for r in range(len(plans[names[0]]["rank_ms"])):
        lines.append(f"| {r} | " + " | ".join(f"{plans[n]['rank_ms'][r]:.2f}" for n in names) + " |")
    for label, key in (("slowest GPU", "makespan_ms"), ("mean", "mean_ms"), ("planning s", "plan_seconds")):
        lines.append(f"| **{label}** | " + " | ".join(f"{plans[n][key]:.2f}" for n in names) + " |")
    for kind, info in plans.get("milp", {}).get("solver", {}).items():
        lines.append(f"MILP ({kind}): {info.get('backend')}, {info.get('status')}, start {info.get('chosen')}, "
                     f"{info.get('polish_moves', 0)} local moves, {info.get('seconds', 0):.2f} s; warm starts "
                     + ", ".join(f"{n} {v:.2f}" for n, v in info.get("candidates", {}).items())
                     + (f" ({info['note']})" if info.get("note") else ""))
    return lines


# --megatron-argv's flags behind the model and parallel fields (how errors name them)
ARGV_FLAGS = {"num_layers": "--num-layers", "hidden": "--hidden-size", "ffn_hidden": "--ffn-hidden-size",
              "heads": "--num-attention-heads", "query_groups": "--num-query-groups", "vocab": "--vocab-size",
              "kv_channels": "--kv-channels", "moe_ffn_hidden": "--moe-ffn-hidden-size", "num_experts": "--num-experts",
              "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
              "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size", "nodes": "--nnodes",
              "gpus_per_node": "--nproc-per-node", "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by"}


def _megatron_argv(p, text: str):
    """parse_megatron_argv with its problems as argparse errors naming --megatron-argv, the flag
    inside it and the fix."""
    import shlex

    try:
        argv = shlex.split(text)
    except ValueError as e:
        p.error(f"--megatron-argv: the command line does not split as a shell would ({e}): close its quote, "
                "and quote the whole command line once for the shell (e.g. --megatron-argv \"--num-layers 28 ...\")")
    from .models import megatron_argv_parser

    checker = megatron_argv_parser()
    checker.exit_on_error = False  # a bad value inside the argv: named below, not by the inner parser's own exit
    try:
        checker.parse_known_args(list(argv))
    except argparse.ArgumentError as e:
        p.error(f"--megatron-argv: {e}")
    try:
        model, par, extra = parse_megatron_argv(argv)
    except ValueError as e:
        fix = {"--vocab-size": "add --vocab-size N (the padded vocabulary is computed from it)"}
        hint = next((v for k, v in fix.items() if k in str(e)), "add the missing flags to it")
        p.error(f"--megatron-argv: {e}: {hint}")
    for obj in (model, par):
        for field, flag in ARGV_FLAGS.items():
            value = getattr(obj, field, None)
            low = 0 if field == "num_experts" else 1
            if value is not None and not isinstance(value, bool) and value < low:
                p.error(f"--megatron-argv: {flag} must be >= {low} (got {value})")
    if extra["bucket_size"] is not None and extra["bucket_size"] < 1:
        p.error(f"--megatron-argv: --ddp-bucket-size must be >= 1 (got {extra['bucket_size']})")
    return model, par, extra


def _model_and_parallel(args, p):
    extra = {"overlap_grad_reduce": args.overlap_grad_reduce, "bucket_size": args.bucket_size}
    if args.preset and args.megatron_argv:
        p.error("--preset and --megatron-argv both describe the model: give one")
    if args.megatron_argv:
        model, par, from_argv = _megatron_argv(p, args.megatron_argv)
        extra = {"overlap_grad_reduce": args.overlap_grad_reduce or from_argv["overlap_grad_reduce"],
                 "bucket_size": args.bucket_size or from_argv["bucket_size"]}
    elif args.preset:
        model, par = PRESETS[args.preset], ParallelSpec()
    elif None not in (args.num_layers, args.hidden, args.heads):  # (0 and below: _check names the flag)
        model, par = ModelSpec(args.num_layers, args.hidden, args.ffn or 4 * args.hidden, args.heads,
                               args.query_groups, args.vocab or 32000, num_experts=args.experts or 0,
                               moe_ffn_hidden=args.moe_ffn), ParallelSpec()
    else:
        p.error("no model: give --preset, --megatron-argv, or --num-layers/--hidden/--heads (dmuon plan -h)")
    overrides = {k: getattr(args, k) for k in ("dp", "tp", "pp", "ep", "etp", "nodes") if getattr(args, k) is not None}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    fields = {f: getattr(par, f) for f in ("tp", "pp", "ep", "etp", "dp", "nodes", "gpus_per_node",
                                            "make_vocab_size_divisible_by")}
    fields.update(overrides)
    return model, ParallelSpec(**fields), extra


def _table(report: dict) -> str:
    plans = report["plans"]
    names = list(plans)
    lines = [f"model {report['model']} | stage {report['stage']} | "
             + " ".join(f"{k.upper()} {v}" for k, v in report["parallel"].items())
             + f" | bucket size {report['bucket_size']} | matrices {report['matrices']}",
             "shapes (ms per batched call = launch + k x per-matrix): "
             + ", ".join(f"{s} {v['launch_ms']:.3f}+k*{v['per_matrix_ms']:.3f} ({v['source']})"
                         for s, v in report["shapes"].items()),
             "", "| rank | " + " | ".join(f"{n} ms" for n in names) + " |",
             "|---:|" + "---:|" * len(names)]
    gpus = len(plans[names[0]]["rank_ms"])
    for r in range(gpus):
        lines.append(f"| {r} | " + " | ".join(f"{plans[n]['rank_ms'][r]:.2f}" for n in names) + " |")
    rows = [("makespan ms", "makespan_ms", "{:.2f}"), ("mean ms", "mean_ms", "{:.2f}"),
            ("makespan / mean", "makespan_over_mean", "{:.3f}"),
            ("makespan / lower bound", "makespan_over_lower_bound", "{:.3f}"),
            ("GB reduced per rank", "reduce_bytes_per_rank", "{:.3f}"),
            ("GB published per rank", "publish_bytes_per_rank", "{:.3f}"),
            ("GB exchanged per rank (split: pieces to NS homes and back)", "exchange_bytes_per_rank", "{:.3f}"),
            ("padding GB (grad + param buffers)", "padding_bytes", "{:.3f}"),
            ("optimizer state GB, largest rank", "max_state_bytes", "{:.3f}"),
            ("Megatron AdamW DistOpt state GB per rank", "adamw_distopt_state_bytes_per_rank", "{:.3f}"),
            ("planning s", "plan_seconds", "{:.2f}")]
    lines.append("|---|" + "---:|" * len(names))
    for label, key, fmt in rows:
        scale = 1e-9 if "bytes" in key else 1.0
        lines.append(f"| **{label}** | " + " | ".join(fmt.format(plans[n][key] * scale) for n in names) + " |")
    lines.append(f"\nlower bound max(largest matrix, total / ranks) = {report['lower_bound_ms']:.3f} ms")
    if "milp" in plans and "solver" in plans["milp"]:
        for kind, info in plans["milp"]["solver"].items():
            lines.append(f"MILP ({kind}): {info['backend']}, {info['status']}, {info['seconds']:.2f} s"
                         + (f" ({info['note']})" if info.get("note") else ""))
    if "simulation" in report:
        s = report["simulation"]
        lines.append(f"\nsimulated optimizer step on {s['cluster']} ({s['nodes']} nodes, "
                     f"{'two-level' if s['two_level'] else 'flat'}): {s['optimizer_step_ms']:.1f} ms "
                     f"({s['optimizer_step_overlapped_ms']:.1f} ms with the publish overlapped; "
                     f"publish {s['publish_ms']:.1f} ms, grad reduce {s['grad_reduce_ms']:.1f} ms in backward)")
    if "overlap" in report:
        lines += overlap_lines(report["overlap"])
    return "\n".join(lines)


def overlap_lines(o: dict) -> list:
    """The overlap simulation's lines (``simulate_overlap``'s result)."""
    e, h = o["exposed_ns_ms"], o["hidden_fraction"]
    return [f"\noverlapped owner step (eta {o['eta']:.2f}, model {o['model_tflops']:.0f} TFLOP/s, seq {o['seq_length']} "
            f"x micro-batch {o['micro_batch']}: forward {o['forward_ms']:.1f} ms, backward {o['backward_ms']:.1f} ms "
            f"per micro-batch; {o['need_groups']} need groups, {o['groups_with_ns']} with NS)",
            f"  owner NS: {o['owner_ns_off_ms']:.1f} ms per shape stack, {o['owner_ns_cut_ms']:.1f} ms cut per group "
            f"(+{o['stack_cut_ms']:.1f} ms); first group {o['first_group_ns_ms']:.1f} ms",
            f"  exposed NS per iteration: off {e['off']:.1f} ms | on {e['on']:.1f} ms ({100 * h['on']:.0f}% hidden) | "
            f"on + start in the last backward (--clip-grad 0) {e['on_backward_start']:.1f} ms "
            f"({100 * h['on_backward_start']:.0f}% hidden)",
            f"  iteration of {o['micro_batches']} micro-batches: off {o['iteration_ms']['off']:.0f} ms, on "
            f"{o['iteration_ms']['on']:.0f} ms, on + backward start {o['iteration_ms']['on_backward_start']:.0f} ms "
            f"(compute + element-wise step + exposed NS)"]


def _check(p, args, model: ModelSpec, par: ParallelSpec) -> None:
    """Every number and the layout, before any planning; argparse errors naming the flag (exit 2)."""
    for name in ("dp", "tp", "pp", "ep", "etp", "nodes", "gpus_per_node", "num_layers", "hidden", "ffn", "heads",
                 "query_groups", "vocab", "moe_ffn", "ns_steps", "bucket_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
    if args.experts is not None and args.experts < 0:
        p.error(f"--experts must be >= 0 (got {args.experts})")
    source = "--preset" if args.preset else "--megatron-argv" if args.megatron_argv else None
    if source:  # the shape flags describe a model of their own: with a preset or an argv they were ignored
        shape = [f"--{n.replace('_', '-')}" for n in ("num_layers", "hidden", "ffn", "heads", "query_groups", "vocab",
                                                     "experts", "moe_ffn") if getattr(args, n) is not None]
        if shape:
            p.error(f"the shape flags {', '.join(shape)} would be ignored with {source} (they describe a model of "
                    f"their own): give either {source} or --num-layers/--hidden/--heads ...")
    if not (0 < args.time_limit < float("inf")):
        p.error(f"--time-limit must be a finite number of seconds > 0 (got {args.time_limit})")
    try:
        dp = par.dp_size
    except ValueError as e:
        p.error(f"{e} (--nodes x --gpus-per-node must be a multiple of --tp x --pp)")
    if dp < 1:
        p.error(f"--dp must be >= 1 (got {dp})")
    if not 0 <= args.stage < par.pp:
        p.error(f"--stage {args.stage} must be a pipeline stage in [0, --pp) = [0, {par.pp})")
    for what, size in (("attention heads", model.heads), ("query groups", model.groups), ("FFN width", model.ffn_hidden)):
        if size % par.tp:
            p.error(f"--tp {par.tp} must divide the model's {what} ({size})")
    if model.num_layers % par.pp:
        p.error(f"--pp {par.pp} must divide the model's {model.num_layers} layers")
    expert_flags = [f"--{n} {v}" for n, v in (("ep", par.ep), ("etp", par.etp)) if (v or 1) > 1]
    if not model.num_experts and expert_flags:
        p.error(f"{' and '.join(expert_flags)}: expert parallelism needs a MoE model (--experts N, a MoE preset or "
                "--num-experts in --megatron-argv)")
    if model.num_experts:
        if model.num_experts % par.ep:
            p.error(f"--ep {par.ep} must divide the model's {model.num_experts} experts")
        try:
            par.expert_dp_size
        except ValueError as e:
            p.error(f"--ep x --etp must divide --dp x --tp: {e}")
    if args.overlap_eta is not None and not 0.0 <= args.overlap_eta <= 1.0:
        p.error(f"--overlap-eta must be in [0, 1] (got {args.overlap_eta})")
    for name in ("seq_length", "micro_batch_size", "micro_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.model_tflops is not None and not 0 < args.model_tflops < float("inf"):
        p.error(f"--model-tflops must be a finite number > 0 (got {args.model_tflops})")
    if args.global_batch < 1:
        p.error(f"--global-batch must be >= 1 (got {args.global_batch})")
    for n in args.instances or ():
        if n < 1 or dp % n:
            p.error(f"--instances {n} must be >= 1 and divide DP = {dp} (each instance shards the optimizer over "
                    "DP / instances ranks)")
    if OverlapMode(args.overlap_step).overlaps and model.num_experts:
        p.error("--overlap-step on: the compute model covers dense GPTs only (no --experts)")


def _cost_inputs(p, args):
    """(cluster config, cluster, measured profile or None), each refused by its flag's name when it
    does not read."""
    try:
        config = load_config(args.config)
        if not isinstance(config, dict) or not {"clusters", "devices", "optimizer"} <= set(config):
            raise ValueError("needs the sections clusters, devices and optimizer (see planning/clusters.json)")
    except (OSError, ValueError) as e:
        p.error(f"--config {args.config}: not a readable cluster config JSON ({type(e).__name__}: {e})")
    try:
        cluster = cluster_spec(args.cluster, config)
    except (KeyError, ValueError, TypeError) as e:
        p.error(f"--cluster {args.cluster}: {e}")
    try:
        table = load_profile(args.profile, args.ns_steps) if args.profile else None
    except BadProfile as e:
        p.error(f"--profile {args.profile}: {e}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        p.error(f"--profile {args.profile}: not a CostTable, a one-entry profile cache or a kernel benchmark JSON "
                f"({type(e).__name__}: {e})")
    return config, cluster, table


# the flags that name a file dmuon plan reads
FILE_FLAGS = (("--show", "show"), ("--config", "config"), ("--profile", "profile"), ("--rank-model", "rank_model"))


def _refuse_files_that_are_not_files(p, args) -> None:
    """A device, FIFO or socket, or a file too large for what the flag takes, named before anything
    reads it (``--rank-model /dev/zero`` was read until the OOM killer ended it: [bad-input-5]). A
    missing path or a directory is named by the flag's own reader."""
    from ..files import check_regular_file

    for flag, dest in FILE_FLAGS:
        path = getattr(args, dest, None)
        if path and not (dest == "rank_model" and path == "analytic") and os.path.exists(path) \
                and not os.path.isdir(path):
            try:
                check_regular_file(path, flag)
            except ValueError as e:
                p.error(str(e))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _refuse_files_that_are_not_files(parser, args)
    if args.show:
        try:
            print(show_plan(args.show, args.json))
        except ValueError as e:
            parser.error(f"--show {args.show}: {e}")
        return 0
    model, par, extra = _model_and_parallel(args, parser)
    _check(parser, args, model, par)
    if OverlapMode(args.overlap_step).overlaps:  # Megatron's --overlap-param-gather needs --overlap-grad-reduce's buckets
        args.simulate = True
        extra["overlap_grad_reduce"] = True
    config, cluster, table = _cost_inputs(parser, args)
    rank_model = None
    if args.rank_model:  # read before any planning: a file that is no rank model fails at once
        try:
            rank_model = load_rank_model(args.rank_model, config, cluster.device.name, args.ns_steps, args.ns_method)
        except OSError as e:
            parser.error(f"--rank-model {args.rank_model}: cannot be read ({e.strerror or e}); give {RANK_MODEL_KINDS}")
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            parser.error(f"--rank-model {args.rank_model}: {why}")
    cost_model = CostModel(cluster.device, table, args.ns_steps, args.ns_method)
    milp_options = {"backend": args.backend, "time_limit_s": args.time_limit}
    plans = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = compare_plans(model, par, cost_model, planners=args.planners, stage=args.stage,
                               overlap_grad_reduce=extra["overlap_grad_reduce"], bucket_size=extra["bucket_size"],
                               milp_options=milp_options, grad_bytes=config["optimizer"]["grad_bytes"],
                               param_bytes=4 if args.fp32_params else config["optimizer"]["param_bytes"],
                               momentum_bytes=MOMENTUM_DTYPES[args.dmuon_momentum_dtype].itemsize, plans_out=plans)
        if args.simulate:
            from .simulate import predict_optimizer_step

            planner = "milp" if "milp" in args.planners else args.planners[-1]
            report["simulation"] = predict_optimizer_step(
                model, par, cluster, cost_model, planner=planner, two_level=not args.flat,
                optimizer=config["optimizer"], stage=args.stage, plan=plans[planner])
            if OverlapMode(args.overlap_step).overlaps:
                from .simulate_overlap import DEFAULT_ETA, simulate_overlap

                report["overlap"] = simulate_overlap(
                    model, par, cluster, cost_model, plan=plans[planner], planner=planner, two_level=not args.flat,
                    config=config, stage=args.stage, eta=DEFAULT_ETA if args.overlap_eta is None else args.overlap_eta,
                    seq_length=args.seq_length, micro_batch=args.micro_batch_size, micro_batches=args.micro_batches,
                    tflops=args.model_tflops)
        if args.rank_model:
            import functools

            from .cost_model import elementwise_costs
            from .owner_layout import megatron_bucket_size
            from .ns_choice import NSResolver, owner_ns_cost
            from .planners import compare_rank_plans

            split = dict(split_qkv=args.split_qkv or args.dmuon_split_heads, split_glu=args.dmuon_split_glu,
                         per_head=args.dmuon_split_heads)
            report["owner_step"] = compare_rank_plans(
                model, par, rank_model, split=split, stage=args.stage, milp_options=milp_options,
                bucket_size=megatron_bucket_size(par.dp_size, extra["overlap_grad_reduce"], extra["bucket_size"],
                                                 pp_rank=args.stage),
                elementwise=elementwise_costs(cluster.device, config=config),
                cost_fn=functools.partial(owner_ns_cost, resolver=NSResolver(
                    args.ns_method, coefficients=args.dmuon_coefficients, steps=args.ns_steps)))
            report["owner_step"]["split"] = split
        if not model.num_experts or args.dp_layouts:  # (the DP layouts cover dense buffers)
            report["dp_layouts"] = compare_dp_layouts(
                model, par, cost_model, cluster, config["optimizer"], instances=args.instances, stage=args.stage,
                overlap_grad_reduce=True if extra["bucket_size"] is None else extra["overlap_grad_reduce"],
                bucket_size=extra["bucket_size"], two_level=not args.flat,
                param_bytes=4 if args.fp32_params else None,
                momentum_bytes=MOMENTUM_DTYPES[args.dmuon_momentum_dtype].itemsize, seq_length=args.seq_length,
                global_batch=args.global_batch,
                split=dict(split_qkv=args.split_qkv or args.dmuon_split_heads, split_glu=args.dmuon_split_glu,
                           per_head=args.dmuon_split_heads),
                overlapped_step=OverlapMode(args.overlap_step).cuts_per_need_group, ns_method=args.ns_method,
                shared_ns=args.ns_teams == "auto")
    report["warnings"] = sorted({str(w.message) for w in caught})
    report["cost_model"] = {"device": cluster.device.name, "profile": args.profile, "ns_method": args.ns_method,
                            "steps": args.ns_steps, "tflops_for_unprofiled_shapes": cost_model.tflops}
    if args.plot:
        from .plan_plot import plot_report

        try:
            plot_report(report, args.plot)
        except (OSError, ValueError) as e:
            parser.error(f"--plot {args.plot}: {getattr(e, 'strerror', None) or e}")
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print(_table(report))
        if "owner_step" in report:
            print("\n".join(_rank_lines(report["owner_step"])))
        if "dp_layouts" in report:
            print("\n".join(dp_layout_lines(report["dp_layouts"])))
        for w in report["warnings"]:
            print(f"warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
