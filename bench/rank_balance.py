"""Each rank's owner step, emulated one rank at a time on one GPU, under several owner plans; and
the calibration grid the rank cost model is checked against.

The DP ranks of a DMuon job each run an owner step: Newton-Schulz and Muon's element-wise passes
on the matrices they own, AdamW on the element-wise params inside their shard of every bucket
(equal shards: a rank that owns fewer matrix elements steps more AdamW ones). The slowest rank
sets the step time. ``emulate`` builds, for every GPU of a layout under every plan, exactly that
GPU's tensors (the owned matrices at full shape with the optimizer's split rules, dense and expert
buffers; the AdamW fragments inside its shards) in one ``OwnerMuonAdamW`` with the main job's
settings and times its ``step()`` (``runtime.ns_timing.time_owner_step``: CUDA events, median).
GPUs with the same work (the same matrices, AdamW elements within 1 M and the same fragment
count) are timed once. Rounds interleave every (plan, GPU): each round is one run of every plan.
No communication is timed: it is the same for every rank of a layout.

``calibrate`` times synthetic ranks: k matrices of one shape (every shape the layouts hold), AdamW
alone, and mixtures: the data the rank cost model (planning/rank_cost.py) is fitted on.

    python bench/rank_balance.py emulate --layouts qwen2.5-7b/dp8/one qwen7b-4l/dp2/buckets --out STEM
    python bench/rank_balance.py calibrate --layouts ... --out STEM

Layouts: PRESET/dpN[/epE]/(buckets|one): ``buckets`` = Megatron's buckets with
``--overlap-grad-reduce`` (max(40 M, 1 M x DP) elements), ``one`` = one bucket per buffer.
Plans: ``planning.plans.plan_stage`` planners (greedy = ``--dmuon-balance cost`` with pieces and
element-wise work; numel_lpt; megatron_lpt; milp on the rank cost model of ``--rank-profile``).
Writes STEM.json and a markdown table STEM.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dmuon.megatron.config import DMuonConfig  # noqa: E402
from megatron_dmuon.megatron.flags import add_dmuon_args  # noqa: E402
from megatron_dmuon.planning.cost_model import device_spec, elementwise_costs  # noqa: E402
from megatron_dmuon.planning.models import PRESETS, ParallelSpec  # noqa: E402
from megatron_dmuon.planning.owner_layout import megatron_bucket_size  # noqa: E402
from megatron_dmuon.planning.params import owner_ns_cost  # noqa: E402
from megatron_dmuon.planning.plans import gpu_cells, plan_stage, split_rule_for, transformer_shape  # noqa: E402
from megatron_dmuon.planning.simulate import adamw_fragments_in_shard  # noqa: E402
from megatron_dmuon.runtime.ns_timing import time_owner_step  # noqa: E402

PLANS = ("greedy", "numel_lpt", "megatron_lpt", "milp")


def job_settings(flags):
    parser = add_dmuon_args(argparse.ArgumentParser(), validate=False)
    return DMuonConfig.from_args(parser.parse_args(flags))


def parse_layout(spec: str):
    """'qwen2.5-7b/dp8/ep4/one' -> (model, ParallelSpec, bucket size or None)."""
    parts = spec.split("/")
    if parts[0] not in PRESETS or parts[-1] not in ("buckets", "one"):
        raise ValueError(f"layout {spec!r}: PRESET/dpN[/epE]/(buckets|one), presets {', '.join(sorted(PRESETS))}")
    fields = {p[:2]: int(p[2:]) for p in parts[1:-1]}
    if set(fields) - {"dp", "ep"}:
        raise ValueError(f"layout {spec!r}: only dpN and epE (TP is not emulated here)")
    par = ParallelSpec(dp=fields["dp"], ep=fields.get("ep", 1))
    size = megatron_bucket_size(par.dp_size, parts[-1] == "buckets")
    return PRESETS[parts[0]], par, size


def make_plans(model, par, bucket_size, cfg, planners, rank_profile=None, milp_options=None):
    muon = cfg.muon
    cost_fn = functools.partial(owner_ns_cost, coefficients=muon.coefficients, steps=muon.ns_steps,
                                ns_method=muon.ns_method)
    split = cfg.split_flags()
    out = {}
    for name in planners:
        kw = dict(bucket_size=bucket_size, cost_fn=cost_fn, split=split)
        if name in ("greedy", "milp"):  # the milp's greedy warm start is exactly the greedy plan
            kw["elementwise"] = elementwise_costs(device_spec("H200"))
        if name == "milp":
            if rank_profile is None:
                raise ValueError("the milp plan needs --rank-profile (a calibrate run's rank cost model)")
            kw.update(rank_model=rank_profile, milp_options=dict(milp_options or {}))
        t0 = time.perf_counter()
        out[name] = plan_stage(model, par, None, name, **kw)
        out[name]["plan_s"] = time.perf_counter() - t0
    return out


def gpu_work(plan, model, par, split):
    """Per GPU of the stage: (owned matrices [(name, full shape, split rule)], AdamW fragment sizes)."""
    config = transformer_shape(model)
    gpus = par.dp_size * par.tp
    out = []
    for r in range(gpus):
        mats, frags = [], []
        for kind, layout in plan["layouts"].items():
            params = plan["params"][kind]
            cell = gpu_cells(par, r)[kind]
            dp, tp = divmod(cell, layout.tp_size)
            for p in params:
                if p.is_matrix and layout.owners[p.name] == dp and layout.tp_owners.get(p.name, 0) == tp:
                    mats.append((p.name, tuple(p.full_shape), split_rule_for(p.name, p.full_shape, config, split)))
            frags += adamw_fragments_in_shard(layout, params, dp)
        out.append((mats, frags))
    return out


def pieces_of(mats):
    """Counter of the NS piece shapes (m, n), m <= n, a rank's matrices give."""
    c = Counter()
    for _, shape, rule in mats:
        for s in ([shape] if rule is None else rule.piece_shapes(shape)):
            k = 1 if len(s) == 2 else s[0]
            m, n = s[-2:]
            c[(min(m, n), max(m, n))] += k
    return c


