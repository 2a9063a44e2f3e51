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

``calibrate`` times synthetic ranks: k matrices of one shape (every shape the layouts hold, at a
grid of counts), two shapes together, AdamW alone, and Muon beside AdamW: a dense version of the
start-up rank profile's points (runtime/rank_profile.py), which the rank cost model
(planning/rank_cost.py) is fitted on. ``startup`` does what rank 0 of a ``--dmuon-balance milp``
job does per layout (rank profile within the budget, then the MILP) and keeps the models it
planned on; ``emulate --rank-profile STARTUP.json`` plans ``milp`` on them. ``report`` (CPU) sets
each model's predicted slowest GPU against the emulated one.

    python bench/rank_balance.py calibrate --layouts ... --out cal
    python bench/rank_balance.py startup --layouts ... --out start
    python bench/rank_balance.py emulate --layouts qwen2.5-7b/dp8/one qwen7b-4l/dp2/buckets \
        --plans greedy numel_lpt megatron_lpt milp --rank-profile start.json --out emu
    python bench/rank_balance.py report --emulation emu.json --models startup=start.json calibration=cal.json
    python bench/rank_balance.py check --emulation emu.json --models startup=start.json [--refit-points CACHE.json \
        --refit-on emu*.json]

Layouts: PRESET/dpN[/epE]/(buckets|one): ``buckets`` = Megatron's buckets with
``--overlap-grad-reduce`` (max(40 M, 1 M x DP) elements), ``one`` = one bucket per buffer.
Plans: ``planning.planners.plan_stage`` planners (greedy = ``--dmuon-balance cost`` with pieces and
element-wise work; numel_lpt; megatron_lpt; milp on the rank cost model of ``--rank-profile``).
Writes STEM.json and a markdown table STEM.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dmuon.planning.cost_model import cluster_spec  # noqa: E402
from megatron_dmuon.planning.models import stage_params  # noqa: E402
from megatron_dmuon.planning.planners import split_rule_for, transformer_shape  # noqa: E402
from megatron_dmuon.planning.rank_cost import RankWork  # noqa: E402
from megatron_dmuon.runtime.ns_timing import time_owner_step  # noqa: E402
from megatron_ranks import adamw_work, megatron_layerwise_work, time_adamw_rank, time_megatron_rank  # noqa: E402
from cli_inputs import OneLineParser, check_device, read_json  # noqa: E402
from rank_scale import scale, scale_plot, scale_table  # noqa: E402
from rank_layouts import (ADAMW, BASELINES, MEGATRON, PLANS, describe, gpu_work, job_settings,  # noqa: E402
                          make_plans, parse_layout, pieces_of, shard_signature, signature, split_cell_work,
                          tp_cell_work)


def time_all(jobs, cfg, rounds, iters, warmup, device, log):
    """jobs: {key: (mats, frags) or {mats, frags, shards (a TP cell's), runner (MEGATRON, ADAMW or
    None: DMuon's owner step), model}}; returns {key: [median ms per round]}; interleaved rounds."""
    times = {k: [] for k in jobs}
    jobs = {k: job if isinstance(job, dict) else {"mats": job[0], "frags": job[1]} for k, job in jobs.items()}
    if rounds == 0:  # --dry-run: what would be timed
        stacks = {(s, k) for job in jobs.values() for s, k in pieces_of(job["mats"]).items()}
        elements = max((sum(s[0] * s[1] for _, s, _ in job["mats"]) + sum(job["frags"]) + sum(job.get("shards", ()))
                        for job in jobs.values()), default=0)
        log({"jobs": len(jobs), "distinct_stacks": len(stacks), "largest_rank_elements_M": round(elements / 1e6)})
        return {k: [0.0] for k in jobs}
    for rnd in range(rounds):
        for key, job in jobs.items():
            mats, frags = job["mats"], job["frags"]
            t0 = time.perf_counter()
            if job.get("runner") == MEGATRON:  # a GPU of Megatron's LayerWise Muon
                ms, _ = time_megatron_rank(mats, frags, job["model"], iters=iters, warmup=warmup, device=device)
            elif job.get("runner") == ADAMW:
                ms, _ = time_adamw_rank(frags, iters=iters, warmup=warmup, device=device)
            else:
                ms, _ = time_owner_step(mats, frags, cfg.muon, iters=iters, warmup=warmup, device=device,
                                        tp_shards=job.get("shards", ()), team_blocks=job.get("blocks", ()))
            times[key].append(ms)
            log({"round": rnd, "job": str(key), "ms": round(ms, 3), "wall_s": round(time.perf_counter() - t0, 2)})
    return times


