"""Start-up cost of load balancing for a real model size: the rank profile on this GPU + the MILP
owner plan on it, both cached on disk; run it twice (two processes) to see the second start reuse both.

    export DMUON_AUTOTUNE_CACHE=/tmp/dmuon/autotune.json
    python bench/plan_startup.py --preset qwen2.5-7b --dp 8 --cache-dir /tmp/dmuon --out /tmp/dmuon/start1.json
    python bench/plan_startup.py --preset qwen2.5-7b --dp 8 --cache-dir /tmp/dmuon --out /tmp/dmuon/start2.json

It plans what rank 0 plans in megatron/ddp.py::build_plan for ``--dmuon-balance milp`` (the model
itself is not built): the parameters of pipeline stage 0 from planning/models.py, the start-up rank
profile (runtime/rank_profile.py: synthetic owner steps timed on this GPU, within the budget's
profiling share; the kernels' autotuning of each new (shape, count) happens inside them), then
``plan_rank_owner_layout`` with what the budget has left, and the plan cache.
(Until 2026-12-04 this timed the per-shape NS profile of the old MILP: the JSONs of 2026-12-01.)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    from cli_inputs import OneLineParser  # (bench/, on the path when this runs as a script)
    from megatron_dmuon.planning.models import PRESETS

    p = OneLineParser()
    p.add_argument("--preset", default="qwen2.5-7b", choices=sorted(PRESETS))
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--out")
    p.add_argument("--time-limit", type=float, default=10.0, help="MILP time limit cap, seconds")
    p.add_argument("--startup-budget", type=float, default=None,
                   help="profiling + MILP seconds (default: --dmuon-plan-budget's, 30)")
    p.add_argument("--ns-method", default="auto")
    p.add_argument("--coefficients", default="adaptive", help="the job's --dmuon-coefficients (default adaptive)")
    p.add_argument("--ns-launch", default="graph", help="the job's --dmuon-ns-launch (default graph)")
    args = p.parse_args()
    if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        p.error(f"--cache-dir {args.cache_dir} is not a directory: give a folder for the profile and plan caches")
    t_start = time.perf_counter()

    import torch

    from megatron_dmuon.megatron.config import DMuonConfig
    from megatron_dmuon.planning.caches import PlanCache, plan_key
    from megatron_dmuon.planning.cost_model import device_spec, elementwise_costs
    from megatron_dmuon.planning.models import PRESETS, ParallelSpec, stage_params
    from megatron_dmuon.planning.ns_choice import NSResolver, owner_ns_cost
    from megatron_dmuon.planning.planners import buffer_items, split_pieces
    from megatron_dmuon.planning.rank_cost import piece_counts
    from megatron_dmuon.planning.rank_milp import plan_rank_owner_layout
    from megatron_dmuon.planning.startup_budget import STARTUP_BUDGET_S, milp_time_limit, profile_budget
    from megatron_dmuon.runtime.owner_step import MuonSettings
    from megatron_dmuon.runtime.rank_profile import profile_counts, profiled_rank_model

    t_import = time.perf_counter()
    os.makedirs(args.cache_dir, exist_ok=True)
    par = ParallelSpec(dp=args.dp, tp=args.tp)
    params = stage_params(PRESETS[args.preset], par)["dense"]
    # the shapes the owner step orthogonalizes: DMuonConfig's default split (QKV into q, k, v)
    pieces = split_pieces(PRESETS[args.preset], DMuonConfig().split_flags())
    counts = piece_counts(s for q in params if q.is_matrix for s in pieces(q.name, q.full_shape))
    settings = MuonSettings(ns_method=args.ns_method, coefficients=args.coefficients, ns_launch=args.ns_launch)
    budget = args.startup_budget or STARTUP_BUDGET_S
    caught = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        model = profiled_rank_model(profile_counts(counts, args.dp * args.tp), settings,
                                    cache_path=os.path.join(args.cache_dir, "ns_profile.json"),
                                    budget_s=profile_budget(budget))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        cost_fn = functools.partial(owner_ns_cost, resolver=NSResolver(
            settings.ns_method, coefficients=settings.coefficients, steps=settings.ns_steps))
        items = buffer_items(params, None, pieces, cost_fn)
        elementwise = elementwise_costs(device_spec(model.device.name if model.device else "H200"))
        # the same split as megatron/ddp.py: the MILP gets what profiling left of the budget
        options = {"time_limit_s": milp_time_limit(budget, t1 - t0, args.time_limit)}
        cache = PlanCache(os.path.join(args.cache_dir, "plans.json"))
        key = plan_key({"items": [list(vars(it).values()) for it in items], "dp": args.dp, "tp": args.tp,
                        "balance": "milp", "options": options, "elementwise": elementwise,
                        "rank_model": model.to_json()})
        cached = cache.get(key)
        info = {}
        if cached is None:
            layout = plan_rank_owner_layout(items, args.dp, None, 0.02, None, args.tp, options, info, elementwise,
                                            model=model)
            cache.put(key, layout.to_json())
        t2 = time.perf_counter()
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "preset": args.preset, "dp": args.dp, "tp": args.tp,
        "shapes": {f"{m}x{n}": k for (m, n), k in sorted(counts.items())},
        "startup_budget_s": budget, "milp_time_limit_s": options["time_limit_s"],
        "seconds": {"imports": t_import - t_start, "profile": t1 - t0, "plan": t2 - t1, "profile_plus_plan": t2 - t0},
        "plan_from_cache": cached is not None, "solver": info, "rank_model": model.to_json(),
        "warnings": sorted({str(w.message) for w in caught}),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