def signature(mats, frags):
    return (tuple(sorted((shape, tuple(map(tuple, rule.piece_shapes(shape))) if rule else ())
                         for _, shape, rule in mats)), round(sum(frags) / 1e6), len(frags))


def describe(mats, frags):
    return {"pieces": {f"{m}x{n}": k for (m, n), k in sorted(pieces_of(mats).items())},
            "matrices": len(mats), "muon_elements": sum(s[0] * s[1] for _, s, _ in mats),
            "adamw_elements": sum(frags), "fragments": len(frags)}


def time_all(jobs, cfg, rounds, iters, warmup, device, log):
    """jobs: {key: (mats, frags)}; returns {key: [median ms per round]}; interleaved rounds."""
    times = {k: [] for k in jobs}
    for rnd in range(rounds):
        for key, (mats, frags) in jobs.items():
            t0 = time.perf_counter()
            ms, _ = time_owner_step(mats, frags, cfg.muon, iters=iters, warmup=warmup, device=device)
            times[key].append(ms)
            log({"round": rnd, "job": str(key), "ms": round(ms, 3), "wall_s": round(time.perf_counter() - t0, 2)})
    return times


def emulate(args, cfg, log):
    result = {"layouts": {}}
    for spec in args.layouts:
        model, par, size = parse_layout(spec)
        plans = make_plans(model, par, size, cfg, args.plans, args.rank_profile and load_rank_model(args.rank_profile),
                           {"time_limit_s": args.milp_time_limit})
        sigs, jobs, per_plan = {}, {}, {}
        for name, plan in plans.items():
            ranks = []
            for r, (mats, frags) in enumerate(gpu_work(plan, model, par, cfg.split_flags())):
                sig = signature(mats, frags)
                if sig not in sigs:
                    sigs[sig] = len(sigs)
                    jobs[sigs[sig]] = (mats, frags)
                ranks.append(dict(describe(mats, frags), gpu=r, job=sigs[sig]))
            per_plan[name] = {"ranks": ranks, "plan_s": plan["plan_s"], "info": plan["info"],
                              "predicted": [c for layout in plan["layouts"].values() for c in layout.rank_cost]}
        log({"layout": spec, "plans": list(plans), "gpus": par.dp_size * par.tp, "distinct_ranks": len(jobs)})
        times = time_all(jobs, cfg, args.rounds, args.iters, args.warmup, args.device, log)
        for name, row in per_plan.items():
            for x in row["ranks"]:
                x["ms_rounds"] = times[x["job"]]
                x["ms"] = statistics.median(x["ms_rounds"])
            slowest_rounds = [max(x["ms_rounds"][i] for x in row["ranks"]) for i in range(args.rounds)]
            row["slowest_rounds"] = slowest_rounds
            row["slowest_ms"] = statistics.median(slowest_rounds)
            row["spread_ms"] = max(x["ms"] for x in row["ranks"]) - min(x["ms"] for x in row["ranks"])
        result["layouts"][spec] = {"plans": per_plan, "bucket_size": size, "dp": par.dp_size, "ep": par.ep,
                                   "jobs": {k: describe(*v) | {"fragment_sizes": v[1]} for k, v in jobs.items()}}
    return result