def emulate(args, cfg, log):
    result = {"layouts": {}}
    for spec in args.layouts:
        model, par, size = parse_layout(spec)
        rank_model = load_rank_model(args.rank_profile, spec) if args.rank_profile else None
        dmuon_plans = [p for p in args.plans if p not in BASELINES]
        plans = make_plans(model, par, size, cfg, dmuon_plans, rank_model, {"time_limit_s": args.milp_time_limit})
        work = {name: gpu_work(plan, model, par, cfg.split_flags()) for name, plan in plans.items()}
        if ADAMW in args.plans and par.tp == 1:
            work[ADAMW] = adamw_work(model, par)
            plans[ADAMW] = {"plan_s": 0.0, "info": {}, "layouts": {}}
        if set(BASELINES) & set(args.plans) and par.tp > 1:
            log({"layout": spec, "skipped": BASELINES, "why": "Megatron's steps are emulated at TP = 1 only"})
        elif MEGATRON in args.plans:
            t0 = time.perf_counter()
            lpt = plans["megatron_lpt"] if "megatron_lpt" in plans else make_plans(model, par, size, cfg, ["megatron_lpt"])["megatron_lpt"]
            work[MEGATRON] = megatron_layerwise_work(model, par, [m for m, _ in gpu_work(lpt, model, par, cfg.split_flags())])
            plans[MEGATRON] = {"plan_s": time.perf_counter() - t0, "info": {}, "layouts": {}}
        sigs, jobs, per_plan = {}, {}, {}
        for name, plan in plans.items():
            ranks = []
            cells = (split_cell_work(plan, par) if name == "split" else
                     tp_cell_work(plan, par) if par.tp > 1 and name not in BASELINES else None)
            for r, (mats, frags) in enumerate(work[name]):
                shards, exchange_ms, *blocks = cells[r] if cells else ([], 0.0)
                # (blocks of one shape within 256 of the long side time alike: one job for them)
                blocks = sorted((r_, c_, (e_ - f_) // 256 * 256 or e_ - f_) for r_, c_, f_, e_ in (blocks[0] if blocks else ()))
                runner = name if name in BASELINES else None
                sig = (runner, shard_signature(shards), tuple(blocks)) + signature(mats, frags)
                if sig not in sigs:
                    sigs[sig] = len(sigs)
                    jobs[sigs[sig]] = {"mats": mats, "frags": frags, "shards": shards, "runner": runner,
                                       "model": model, "blocks": [(r_, c_, 0, n_) for r_, c_, n_ in blocks]}
                ranks.append(dict(describe(mats, frags), gpu=r, job=sigs[sig], tp_shard_elements=sum(shards),
                                  tp_exchange_ms=exchange_ms, team_blocks=len(blocks)))
            per_plan[name] = {"ranks": ranks, "plan_s": plan["plan_s"], "info": plan["info"],
                              "predicted": [c for layout in plan["layouts"].values() for c in layout.rank_cost]}
        log({"layout": spec, "plans": list(plans), "gpus": par.dp_size * par.tp, "distinct_ranks": len(jobs)})
        times = time_all(jobs, cfg, args.rounds, args.iters, args.warmup, args.device, log)
        for name, row in per_plan.items():
            for x in row["ranks"]:
                x["ms_rounds"] = times[x["job"]]
                x["ms"] = statistics.median(x["ms_rounds"])
            slowest_rounds = [max(x["ms_rounds"][i] for x in row["ranks"]) for i in range(max(1, args.rounds))]
            row["slowest_rounds"] = slowest_rounds
            row["slowest_ms"] = statistics.median(slowest_rounds)
            row["spread_ms"] = max(x["ms"] for x in row["ranks"]) - min(x["ms"] for x in row["ranks"])
            if par.tp > 1 or name == "split":  # compute measured per GPU, the TP / split exchange modelled
                row["slowest_with_exchange_ms"] = max(x["ms"] + x["tp_exchange_ms"] for x in row["ranks"])
        result["layouts"][spec] = {"plans": per_plan, "bucket_size": size, "dp": par.dp_size, "ep": par.ep, "tp": par.tp,
                                   "jobs": {k: describe(v["mats"], v["frags"]) | {
                                       "fragment_sizes": v["frags"], "tp_shards": v["shards"],
                                       "runner": v["runner"]} for k, v in jobs.items()}}
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
    common = sorted(most, key=lambda s: (-most[s], s))[:3]
    for a, b in zip(common, common[1:]):  # two shapes in one step: the part a step pays once
        for ka, kb in ((1, 1), (min(2, most[a]), min(4, most[b])), (max(1, most[a] // 2), max(1, most[b] // 2))):
            jobs[f"pair|{a[0]}x{a[1]}|{ka}|{b[0]}x{b[1]}|{kb}"] = (
                [(f"cal.a{i}", a, None) for i in range(ka)] + [(f"cal.b{i}", b, None) for i in range(kb)], [])
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


def load_rank_model(path, spec=None):
    """A rank cost model JSON, a start-up profile cache, a calibrate run's JSON, or a startup run's
    JSON (its model for layout ``spec``)."""
    from megatron_dmuon.planning.cost_model import load_config
    from megatron_dmuon.planning.plan_cli import load_rank_model as load
    from megatron_dmuon.planning.rank_cost import RankCostModel

    data = json.loads(Path(path).read_text())
    if "models" in data:
        if spec not in data["models"]:
            raise ValueError(f"{path} holds start-up models of {', '.join(data['models'])}, not of {spec}")
        return RankCostModel.from_json(data["models"][spec])
    return load(path, load_config(), "H200")


def startup(args, cfg, log):
    """What rank 0 of a ``--dmuon-balance milp`` job does at start-up, per layout: the rank profile
    (runtime/rank_profile.py, through the cache in --cache-dir) within the budget's share, then the
    MILP with what is left; seconds of each, and the model it planned on."""
    from megatron_dmuon.planning.startup_budget import milp_time_limit, profile_budget
    from megatron_dmuon.runtime.rank_profile import profile_counts, profiled_rank_model

    out = {"layouts": {}, "models": {}}
    cache = str(Path(args.cache_dir) / "ns_profile.json")
    for spec in args.layouts:
        model, par, size = parse_layout(spec)
        counts = Counter()
        for plist in stage_params(model, par).values():
            config = transformer_shape(model)
            for p in plist:
                if p.is_matrix:
                    rule = split_rule_for(p.name, p.full_shape, config, cfg.split_flags())
                    counts.update(pieces_of([(p.name, tuple(p.full_shape), rule)]))
        cells = min(par.dp_size * par.tp, par.expert_dp_size * par.expert_tp) if model.num_experts else par.dp_size
        t0 = time.perf_counter()
        rank_model = profiled_rank_model(profile_counts(counts, cells), cfg.muon, cache_path=cache,
                                         budget_s=profile_budget(args.startup_budget))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        limit = milp_time_limit(args.startup_budget, t1 - t0, args.milp_time_limit)
        buffers = 2 if model.num_experts else 1  # build_plan shares the limit between the buffers
        plan = make_plans(model, par, size, cfg, ["milp"], rank_model, {"time_limit_s": limit / buffers})["milp"]
        t2 = time.perf_counter()
        out["layouts"][spec] = {"profile_s": t1 - t0, "plan_s": t2 - t1, "milp_time_limit_s": limit,
                                "info": plan["info"], "points": len(rank_model.stacks)}
        out["models"][spec] = rank_model.to_json()
        log({"layout": spec, "profile_s": round(t1 - t0, 2), "plan_s": round(t2 - t1, 2)})
    return out


def report(args, log):
    """Predicted (by each rank model given) against emulated slowest GPU, per layout and plan."""
    emulated = [json.loads(Path(p).read_text()) for p in args.emulation]
    models = {name: path for name, path in (m.split("=", 1) for m in args.models)}
    rows = []
    for result in emulated:
        for spec, lay in result["layouts"].items():
            model, par, size = parse_layout(spec)
            for plan_name, row in lay["plans"].items():
                entry = {"layout": spec, "plan": plan_name, "emulated_ms": row["slowest_ms"],
                         "rounds": row["slowest_rounds"]}
                if plan_name in BASELINES:  # the rank models predict DMuon's owner step, not Megatron's
                    continue
                for name, path in models.items():
                    rm = load_rank_model(path, spec)
                    predicted = [rm.rank_ms(rank_work(lay["jobs"][str(x["job"])])) for x in row["ranks"]]
                    entry[name] = max(predicted)
                    entry[name + "_error"] = max(predicted) / row["slowest_ms"] - 1
                rows.append(entry)
    return {"rows": rows, "models": models}


def rank_work(job) -> RankWork:
    """The RankWork of an emulated job (its pieces, AdamW elements and fragments)."""
    return RankWork(Counter({tuple(int(v) for v in k.split("x")): n for k, n in job["pieces"].items()}),
                    job["adamw_elements"], job["fragments"])


def muon_steps(layouts, model):
    """The emulated DMuon ranks of several piece shapes as Muon-only steps ({shape: k}, ms): the
    measured ms less the AdamW part ``model`` predicts beside them (what a start-up profile's
    step of several shapes at a rank's counts would measure)."""
    out = []
    for lay in layouts:
        for job in lay["jobs"].values():
            work = rank_work(job)
            if job.get("runner") or job.get("tp_shards") or len(work.pieces) < 2:
                continue
            ms = statistics.median(x["ms"] for row in lay["plans"].values() for x in row["ranks"]
                                   if lay["jobs"][str(x["job"])] is job)
            out.append((dict(work.pieces), ms - model.adamw_ms(work.adamw_elements, work.fragments) * (1 - model.hidden)))
    return out


def refitted(model, points=(), others=(), shapes=()):
    """``model`` fitted again as the start-up profile now does: its stacks with every ns| point of
    ``points`` (calibrate JSONs, profile caches) of its shapes and of ``shapes`` (the layout's: a
    profile cut by its budget measured fewer), its shared parts by least squares on their pair| and
    multi| steps plus ``others`` (Muon-only steps, ``muon_steps``) of those shapes; AdamW and the
    hidden fraction as they were."""
    from megatron_dmuon.planning.cost_model import shape_key
    from megatron_dmuon.planning.rank_cost import RankCostModel, multi_counts

    stacks = {s: list(p) for s, p in model.stacks.items()}
    steps = [(c, t) for c, t in others if all(shape_key(s) in stacks for s in c)]  # this layout's shapes only
    for data in points:
        fitted = RankCostModel.from_calibration({"jobs": data})
        for s, pts in fitted.stacks.items():
            if s in stacks or s in shapes:
                stacks[s] = sorted({**dict(stacks.get(s, [])), **dict(pts)}.items())
        for name, job in data.items():
            kind, *f = name.split("|")
            if kind in ("pair", "multi"):
                counts = multi_counts(name) if kind == "multi" else {shape_key(f[0].split("x")): int(f[1]),
                                                                     shape_key(f[2].split("x")): int(f[3])}
                if all(s in stacks for s in counts):
                    steps.append((counts, float(job["ms"])))
    out = RankCostModel(stacks, model.adamw_points, hidden=model.hidden, device=model.device,
                        meta=dict(model.meta, source="refitted"), steps=model.steps, ns_method=model.ns_method)
    out.fit_shared(steps)
    return out


def check(args, log):
    """Every emulated DMuon GPU predicted by each model: per GPU (parts beside the measured ms) and
    per plan (slowest predicted vs slowest emulated, and whether the model orders the plans as the
    emulation did). ``--refit-points`` / ``--refit-on``: each model fitted again as the start-up
    profile now does (``refitted``), with, from ``--refit-on``, the multi-shape ranks of the other
    layouts only (the layout checked is never in its own fit)."""
    emulated = {spec: lay for p in args.emulation for spec, lay in json.loads(Path(p).read_text())["layouts"].items()}
    points = [load_points(p) for p in args.refit_points]
    others = {spec: lay for p in args.refit_on for spec, lay in json.loads(Path(p).read_text())["layouts"].items()}
    models = dict(m.split("=", 1) for m in args.models)
    ranks, plans = [], []
    for spec, lay in emulated.items():
        for name, path in models.items():
            rm = load_rank_model(path, spec)
            if points or others:
                shapes = {s for job in lay["jobs"].values() if not job.get("runner") for s in rank_work(job).pieces}
                rm = refitted(rm, points, muon_steps([v for k, v in others.items() if k != spec], rm), shapes)
            slowest = {}
            for plan_name, row in lay["plans"].items():
                if plan_name in BASELINES:
                    continue
                predicted = {x["job"]: rm.rank_ms(rank_work(lay["jobs"][str(x["job"])])) for x in row["ranks"]}
                slowest[plan_name] = (row["slowest_ms"], max(predicted.values()))
                for job in sorted(set(predicted)):
                    ms = statistics.median(x["ms"] for x in row["ranks"] if x["job"] == job)
                    ranks.append({"layout": spec, "model": name, "plan": plan_name, "job": job,
                                  "pieces": lay["jobs"][str(job)]["pieces"], "emulated_ms": ms,
                                  "predicted_ms": predicted[job], "error": predicted[job] / ms - 1 if ms else 0.0})
            for plan_name, (emu, pred) in slowest.items():
                plans.append({"layout": spec, "model": name, "plan": plan_name, "emulated_ms": emu, "predicted_ms": pred,
                              "error": pred / emu - 1 if emu else 0.0, "shared_ms": rm.shared_ms,
                              "shape_shared": {f"{m}x{n}": v for (m, n), v in rm.shape_shared.items()},
                              "emulated_best": min(slowest, key=lambda p: slowest[p][0]),
                              "predicted_best": min(slowest, key=lambda p: slowest[p][1])})
    return {"check_ranks": ranks, "check_plans": plans}


def load_points(path):
    """The measured jobs of a calibrate JSON or of a start-up profile cache (every entry's)."""
    data = json.loads(Path(path).read_text())
    if "jobs" in data:
        return data["jobs"]
    return {k: v for entry in data.get("entries", {}).values() for k, v in entry.get("jobs", {}).items()}


def check_table(result):
    lines = ["| layout | model | plan | emulated slowest ms | predicted ms | error | best plan emulated / predicted |",
             "|---|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['layout']} | {r['model']} | {r['plan']} | {r['emulated_ms']:.2f} | {r['predicted_ms']:.2f} | "
              f"{100 * r['error']:+.1f}% | {r['emulated_best']} / {r['predicted_best']} |" for r in result["check_plans"]]
    lines += ["", "| layout | model | plan | GPU job | pieces | emulated ms | predicted ms | error |",
              "|---|---|---|---:|---|---:|---:|---:|"]
    lines += [f"| {r['layout']} | {r['model']} | {r['plan']} | {r['job']} | "
              f"{' '.join(f'{k}:{v}' for k, v in r['pieces'].items())} | {r['emulated_ms']:.2f} | "
              f"{r['predicted_ms']:.2f} | {100 * r['error']:+.1f}% |" for r in result["check_ranks"]]
    return "\n".join(lines)


def table(result):
    if "scale_rows" in result:
        return scale_table(result)
    if "check_plans" in result:
        return check_table(result)
    lines = []
    if "rows" in result:
        names = list(result["models"])
        lines += ["| layout | plan | emulated slowest GPU ms | " + " | ".join(f"predicted ({n}) | error" for n in names)
                  + " |", "|---|---|---:|" + "---:|---:|" * len(names)]
        for r in result["rows"]:
            lines.append(f"| {r['layout']} | {r['plan']} | {r['emulated_ms']:.2f} | " + " | ".join(
                f"{r[n]:.2f} | {100 * r[n + '_error']:+.1f}%" for n in names) + " |")
        return "\n".join(lines)
    if "models" in result:
        lines += ["| layout | profile s | MILP s | MILP | start |", "|---|---:|---:|---|---|"]
        for spec, x in result["layouts"].items():
            for kind, info in x["info"].items():
                lines.append(f"| {spec} ({kind}) | {x['profile_s']:.1f} | {x['plan_s']:.1f} | {info.get('status')} "
                             f"| {info.get('chosen')} |")
        return "\n".join(lines)
    for spec, lay in result.get("layouts", {}).items():
        lines += [f"## {spec} (bucket size {lay['bucket_size']})", "",
                  "| plan | slowest GPU ms (median of rounds) | rounds | spread ms | distinct ranks | plan s |"
                  + (" slowest GPU + modelled TP or split exchange ms |" if lay.get("tp", 1) > 1 or "split" in lay["plans"]
                     else ""),
                  "|---|---:|---|---:|---:|---:|" + ("---:|" if lay.get("tp", 1) > 1 or "split" in lay["plans"] else "")]
        for name, row in lay["plans"].items():
            lines.append(f"| {name} | **{row['slowest_ms']:.2f}** | {', '.join(f'{x:.2f}' for x in row['slowest_rounds'])} "
                         f"| {row['spread_ms']:.2f} | {len({x['job'] for x in row['ranks']})} | {row['plan_s']:.1f} |"
                         + (f" {row['slowest_with_exchange_ms']:.2f} |" if "slowest_with_exchange_ms" in row
                            else " — |" if lay.get("tp", 1) > 1 or "split" in lay["plans"] else ""))
        lines.append("")
    if "jobs" in result:
        lines += ["| calibration rank | ms |", "|---|---:|"] + [f"| {k} | {v['ms']:.3f} |" for k, v in result["jobs"].items()]
    return "\n".join(lines)


EMULATION_KIND = "the JSON of a rank_balance.py emulate run (--out STEM writes STEM.json)"
MODEL_KIND = "a rank cost model JSON, a calibrate or startup run's JSON, or a start-up profile cache"
# what each mode reads: without it a mode printed an empty table and exited 0 ([bad-input-5])
NEEDS = {"report": ("emulation", "models"), "check": ("emulation", "models"), "scale": ("emulation",)}


def check_inputs(parser, args) -> None:
    """Every input file read and shaped as its flag says, before any work; a usage error names the
    flag, the file and what to give."""
    if args.mode in ("emulate", "calibrate", "startup"):
        check_device(parser, args.device)
    for dest in NEEDS.get(args.mode, ()):
        if not getattr(args, dest):
            kind = EMULATION_KIND if dest == "emulation" else "NAME=PATH pairs, PATH " + MODEL_KIND
            parser.error(f"{args.mode} needs --{dest} ({kind})")
    for flag, paths in (("--emulation", args.emulation), ("--refit-on", args.refit_on)):
        for path in paths:
            doc = read_json(parser, flag, path, EMULATION_KIND, need=("layouts",))
            layouts = doc["layouts"]
            if not isinstance(layouts, dict) or not layouts or not all(
                    isinstance(lay, dict) and isinstance(lay.get("plans"), dict) and isinstance(lay.get("jobs"), dict)
                    for lay in layouts.values()):
                held = ("no layout" if not layouts else "a layout without them") if isinstance(layouts, dict) \
                    else f"a JSON {type(layouts).__name__}"
                parser.error(f"{flag} {path}: its 'layouts' must map each layout to its 'plans' and 'jobs' (it holds "
                             f"{held}); give {EMULATION_KIND}")
    for pair in args.models:
        name, eq, path = pair.partition("=")
        if not (name and eq and path):
            parser.error(f"--models {pair}: give NAME=PATH (PATH: {MODEL_KIND})")
        read_json(parser, "--models", path, MODEL_KIND, any_of=("stacks", "jobs", "entries", "models"))
    for path in args.refit_points:
        read_json(parser, "--refit-points", path, "a calibrate run's JSON or a start-up profile cache",
                  any_of=("jobs", "entries"))
    if args.rank_profile:
        read_json(parser, "--rank-profile", args.rank_profile, MODEL_KIND, any_of=("stacks", "jobs", "entries", "models"))


def main(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["emulate", "calibrate", "startup", "report", "scale", "check"])
    parser.add_argument("--cluster", default="h200", help="scale: planning/clusters.json's cluster for the modelled "
                                                           "communication")
    parser.add_argument("--global-batch", type=int, default=1024,
                        help="scale: sequences (of 4096 tokens) per iteration for the modelled forward and backward")
    parser.add_argument("--cache-dir", default="/tmp/dmuon_rank_profile", help="startup: the profile cache's folder")
    parser.add_argument("--startup-budget", type=float, default=30.0, help="startup: --dmuon-plan-budget")
    parser.add_argument("--emulation", nargs="+", default=[], help="report, check: emulate runs' JSON")
    parser.add_argument("--models", nargs="+", default=[], help="report, check: NAME=PATH rank models (calibrate, "
                                                                 "startup or model JSON)")
    parser.add_argument("--refit-points", nargs="+", default=[], help="check: calibrate JSONs or profile caches whose "
                                                                       "points each model is fitted again with")
    parser.add_argument("--refit-on", nargs="+", default=[], help="check: emulate JSONs whose multi-shape ranks of "
                                                                   "the other layouts each model is fitted again with")
    parser.add_argument("--layouts", nargs="+", default=["qwen7b-4l/dp2/buckets"])
    parser.add_argument("--plans", nargs="+", default=["greedy", "numel_lpt", "megatron_lpt"], choices=PLANS + BASELINES,
                        help=f"DMuon's planners; {MEGATRON}: Megatron-LM's own LayerWise Muon step per GPU "
                             f"(its owners, its optimizer classes; needs emerging_optimizers); {ADAMW}: Megatron's "
                             "DistributedOptimizer AdamW per GPU (bench/megatron_ranks.py)")
    parser.add_argument("--rank-profile", help="a rank cost model JSON (planning/rank_cost.py) for the milp plan")
    parser.add_argument("--milp-time-limit", type=float, default=20.0)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every (plan, GPU), interleaved; 0: a dry "
                                                               "run (plans and job counts, nothing timed)")
    parser.add_argument("--adamw-sizes", type=float, nargs="+", default=[1, 10, 50, 150, 400, 800],
                        help="calibrate: AdamW-only ranks of these many million elements")
    parser.add_argument("--flags", default="",
                        help="the main job's dmuon flags, one string (--flags='...'); default: the job's defaults")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    check_inputs(parser, args)
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
    run = {"emulate": lambda: emulate(args, cfg, log), "calibrate": lambda: calibrate(args, cfg, log),
           "startup": lambda: startup(args, cfg, log), "report": lambda: report(args, log),
           "scale": lambda: scale(args, log), "check": lambda: check(args, log)}[args.mode]
    try:
        result = head | run()
    except ValueError as e:  # an input that reads but does not fit (a startup JSON without this layout's model)
        parser.error(str(e))
    text = table(result)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))
        Path(args.out + ".md").write_text(f"# {args.mode} on one {name} ({args.flags})\n\n" + text + "\n")
        if args.mode == "scale" and result["scale_rows"]:
            scale_plot(result, args.out + ".png")


if __name__ == "__main__":
    main()
