"""Step time vs GPU count: measured on the GPUs here (``measure``), and predicted for 8-256 GPUs (``simulate``).

    python bench/scaling.py measure --gpus 1 2 4 8 --preset qwen7b-4l --iters 12 --out docs/results/scaling/scaling
    python bench/scaling.py simulate --out docs/results/scaling/simulate_scaling

``measure`` ([multi-gpu-dp]): ms/iteration of DMuon, gather_then_compute and Megatron AdamW; for each
GPU count bench/e2e.py's measurement (global batch scaled with DP: 8 x GPUs; its JSON rows) and
`dmuon-verify` under torchrun (bf16, NCCL); writes <out>.json, <out>.md and <out>.png.

``simulate``: the DMuon optimizer step predicted by planning/simulate.py at 8-256 GPUs, next to the
DMuon paper's published point, and validated against every optimizer step measured on the H200s
lent here; writes <out>.json, <out>.md (tables) and <out>.png (plot, with Megatron's AdamW step beside
DMuon's; needs matplotlib). ``simulate --plot-only`` redraws <out>.png from an earlier <out>.json.
``simulate --overlap``: instead, the owner NS that ``--dmuon-overlap-step`` leaves exposed per iteration
(planning/simulate_overlap.py: off / on / on with the start in the last backward, % of off's NS
hidden, an eta sweep, the 1-H200 check) at ``--gpus``; writes <out>.json and <out>.md only:

    python bench/scaling.py simulate --overlap --gpus 8 64 256 --out docs/results/scaling/simulate_overlap_cpu_2026-12-04
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402
from cli_inputs import OneLineParser, read_json  # noqa: E402  (one-line usage errors, exit 2)
from harness import ROOT, Job, run  # noqa: E402
from megatron_dmuon.planning.cost_model import (CostModel, cluster_spec, device_spec,  # noqa: E402
                                                load_bench_kernels_profile)
from megatron_dmuon.planning.models import PRESETS, ParallelSpec  # noqa: E402
from megatron_dmuon.planning.owner_layout import megatron_bucket_size  # noqa: E402
from megatron_dmuon.planning.planners import plan_stage  # noqa: E402
from megatron_dmuon.planning.simulate import predict_adamw_step, predict_optimizer_step  # noqa: E402
from megatron_dmuon.planning.simulate_overlap import DEFAULT_ETA, simulate_overlap  # noqa: E402

MODES = ["adam", "dmuon", "gather_then_compute"]


def run_e2e(nproc, preset, iters, modes):
    """bench/e2e.py's JSON rows at ``nproc`` GPUs (global batch 8 per GPU)."""
    args = e2e.parse_args(["--preset", preset, "--nproc", str(nproc), "--iters", str(iters), "--modes", *modes,
                           "--extra", "--global-batch-size", str(8 * nproc)])
    return e2e.measure(args)["rows"]


