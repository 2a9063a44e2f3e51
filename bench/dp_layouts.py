"""The DP layouts `dmuon plan` compares, for the presets and DP sizes of [scale-past-matrices]: at one
distributed-optimizer instance the whole-matrix and the split layout, and the planner's pick over every
instance count, against the goals: bytes published and reduced per rank <= 1.10x Megatron's AdamW
DistributedOptimizer's (one instance, the same DP), the largest rank's optimizer state <= 2x AdamW's (the
same DP and instance count), every rank's NS <= 1.5x max(the largest matrix's NS, total NS / DP).
Planning only (analytic H200 costs, planning/clusters.json); writes STEM.json and STEM.md.

    python bench/dp_layouts.py --out docs/results/dp_layouts/plan_goals_cpu_2026-12-07
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dmuon.planning.cost_model import CostModel, cluster_spec, load_config  # noqa: E402
from megatron_dmuon.planning.dp_schemes import candidate, compare_dp_layouts  # noqa: E402
from megatron_dmuon.planning.models import PRESETS, ParallelSpec  # noqa: E402

GOALS = {"bytes_vs_adamw": 1.10, "state_vs_adamw": 2.0, "ns_vs_bound": 1.5}


def main(argv=None) -> int:
    from cli_inputs import OneLineParser

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b"], choices=sorted(PRESETS))
    p.add_argument("--dp", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--cluster", default="h200")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if any(d < 1 for d in args.dp):
        p.error("--dp sizes must be >= 1")
    cluster = cluster_spec(args.cluster)
    opt = load_config()["optimizer"]
    rows = []
    for preset in args.presets:
        for dp in args.dp:
            report = compare_dp_layouts(PRESETS[preset], ParallelSpec(dp=dp), CostModel(cluster.device), cluster, opt,
                                        two_level=True)
            picked = report["candidates"][report["picked"]]
            row = {"preset": preset, "dp": dp, "picked": f"{picked['instances']} x {picked['scheme']}",
                   "why": report["why"]}
            for scheme in ("whole", "split"):
                c = candidate(report, 1, scheme)
                row[scheme] = {k: c[k] for k in ("bytes_vs_adamw", "state_vs_adamw", "ns_vs_bound", "optimizer_step_ms",
                                                 "iteration_ms", "padding_bytes", "max_state_bytes")}
                row[scheme]["meets_goals"] = all(c[k] <= v for k, v in GOALS.items())
            row["picked_meets_goals"] = all(picked[k] <= v for k, v in GOALS.items())
            row["adamw"] = report["adamw"]
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("preset", "dp", "picked", "picked_meets_goals")}), flush=True)
    lines = [f"Planning only ({args.cluster}'s analytic costs, two-level collectives), one instance unless picked: "
             "bytes per rank (reduce-scatter + all-gather + the split exchange) x AdamW's, the largest rank's optimizer "
             "state x AdamW's, the slowest rank's NS x max(largest matrix, total / DP); goals 1.10 / 2 / 1.5.", "",
             "| model | DP | whole: bytes / state / NS (x) | split: bytes / state / NS (x) | picked | goals met by the pick |",
             "|---|---:|---|---|---|---|"]
    for r in rows:
        cell = lambda c: f"{c['bytes_vs_adamw']:.2f} / {c['state_vs_adamw']:.2f} / {c['ns_vs_bound']:.2f}"  # noqa: E731
        lines.append(f"| {r['preset']} | {r['dp']} | {cell(r['whole'])} | {cell(r['split'])} | {r['picked']} | "
                     f"{'yes' if r['picked_meets_goals'] else 'no'} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps({"goals": GOALS, "cluster": args.cluster, "rows": rows}, indent=1))
        Path(args.out + ".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
