"""Predicted DMuon optimizer step at 8-256 GPUs (planning/simulate.py), next to the DMuon paper's
published point, and validated against every optimizer step measured on the H200s lent here.

    python bench/simulate_scaling.py --out docs/results/scaling/simulate_scaling

Writes <out>.json, <out>.md (tables) and <out>.png (plot; needs matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_dmuon.planning.cost_model import (CostModel, cluster_spec, device_spec,  # noqa: E402
                                                load_bench_kernels_profile)
from megatron_dmuon.planning.models import PRESETS, ParallelSpec  # noqa: E402
from megatron_dmuon.planning.simulate import predict_adamw_step, predict_optimizer_step  # noqa: E402

PAPER = {"model": "qwen2.5-7b", "gpus": 256, "device": "A800", "optimizer_step_ms": 22.0,
         "source": "DMuon paper (MISSION.md): Qwen2.5-7B optimizer step 22 ms at 256 A800s"}

# Every optimizer step measured on the lent H200s (median ms; the 4-layer Qwen2.5-7B-shaped GPT,
# 32k vocab; ns-method auto, Keller 5 steps, no split rules, greedy NS-FLOP plans).
MEASURED = [
    # (label, dp, tp, overlap_param_gather, mode, ms, source)
    ("1 H200", 1, 1, False, "dmuon", None, "docs/results/scaling/scaling_h200x2_2026-11-30.json ['1']"),
    ("1 H200", 1, 1, False, "adam", None, "docs/results/scaling/scaling_h200x2_2026-11-30.json ['1']"),
    ("2 H200, DP=2", 2, 1, False, "dmuon", None, "docs/results/scaling/scaling_h200x2_2026-11-30.json ['2']"),
    ("2 H200, DP=2", 2, 1, False, "adam", None, "docs/results/scaling/scaling_h200x2_2026-11-30.json ['2']"),
    ("2 H200, DP=2 (bench/e2e.py)", 2, 1, False, "dmuon", 45.3, "FACTS.md, no overlap flags"),
    ("2 H200, DP=2 (bench/e2e.py)", 2, 1, False, "adam", 21.9, "FACTS.md, no overlap flags"),
    ("2 H200, DP=2, overlap", 2, 1, True, "dmuon", 39.8, "FACTS.md, --overlap-grad-reduce --overlap-param-gather"),
    ("2 H200, DP=2, overlap", 2, 1, True, "adam", 19.2, "FACTS.md, same flags"),
    ("1 H200, overlap", 1, 1, True, "dmuon", 75.4, "FACTS.md, global batch 4"),
    ("1 H200, overlap", 1, 1, True, "adam", 34.5, "FACTS.md, global batch 4"),
    ("2 H200, TP=2, overlap", 1, 2, True, "dmuon", 67.5, "docs/tp_ep_pp.md"),
    ("2 H200, TP=2, overlap", 1, 2, True, "adam", 19.2, "docs/tp_ep_pp.md"),
]


def validate(cost_model, cluster):
    scaling = json.load(open(os.path.join(ROOT, "docs/results/scaling/scaling_h200x2_2026-11-30.json")))
    rows = []
    for label, dp, tp, overlap, mode, ms, source in MEASURED:
        if ms is None:
            ms = next(r["median_optimizer_ms"] for r in scaling[str(dp)]["e2e"] if r["mode"] == mode)
        par = ParallelSpec(dp=dp, tp=tp)
        if mode == "dmuon":
            pred = predict_optimizer_step(PRESETS["qwen7b-4l"], par, cluster, cost_model, planner="greedy",
                                          overlap_param_gather=overlap)
            parts = pred["slowest_gpu"]
            detail = (f"NS {parts['ns_ms']:.1f} + element-wise {parts['elementwise_ms']:.1f} + TP exchange "
                      f"{parts['tp_exchange_ms']:.1f} + publish {0.0 if overlap else pred['publish_ms']:.1f}")
        else:
            pred = predict_adamw_step(PRESETS["qwen7b-4l"], par, cluster, overlap_param_gather=overlap)
            detail = f"element-wise {pred['elementwise_ms']:.1f} + publish {0.0 if overlap else pred['publish_ms']:.1f}"
        p = pred["optimizer_step_ms"]
        rows.append({"run": label, "optimizer": mode, "measured_ms": ms, "predicted_ms": p, "error": p / ms - 1,
                     "parts": detail, "source": source})
    return rows


def scale(gpu_counts, clusters, bench_profile):
    out = []
    model = PRESETS["qwen2.5-7b"]
    for name in clusters:
        cluster = cluster_spec(name)
        table = bench_profile if cluster.device.name == "H200" else None
        cost_model = CostModel(cluster.device, table)
        for gpus in gpu_counts:
            par = ParallelSpec(dp=gpus, gpus_per_node=cluster.gpus_per_node)
            for two_level in (False, True):
                r = predict_optimizer_step(model, par, cluster, cost_model, two_level=two_level,
                                           milp_options={"time_limit_s": 10.0})
                g = predict_optimizer_step(model, par, cluster, cost_model, two_level=two_level, planner="greedy")
                adam = predict_adamw_step(model, par, cluster, two_level=two_level)
                out.append({"cluster": name, "gpus": gpus, "nodes": r["nodes"], "two_level": two_level,
                            "step_ms": r["optimizer_step_ms"], "step_overlapped_ms": r["optimizer_step_overlapped_ms"],
                            "owner_ns_ms": r["owner_ns_ms"], "greedy_owner_ns_ms": g["owner_ns_ms"],
                            "greedy_step_overlapped_ms": g["optimizer_step_overlapped_ms"],
                            "elementwise_ms": r["slowest_gpu"]["elementwise_ms"], "publish_ms": r["publish_ms"],
                            "grad_reduce_ms": r["grad_reduce_ms"], "adamw_step_ms": adam["optimizer_step_ms"],
                            "adamw_step_overlapped_ms": adam["elementwise_ms"]})
    return out


def markdown(valid, rows):
    lines = ["## Validation: predicted vs measured optimizer step (4-layer Qwen2.5-7B-shaped GPT, H200)", "",
             "| run | optimizer | measured ms | predicted ms | error | predicted parts (slowest GPU) |",
             "|---|---|---:|---:|---:|---|"]
    for v in valid:
        lines.append(f"| {v['run']} | {v['optimizer']} | {v['measured_ms']:.1f} | {v['predicted_ms']:.1f} | "
                     f"{100 * v['error']:+.0f}% | {v['parts']} |")
    lines += ["", "## Qwen2.5-7B (28 layers), DP = GPUs, MILP plans", "",
              "| cluster | GPUs | nodes | collectives | owner NS ms (greedy) | element-wise ms | step ms, publish "
              "overlapped (greedy) | publish ms | step ms, publish exposed | grad reduce ms (backward) | AdamW step "
              "ms, overlapped / exposed |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['cluster']} | {r['gpus']} | {r['nodes']} | {'two-level' if r['two_level'] else 'flat'} | "
                     f"{r['owner_ns_ms']:.1f} ({r['greedy_owner_ns_ms']:.1f}) | {r['elementwise_ms']:.1f} | "
                     f"{r['step_overlapped_ms']:.1f} ({r['greedy_step_overlapped_ms']:.1f}) | {r['publish_ms']:.1f} | "
                     f"{r['step_ms']:.1f} | {r['grad_reduce_ms']:.1f} | "
                     f"{r['adamw_step_overlapped_ms']:.1f} / {r['adamw_step_ms']:.1f} |")
    lines.append(f"\nPublished: {PAPER['source']}.")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, color in (("a800", "tab:red"), ("h200", "tab:blue")):
        sub = [r for r in rows if r["cluster"] == name and r["two_level"]]
        flat = [r for r in rows if r["cluster"] == name and not r["two_level"]]
        x = [r["gpus"] for r in sub]
        ax.plot(x, [r["step_overlapped_ms"] for r in sub], "o-", color=color,
                label=f"{name.upper()}: DMuon step, publish overlapped")
        ax.plot(x, [r["step_ms"] for r in sub], "s--", color=color, alpha=0.6,
                label=f"{name.upper()}: + publish exposed, two-level")
        ax.plot(x, [r["step_ms"] for r in flat], "^:", color=color, alpha=0.4,
                label=f"{name.upper()}: + publish exposed, flat")
    ax.plot([PAPER["gpus"]], [PAPER["optimizer_step_ms"]], "k*", markersize=14, label="DMuon paper, 256 A800s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (DP)")
    ax.set_ylabel("optimizer step, ms")
    ax.set_title("Qwen2.5-7B optimizer step, predicted (MILP plans)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "scaling", "simulate_scaling"))
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--clusters", nargs="+", default=["h200", "a800"])
    args = p.parse_args()
    warnings.simplefilter("ignore")
    profile = load_bench_kernels_profile(os.path.join(ROOT, "docs/results/kernels/bench_kernels_h200_2026-11-30.json"))
    h200 = CostModel(device_spec("H200"), profile)
    valid = validate(h200, cluster_spec("h200"))
    rows = scale(args.gpus, args.clusters, profile)
    report = {"validation": valid, "scaling": rows, "paper": PAPER,
              "cost_model": "H200: docs/results/kernels/bench_kernels_h200_2026-11-30.json profile + analytic at its measured rate; "
                            "A800: analytic (planning/clusters.json)"}
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(valid, rows)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    print(text)
    try:
        plot(rows, args.out + ".png")
    except ImportError:
        print("(matplotlib missing: no plot)")


if __name__ == "__main__":
    main()
