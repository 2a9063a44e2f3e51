"""Start-up cost of load balancing for a real model size: NS profile on this GPU + MILP owner plan,
both cached on disk; run it twice (two processes) to see the second start reuse both.

    export DMUON_AUTOTUNE_CACHE=/tmp/dmuon/autotune.json
    python bench/plan_startup.py --preset qwen2.5-7b --dp 8 --cache-dir /tmp/dmuon --out /tmp/dmuon/start1.json
    python bench/plan_startup.py --preset qwen2.5-7b --dp 8 --cache-dir /tmp/dmuon --out /tmp/dmuon/start2.json

It plans what rank 0 plans in megatron/layout.py::build_plan (the same
``plan_owner_layout(balance='milp')`` on the same items; the model itself is not built): the
parameters of pipeline stage 0 from planning/models.py, the owner step's orthogonalizer profiled
per shape at batch sizes 1 and 8 (runtime/ns_timing.py; the kernels' autotuning of each new shape
happens inside the first timed calls), then the MILP (CBC, or HiGHS where python-mip is missing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--out")
    p.add_argument("--time-limit", type=float, default=10.0, help="MILP time limit cap, seconds")
    p.add_argument("--startup-budget", type=float, default=None,
                   help="profiling + MILP seconds (default: --dmuon-plan-budget's, 30)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--ns-method", default="auto")
    args = p.parse_args()
    t_start = time.perf_counter()

    import torch

    from megatron_dmuon.planning.models import PRESETS, ParallelSpec, stage_params
    from megatron_dmuon.planning.owner_layout import plan_owner_layout
    from megatron_dmuon.megatron.config import DMuonConfig
    from megatron_dmuon.planning.cost_model import elementwise_costs
    from megatron_dmuon.planning.plans import buffer_items, split_pieces
    from megatron_dmuon.planning.caches import PlanCache, plan_key
    from megatron_dmuon.planning.startup_profile import STARTUP_BUDGET_S, milp_time_limit, profile_budget
    from megatron_dmuon.runtime.ns_timing import profiled_cost_model
    from megatron_dmuon.runtime.owner_step import MuonSettings

    t_import = time.perf_counter()
    os.makedirs(args.cache_dir, exist_ok=True)
    par = ParallelSpec(dp=args.dp, tp=args.tp)
    params = stage_params(PRESETS[args.preset], par)["dense"]
    # the shapes the owner step orthogonalizes: DMuonConfig's default split (QKV into q, k, v)
    pieces = split_pieces(PRESETS[args.preset], DMuonConfig().split_flags())
    shapes = sorted({s for q in params if q.is_matrix for s in pieces(q.name, q.full_shape)})
    settings = MuonSettings(ns_method=args.ns_method)
    budget = args.startup_budget or STARTUP_BUDGET_S
    caught = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        model = profiled_cost_model(shapes, args.max_batch, settings, cache_path=os.path.join(args.cache_dir, "ns_profile.json"),
                                    budget_s=profile_budget(budget))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        items = buffer_items(params, model, pieces)
        elementwise = elementwise_costs(model.device, "ms")
        # the same split as megatron/layout.py: the MILP gets what profiling left of the budget
        options = {"time_limit_s": milp_time_limit(budget, t1 - t0, args.time_limit)}
        cache = PlanCache(os.path.join(args.cache_dir, "plans.json"))
        key = plan_key({"items": [list(vars(it).values()) for it in items], "dp": args.dp, "tp": args.tp,
                        "balance": "milp", "options": options, "elementwise": elementwise})
        cached = cache.get(key)
        info = {}
        if cached is None:
            layout = plan_owner_layout(items, args.dp, None, 0.02, None, args.tp, "milp", milp_options=options, info=info,
                                       elementwise=elementwise)
            cache.put(key, layout.to_json())
        t2 = time.perf_counter()
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "preset": args.preset, "dp": args.dp, "tp": args.tp, "shapes": [list(s) for s in shapes],
        "startup_budget_s": budget, "milp_time_limit_s": options["time_limit_s"],
        "seconds": {"imports": t_import - t_start, "profile": t1 - t0, "plan": t2 - t1, "profile_plus_plan": t2 - t0},
        "plan_from_cache": cached is not None, "solver": info,
        "profile": model.table.to_json() if model.table is not None else None,
        "fits": {"x".join(map(str, s)): vars(model.shape_cost(s)) for s in shapes},
        "warnings": sorted({str(w.message) for w in caught}),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