def run_verify(nproc):
    r = run(Job(["--bf16", "--json"], program=["-m", "megatron_dmuon.testing.verify_cli"], nproc=nproc))
    lines = [l for l in r["stdout"].splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else {"ok": False, "error": r["output"][-2000:]}


def measure(args):
    results = {}
    for n in args.gpus:
        try:
            rows = run_e2e(n, args.preset, args.iters, args.modes)
        except Exception as exc:  # keep the other GPU counts; say what failed
            rows = [{"mode": mode, "error": f"{type(exc).__name__}: {exc}"} for mode in args.modes]
        results[n] = {"e2e": rows, "verify": run_verify(n) if n > 1 else None}
        print(json.dumps({n: results[n]}), flush=True)
        with open(args.out + ".json", "w") as f:  # after every count: a cut-off run keeps what it measured
            json.dump(results, f, indent=1)
    results = dict(sorted(results.items()))
    lines = ["| GPUs | mode | ms/iter | optimizer ms | vs AdamW |", "|---|---|---|---|---|"]
    for n, r in results.items():
        for row in r["e2e"]:
            if "error" not in row:
                lines.append(f"| {n} | {row['mode']} | {row['median_step_ms']:.1f} | "
                             f"{row['median_optimizer_ms']:.1f} | {row.get('vs_adam', float('nan')):.3f} |")
    open(args.out + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in args.modes:
        xs = [n for n, r in results.items() for row in r["e2e"] if row["mode"] == mode and "error" not in row]
        ys = [row["median_step_ms"] for n, r in results.items() for row in r["e2e"] if row["mode"] == mode and "error" not in row]
        ax.plot(xs, ys, marker="o", label=mode)
    ax.set_xlabel("GPUs (data parallel)")
    ax.set_ylabel("ms / iteration")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{args.preset}: step time vs GPU count")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)


# --- simulate: the published point, and the measured H200 steps the predictions are checked against
PAPER = {"model": "qwen2.5-7b", "gpus": 256, "device": "A800", "optimizer_step_ms": 22.0,
         "source": "DMuon paper: Qwen2.5-7B optimizer step 22 ms at 256 A800s"}

# Every optimizer step measured on the lent H200s (median ms; the 4-layer Qwen2.5-7B-shaped GPT,
# 32k vocab; ns-method auto, Keller 5 steps, no split rules, greedy NS-FLOP plans).
MEASURED = [
    # (label, dp, tp, overlap_param_gather, mode, ms, source)
    ("1 H200", 1, 1, False, "dmuon", None, "docs/results/scaling/scaling_h200x2_2026-11-30.json ['1']"),
    ("1 H200", 1, 1, False, "adam", None, "docs/results/scaling/scaling_h200x2_2026-11-30.json ['1']"),
    ("2 H200, DP=2", 2, 1, False, "dmuon", None, "docs/results/scaling/scaling_h200x2_2026-11-30.json ['2']"),
    ("2 H200, DP=2", 2, 1, False, "adam", None, "docs/results/scaling/scaling_h200x2_2026-11-30.json ['2']"),
    ("2 H200, DP=2 (bench/e2e.py)", 2, 1, False, "dmuon", 45.3, "bench/e2e.py on 2 H200s, 2026-11-30 (log not kept), no overlap flags"),
    ("2 H200, DP=2 (bench/e2e.py)", 2, 1, False, "adam", 21.9, "bench/e2e.py on 2 H200s, 2026-11-30 (log not kept), no overlap flags"),
    ("2 H200, DP=2, overlap", 2, 1, True, "dmuon", 39.8, "bench/e2e.py on 2 H200s, 2026-11-30 (log not kept), --overlap-grad-reduce --overlap-param-gather"),
    ("2 H200, DP=2, overlap", 2, 1, True, "adam", 19.2, "bench/e2e.py on 2 H200s, 2026-11-30 (log not kept), same flags"),
    ("1 H200, overlap", 1, 1, True, "dmuon", 75.4, "bench/e2e.py on 1 H200, 2026-11-30 (log not kept), global batch 4"),
    ("1 H200, overlap", 1, 1, True, "adam", 34.5, "bench/e2e.py on 1 H200, 2026-11-30 (log not kept), global batch 4"),
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


def simulated_markdown(valid, rows):
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


def plot_simulated(rows, path):
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
        ax.plot(x, [r["adamw_step_overlapped_ms"] for r in sub], "x-.", color=color, alpha=0.8,
                label=f"{name.upper()}: Megatron's AdamW step, publish overlapped")
    ax.plot([PAPER["gpus"]], [PAPER["optimizer_step_ms"]], "k*", markersize=14, label="DMuon paper, 256 A800s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (DP)")
    ax.set_ylabel("optimizer step, ms")
    ax.set_title("Qwen2.5-7B optimizer step, predicted (MILP plans; AdamW for scale)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- simulate --overlap: the NS the overlapped owner step leaves exposed
OVERLAP_SETTING = {"seq_length": 4096, "micro_batch": 1, "micro_batches": 4}
ETAS = (0.0, 0.1, 0.25, 0.5, 1.0)
# the 1-H200 runs of docs/overlap_step.md (Qwen2.5-7B-shaped 4 layers, GBS 4): ms/iteration
# (off, on); runs 1-3 under CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue: nothing overlaps), run 4 under 8
MEASURED_OVERLAP = [("Megatron-LM run B (30 its), 1 queue", 292.7, 301.1), ("main job run 1, 1 queue", 299.1, 300.5),
                    ("main job run 2 (priority stream), 1 queue", 298.1, 317.4),
                    ("main job run 3, CUDA-graph NS, 1 queue", 297.6, 303.9),
                    ("main job run 4, CUDA-graph NS, 8 queues", 299.8, 292.7),
                    ("Megatron-LM run 4, CUDA-graph NS, 8 queues", 282.5, 282.0)]


def overlap_rows(gpu_counts, clusters, bench_profile):
    """simulate_overlap at each (cluster, GPUs): Qwen2.5-7B, DP = GPUs, MILP plans on Megatron's
    --overlap-grad-reduce buckets (one plan per point, reused for every eta)."""
    model, rows = PRESETS["qwen2.5-7b"], []
    for name in clusters:
        cluster = cluster_spec(name)
        cost_model = CostModel(cluster.device, bench_profile if cluster.device.name == "H200" else None)
        for gpus in gpu_counts:
            par = ParallelSpec(dp=gpus, gpus_per_node=cluster.gpus_per_node)
            plan = plan_stage(model, par, cost_model, "milp", bucket_size=megatron_bucket_size(gpus, True),
                              milp_options={"time_limit_s": 10.0})
            by_eta = {eta: simulate_overlap(model, par, cluster, cost_model, plan=plan, eta=eta, **OVERLAP_SETTING)
                      for eta in ETAS}
            rows.append({"cluster": name, "gpus": gpus, "default": by_eta[DEFAULT_ETA],
                         "by_eta": {str(e): {"on": r["exposed_ns_ms"]["on"],
                                             "on_backward_start": r["exposed_ns_ms"]["on_backward_start"]}
                                    for e, r in by_eta.items()}})
            print(f"{name} {gpus}: {rows[-1]['default']['exposed_ns_ms']}", flush=True)
    return rows


def overlap_check(cost_model, cluster):
    """The 1-H200 4-layer run: predicted on - off against the measured ms/iteration."""
    model, par = PRESETS["qwen7b-4l"], ParallelSpec(dp=1)
    plan = plan_stage(model, par, cost_model, "greedy", bucket_size=megatron_bucket_size(1, True))
    out = {}
    for eta in (0.0, DEFAULT_ETA):
        r = simulate_overlap(model, par, cluster, cost_model, plan=plan, eta=eta, **OVERLAP_SETTING)
        out[str(eta)] = {"on_minus_off_ms": r["exposed_ns_ms"]["on"] - r["exposed_ns_ms"]["off"],
                         "stack_cut_ms": r["stack_cut_ms"], "exposed_ns_ms": r["exposed_ns_ms"],
                         "iteration_ms": r["iteration_ms"], "need_groups": r["need_groups"]}
    return {"predicted": out, "measured": [{"run": run, "off_ms": off, "on_ms": on, "on_minus_off_ms": on - off}
                                           for run, off, on in MEASURED_OVERLAP]}


def overlap_markdown(rows, check):
    s = OVERLAP_SETTING
    lines = [f"## Exposed owner NS per iteration, Qwen2.5-7B (28 layers), DP = GPUs, MILP plans, eta {DEFAULT_ETA}", "",
             f"Per GPU: micro-batch {s['micro_batch']} x seq {s['seq_length']}, {s['micro_batches']} micro-batches per "
             "iteration; Megatron's --overlap-grad-reduce buckets (one need group each); two-level collectives. "
             "'on + bwd': the start in the last micro-batch's backward (--clip-grad 0). % hidden: of off's exposed NS.", "",
             "| cluster | GPUs | need groups (with NS) | fwd / bwd ms per micro-batch | owner NS ms, per shape / cut "
             "per group | exposed NS ms: off | on | on + bwd | % hidden: on | on + bwd | exposed NS % of iteration "
             "at 1 / 4 / 16 micro-batches: off | on |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        r = row["default"]
        e, h = r["exposed_ns_ms"], r["hidden_fraction"]

        def shares(mode):
            return " / ".join(f"{100 * e[mode] / (m * (r['forward_ms'] + r['backward_ms']) + r['elementwise_ms'] + e[mode]):.1f}"
                              for m in (1, 4, 16))

        lines.append(f"| {row['cluster'].upper()} | {row['gpus']} | {r['need_groups']} ({r['groups_with_ns']}) | "
                     f"{r['forward_ms']:.0f} / {r['backward_ms']:.0f} | {r['owner_ns_off_ms']:.1f} / "
                     f"{r['owner_ns_cut_ms']:.1f} | {e['off']:.1f} | {e['on']:.1f} | {e['on_backward_start']:.1f} | "
                     f"{100 * h['on']:.0f}% | {100 * h['on_backward_start']:.0f}% | {shares('off')} | {shares('on')} |")
    lines += ["", "## Exposed NS ms against eta (on / on + bwd)", "",
              "| cluster | GPUs | " + " | ".join(f"eta {e}" for e in ETAS) + " |", "|---|---:|" + "---:|" * len(ETAS)]
    for row in rows:
        lines.append(f"| {row['cluster'].upper()} | {row['gpus']} | " + " | ".join(
            f"{row['by_eta'][str(e)]['on']:.1f} / {row['by_eta'][str(e)]['on_backward_start']:.1f}" for e in ETAS) + " |")
    lines += ["", "## Check: the 1-H200 4-layer runs (docs/overlap_step.md), on - off in ms/iteration", "",
              "| source | on - off ms |", "|---|---:|"]
    for eta, p in check["predicted"].items():
        lines.append(f"| predicted, eta {eta} (stack cut +{p['stack_cut_ms']:.1f} ms, {p['need_groups']} groups) | "
                     f"{p['on_minus_off_ms']:+.1f} |")
    for m in check["measured"]:
        lines.append(f"| measured, {m['run']}: {m['off_ms']} -> {m['on_ms']} | {m['on_minus_off_ms']:+.1f} |")
    return "\n".join(lines)


def simulate_overlap_table(args, profile):
    h200 = CostModel(device_spec("H200"), profile)
    check = overlap_check(h200, cluster_spec("h200"))
    rows = overlap_rows(args.gpus, args.clusters, profile)
    report = {"setting": OVERLAP_SETTING, "default_eta": DEFAULT_ETA, "etas": list(ETAS), "rows": rows, "check": check,
              "cost_model": "H200: docs/results/kernels/bench_kernels_h200_2026-11-30.json profile + analytic at its "
                            "measured rate; A800: analytic; model rate: planning/clusters.json model_tflops"}
    write_report(args.out, report, overlap_markdown(rows, check))


def write_report(out: str, report: dict, text: str) -> None:
    """OUT.json and OUT.md, and the table on stdout."""
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text + "\n")
    print(text)


def simulate(args):
    warnings.simplefilter("ignore")
    profile = load_bench_kernels_profile(os.path.join(ROOT, "docs/results/kernels/bench_kernels_h200_2026-11-30.json"))
    if args.overlap:
        return simulate_overlap_table(args, profile)
    h200 = CostModel(device_spec("H200"), profile)
    valid = validate(h200, cluster_spec("h200"))
    rows = scale(args.gpus, args.clusters, profile)
    report = {"validation": valid, "scaling": rows, "paper": PAPER,
              "cost_model": "H200: docs/results/kernels/bench_kernels_h200_2026-11-30.json profile + analytic at its measured rate; "
                            "A800: analytic (planning/clusters.json)"}
    write_report(args.out, report, simulated_markdown(valid, rows))
    try:
        plot_simulated(rows, args.out + ".png")
    except ImportError:
        print("(matplotlib missing: no plot)")


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="how", required=True)
    m = sub.add_parser("measure", help="ms/iteration per GPU count on this machine (bench/e2e.py, dmuon-verify)")
    m.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    m.add_argument("--preset", default="qwen7b-4l")
    m.add_argument("--iters", type=int, default=12)
    m.add_argument("--modes", nargs="+", default=MODES)
    m.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "scaling", "scaling"))
    s = sub.add_parser("simulate", help="the optimizer step predicted at 8-256 GPUs, validated on the H200 measurements")
    s.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "scaling", "simulate_scaling"))
    s.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    s.add_argument("--clusters", nargs="+", default=["h200", "a800"])
    s.add_argument("--plot-only", action="store_true",
                   help="redraw <out>.png from the <out>.json an earlier simulate wrote (no planning)")
    s.add_argument("--overlap", action="store_true",
                   help="the overlapped owner step's exposed NS instead (writes <out>.json/.md only)")
    args = p.parse_args(argv)
    for name in getattr(args, "clusters", []):  # planning/clusters.json's
        try:
            cluster_spec(name)
        except ValueError as e:
            p.error(f"--clusters {name}: {e}")
    if args.how == "measure" and args.preset not in e2e.PRESETS:
        p.error(f"--preset {args.preset}: one of {', '.join(sorted(e2e.PRESETS))}")
    if getattr(args, "plot_only", False):
        if args.overlap:
            p.error("--plot-only redraws simulate's scaling plot; simulate --overlap writes no plot: drop one of them")
        report = read_json(p, "--out", args.out + ".json", "the OUT of an earlier `simulate --out OUT`",
                           need=("scaling",))
        return plot_simulated(report["scaling"], args.out + ".png")
    measure(args) if args.how == "measure" else simulate(args)


if __name__ == "__main__":
    main()