def calibration_jobs(args, cfg):
    """Synthetic ranks: every piece shape of the layouts at a grid of counts up to the most any
    plan gives one rank (Muon only); AdamW alone at several sizes; and mixtures."""
    most = Counter()
    for spec in args.layouts:
        model, par, size = parse_layout(spec)
        for plan in make_plans(model, par, size, cfg, [p for p in args.plans if p != "milp"]).values():
            for mats, _ in gpu_work(plan, model, par, cfg.split_flags()):
                for shape, k in pieces_of(mats).items():
                    most[shape] = max(most[shape], k)
    grid = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    jobs = {}
    for shape, top in sorted(most.items()):
        for k in sorted({k for k in grid if k < top} | {top}):
            jobs[f"ns|{shape[0]}x{shape[1]}|{k}"] = ([(f"cal.{i}", shape, None) for i in range(k)], [])
    for millions in args.adamw_sizes:
        jobs[f"adamw|{millions}M|1"] = ([], [int(millions * 1e6)])
        if millions * 1e6 > 2 * 99 * 4096:  # the same elements in 100 fragments (a shard's norms and biases)
            jobs[f"adamw|{millions}M|100"] = ([], [int(millions * 1e6) - 99 * 4096] + [4096] * 99)
    big = max(most, key=lambda s: s[0] * s[1] * s[1]) if most else None
    for shape in ([big] if big else []) + [s for s in most if s != big][:1]:
        for millions in args.adamw_sizes[1::2]:
            jobs[f"mix|{shape[0]}x{shape[1]}|{min(4, most[shape])}|{millions}M"] = (
                [(f"cal.{i}", shape, None) for i in range(min(4, most[shape]))], [int(millions * 1e6)])
    return jobs


def calibrate(args, cfg, log):
    jobs = calibration_jobs(args, cfg)
    log({"calibration_jobs": len(jobs)})
    times = time_all(jobs, cfg, args.rounds, args.iters, args.warmup, args.device, log)
    return {"jobs": {k: describe(*jobs[k]) | {"ms_rounds": times[k], "ms": statistics.median(times[k])} for k in jobs}}


def load_rank_model(path):
    """A rank cost model JSON, a start-up profile cache, or a calibrate run's JSON."""
    from megatron_dmuon.planning.cost_model import load_config
    from megatron_dmuon.planning.plan_cli import load_rank_model as load

    return load(path, load_config(), "H200")


def table(result):
    lines = []
    for spec, lay in result.get("layouts", {}).items():
        lines += [f"## {spec} (bucket size {lay['bucket_size']})", "",
                  "| plan | slowest GPU ms (median of rounds) | rounds | spread ms | distinct ranks | plan s |",
                  "|---|---:|---|---:|---:|---:|"]
        for name, row in lay["plans"].items():
            lines.append(f"| {name} | **{row['slowest_ms']:.2f}** | {', '.join(f'{x:.2f}' for x in row['slowest_rounds'])} "
                         f"| {row['spread_ms']:.2f} | {len({x['job'] for x in row['ranks']})} | {row['plan_s']:.1f} |")
        lines.append("")
    if "jobs" in result:
        lines += ["| calibration rank | ms |", "|---|---:|"] + [f"| {k} | {v['ms']:.3f} |" for k, v in result["jobs"].items()]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["emulate", "calibrate"])
    parser.add_argument("--layouts", nargs="+", default=["qwen7b-4l/dp2/buckets"])
    parser.add_argument("--plans", nargs="+", default=["greedy", "numel_lpt", "megatron_lpt"], choices=PLANS)
    parser.add_argument("--rank-profile", help="a rank cost model JSON (planning/rank_cost.py) for the milp plan")
    parser.add_argument("--milp-time-limit", type=float, default=20.0)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every (plan, GPU), interleaved")
    parser.add_argument("--adamw-sizes", type=float, nargs="+", default=[1, 10, 50, 150, 400, 800],
                        help="calibrate: AdamW-only ranks of these many million elements")
    parser.add_argument("--flags", default="--dmuon-coefficients adaptive --dmuon-ns-launch graph",
                        help="the main job's dmuon flags, one string (--flags='...')")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    flags = args.flags.split()
    cfg = job_settings(flags)
    out_log = open(args.out + ".log.jsonl", "a") if args.out else None

    def log(obj):
        line = json.dumps(obj)
        print(line, flush=True)
        if out_log:
            out_log.write(line + "\n")
            out_log.flush()

    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    head = {"device": name, "flags": flags, "mode": args.mode, "rounds": args.rounds, "iters": args.iters,
            "warmup": args.warmup, "torch": torch.__version__}
    result = head | (emulate(args, cfg, log) if args.mode == "emulate" else calibrate(args, cfg, log))
    text = table(result)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))
        Path(args.out + ".md").write_text(f"# {args.mode} on one {name} ({args.flags})\n\n" + text + "\n")


if __name__ == "__main__":
    main()
