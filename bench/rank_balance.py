"""Each DP rank's owner step, emulated one rank at a time on one GPU, under several owner plans.

The DP ranks of a DMuon job each run an owner step: Newton-Schulz and Muon's element-wise passes
on the matrices they own, AdamW on the element-wise params inside their shard of every bucket
(equal shards: a rank that owns fewer matrix elements steps more AdamW ones). The slowest rank
sets the step time. This builds, for every DP rank of a plan, exactly that rank's tensors
(the owned matrices at their full shapes with the optimizer's split rules; the AdamW fragments
that fall inside its shards) in one ``OwnerMuonAdamW`` with the main job's settings, and times its
``step()`` (CUDA events, median over iterations) rank after rank on the one GPU. No communication
is timed: it is the same for every rank.

Plans (``planning.plans.plan_stage`` with the job's NS cost function and bucket size):

* ``ns_whole``: the planner before this change: NS cost of whole matrices only;
* ``pieces_elementwise``: what the job plans now: NS of the pieces the optimizer orthogonalizes
  (QKV split) plus the element-wise work the layout gives each rank
  (``planning.cost_model.elementwise_costs``);
* ``megatron_lpt``: Megatron-LM main's layer-sharded Muon's rule (LPT on max(m,n)·min(m,n)²),
  the baseline every other public Muon balances by;
* ``milp_elementwise`` (``--milp``): ``--dmuon-balance milp`` on the measured H200 NS profile
  (docs/results/kernels/bench_kernels_h200_2026-11-30.json; shapes it lacks analytic), pieces and element-wise work in ms.

    python bench/rank_balance.py [--preset qwen7b-4l] [--dp 2] [--iters 12] [--out STEM]

Prints JSON lines and a markdown table (per rank ms, the planner's prediction, owned elements).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dmuon.algorithms.splitting import rule_for_megatron_param  # noqa: E402
from megatron_dmuon.megatron.config import DMuonConfig  # noqa: E402
from megatron_dmuon.megatron.flags import add_dmuon_args  # noqa: E402
from megatron_dmuon.planning.cost_model import (CostModel, device_spec, elementwise_costs,  # noqa: E402
                                                load_bench_kernels_profile)
from megatron_dmuon.planning.models import PRESETS, ParallelSpec  # noqa: E402
from megatron_dmuon.planning.params import owner_ns_cost  # noqa: E402
from megatron_dmuon.planning.plans import plan_stage, transformer_shape  # noqa: E402
from megatron_dmuon.planning.simulate import adamw_fragments_in_shard  # noqa: E402
from megatron_dmuon.runtime.owner_step import MatrixInfo, OwnerMuonAdamW  # noqa: E402


def job_settings(flags):
    parser = add_dmuon_args(argparse.ArgumentParser(), validate=False)
    return DMuonConfig.from_args(parser.parse_args(flags))


def plans_for(model, dp, bucket_size, cfg, milp=False):
    muon = cfg.muon
    cost_fn = functools.partial(owner_ns_cost, coefficients=muon.coefficients, steps=muon.ns_steps,
                                ns_method=muon.ns_method)
    split = cfg.split_flags()
    elementwise = elementwise_costs(device_spec("H200"))
    par = ParallelSpec(dp=dp)
    plans = {
        "ns_whole": plan_stage(model, par, None, "greedy", bucket_size=bucket_size, cost_fn=cost_fn),
        "pieces_elementwise": plan_stage(model, par, None, "greedy", bucket_size=bucket_size, cost_fn=cost_fn,
                                    split=split, elementwise=elementwise),
        # Megatron-LM main's layer-sharded Muon: LPT on max(m,n)·min(m,n)² of whole matrices
        "megatron_lpt": plan_stage(model, par, None, "megatron_lpt", bucket_size=bucket_size, cost_fn=cost_fn,
                                   split=split),
    }
    if milp:
        h200 = device_spec("H200")
        profile = CostModel(h200, load_bench_kernels_profile(ROOT / "docs/results/kernels/bench_kernels_h200_2026-11-30.json"))
        plans["milp_elementwise"] = plan_stage(model, par, profile, "milp", bucket_size=bucket_size, split=split,
                                          elementwise=elementwise_costs(h200, "ms"),
                                          milp_options={"time_limit_s": 20.0})
    return plans


def rank_tensors(plan, rank):
    """(owned matrices [(name, full shape)], AdamW fragment sizes) of one DP rank (dense buffer)."""
    layout, params = plan["layouts"]["dense"], plan["params"]["dense"]
    owned = [(p.name, tuple(p.full_shape)) for p in params if p.is_matrix and layout.owners[p.name] == rank]
    fragments = adamw_fragments_in_shard(layout, params, rank)
    return owned, fragments


def time_rank(owned, fragments, model, cfg, iters, warmup=3, device="cuda"):
    config = transformer_shape(model)
    gen = torch.Generator(device=device).manual_seed(0)
    muon, infos = [], []
    for name, shape in owned:
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(shape, device=device, generator=gen) * 1e-3
        muon.append(p)
        rule = rule_for_megatron_param(name, shape, config, **cfg.split_flags()) if any(cfg.split_flags().values()) \
            else None
        infos.append(MatrixInfo(name, shape, rule))
    adamw = []
    for n in fragments:
        p = torch.nn.Parameter(torch.randn(n, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(n, device=device, generator=gen) * 1e-3
        adamw.append(p)
    groups = [{"params": muon, "use_muon": True}] + ([{"params": adamw, "use_muon": False}] if adamw else [])
    opt = OwnerMuonAdamW(groups, lr=1e-4, weight_decay=0.1, muon=cfg.muon)
    for p, info in zip(muon, infos):
        opt.register_matrix(p, info)
    times = []
    for it in range(warmup + iters):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            begin.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            ms = begin.elapsed_time(end)
        else:  # a CPU smoke run of the script (no timing claims)
            t0 = time.perf_counter()
            opt.step()
            ms = (time.perf_counter() - t0) * 1e3
        if it >= warmup:
            times.append(ms)
    del opt, muon, adamw
    if device == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen7b-4l", choices=sorted(PRESETS))
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=40_000_000,
                        help="Megatron's bucket with --overlap-grad-reduce (max(40M, 1M x DP)); 0: one bucket "
                             "per buffer (no --overlap-grad-reduce)")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every (plan, rank), interleaved")
    parser.add_argument("--flags", default="--dmuon-coefficients adaptive --dmuon-ns-launch graph",
                        help="the main job's dmuon flags, one string (--flags='...')")
    parser.add_argument("--milp", action="store_true", help="also the MILP plan on the measured H200 profile")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    flags = args.flags.split()
    cfg = job_settings(flags)
    model = PRESETS[args.preset]
    plans = plans_for(model, args.dp, args.bucket_size or None, cfg, args.milp)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    result = {"device": name, "preset": args.preset, "dp": args.dp, "flags": flags, "bucket_size": args.bucket_size,
              "plans": {}}
    samples = {(name, r): [] for name in plans for r in range(args.dp)}
    for _ in range(args.rounds):
        for name, plan in plans.items():
            for r in range(args.dp):
                owned, fragments = rank_tensors(plan, r)
                ms, _ = time_rank(owned, fragments, model, cfg, args.iters, device=args.device)
                samples[name, r].append(ms)
                print(json.dumps({"plan": name, "rank": r, "ms": ms}), flush=True)
    for name, plan in plans.items():
        layout = plan["layouts"]["dense"]
        rows = []
        for r in range(args.dp):
            owned, fragments = rank_tensors(plan, r)
            rows.append({"rank": r, "ms": statistics.median(samples[name, r]), "rounds": samples[name, r],
                         "muon_elements": sum(s[0] * s[1] for _, s in owned), "adamw_elements": sum(fragments),
                         "matrices": len(owned), "planner_load": layout.rank_cost[r]})
        result["plans"][name] = {"ranks": rows, "slowest_ms": max(x["ms"] for x in rows),
                                 "spread_ms": max(x["ms"] for x in rows) - min(x["ms"] for x in rows)}
    lines = [f"# Owner step per DP rank, emulated on one {result['device']} ({args.preset}, DP={args.dp}, "
             f"{args.flags})", "",
             "| plan | rank | owner step ms | Muon elements (M) | AdamW elements (M) | matrices | planner load |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, row in result["plans"].items():
        for x in row["ranks"]:
            lines.append(f"| {name} | {x['rank']} | {x['ms']:.2f} | {x['muon_elements'] / 1e6:.1f} | "
                         f"{x['adamw_elements'] / 1e6:.1f} | {x['matrices']} | {x['planner_load']:.3g} |")
        lines.append(f"| {name} | slowest | **{row['slowest_ms']:.2f}** | spread {row['spread_ms']:.2f} ms | | | |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))
        Path(args.out + ".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
