"""End-to-end step time: DMuon vs Megatron AdamW (and optional baselines) on the same model, one run.

    python bench/e2e.py --preset qwen7b-4l --iters 12 --modes adam dmuon gather_then_compute

Runs the main job (bench/harness.py) under torchrun once per mode (per round with --repeat), then
prints JSON (``--out``: written there too) and a markdown table (median ms/iteration and optimizer ms
over the second half of the iterations; with rounds, the median over the rounds).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Job, add_layer_args, command, job_layer_args, layers_of, progress_tail, run  # noqa: E402
from cli_inputs import OneLineParser  # noqa: E402  (one-line usage errors, exit 2)

PRESETS = {
    # Qwen2.5-7B-shaped layers (4 of them), as in the [megatron-dp] acceptance
    "qwen7b-4l": ["--num-layers", "4", "--hidden-size", "3584", "--ffn-hidden-size", "18944",
                  "--num-attention-heads", "28", "--num-query-groups", "4", "--vocab-size", "32000",
                  "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16"],
    "tiny": ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "352", "--seq-length", "128",
             "--micro-batch-size", "4", "--global-batch-size", "16"],
}


def run_main_job(mode: str, nproc: int, job_args: list, tail: int = 12) -> dict:
    """One main-job run under torchrun: its summary (with ``mode``), or the error."""
    r = run(Job([*job_args, "--log-interval", "4"], nproc=nproc, timing_json=True, show=True))
    print(progress_tail(r["output"], tail), flush=True)
    if not r["ok"]:
        return {"mode": mode, "error": r["error"]}
    return {**r["timing"]["summary"], "mode": mode}


def add_ratios_to_adam(rows: list) -> None:
    """``vs_adam``: each row's median step time over the AdamW row's of the same run."""
    base = next((r for r in rows if r["mode"] == "adam" and "error" not in r), None)
    for r in rows:
        if base and "error" not in r:
            r["vs_adam"] = r["median_step_ms"] / base["median_step_ms"]


def mode_args(mode: str, args) -> list:
    """The main job's arguments for one mode name (see --modes)."""
    mode, _, overlap = mode.partition("^")
    name, _, tp_mode = mode.partition("@")
    name, _, launch = name.partition("~")
    name, _, coefficients = name.partition("+")
    opt = ["--optimizer", "adam"] if name == "adam" else ["--optimizer", "dmuon", "--dmuon-mode", name.split(":")[0]]
    if ":" in name:
        opt += ["--dmuon-ns-method", name.split(":")[1]]
    if coefficients:
        opt += ["--dmuon-coefficients", coefficients]
    if launch:
        opt += ["--dmuon-ns-launch", launch]
    if tp_mode:
        opt += ["--muon-tp-mode", tp_mode]
    if overlap:
        opt += ["--dmuon-overlap-step", overlap]
    return [*PRESETS[args.preset], *opt, "--train-iters", str(args.iters), *job_layer_args(args), *args.extra]


def merge_rounds(runs: list) -> dict:
    """One mode's row: its only run, or the first run's summary with the timings replaced by their
    median over the rounds (every round's own figures kept under 'rounds')."""
    ok = [r for r in runs if "error" not in r]
    if len(runs) == 1 or not ok:
        return runs[0]

    def median(key):
        vals = sorted(r[key] for r in ok)
        return vals[len(vals) // 2]

    row = {**ok[0], "median_step_ms": median("median_step_ms"), "median_optimizer_ms": median("median_optimizer_ms"),
           "rounds": [{k: r.get(k) for k in ("median_step_ms", "median_optimizer_ms", "median_optimizer_ms_per_rank",
                                              "error")} for r in runs]}
    if all(r.get("median_optimizer_ms_per_rank") for r in ok):
        row["median_optimizer_ms_per_rank"] = [sorted(v)[len(v) // 2] for v in
                                               zip(*(r["median_optimizer_ms_per_rank"] for r in ok))]
    return row


def parse_args(argv=None):
    p = OneLineParser()
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--modes", nargs="+", default=["adam", "dmuon"],
                   help="adam, dmuon, gather_then_compute, megatron_layerwise; ':gram'/':standard' picks the NS "
                        "method, '+adaptive' (any --dmuon-coefficients name) the NS schedule, '~graph' the NS launch mode, "
                        "megatron_layerwise@duplicated the TP mode of Megatron's own Muon, '^on'/'^sync' the "
                        "--dmuon-overlap-step mode (with --extra --overlap-grad-reduce --overlap-param-gather)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds: every mode runs once per round, in turn (GPU clocks drift over minutes; "
                        "a row then reports the median over its rounds, each round's figures under 'rounds')")
    p.add_argument("--out", default=None, help="write the JSON document here too")
    p.add_argument("--print-command", metavar="MODE", default=None,
                   help="print the main job's command line for MODE under torchrun (one line; --extra appended) and exit")
    add_layer_args(p)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    return p.parse_args(argv)


def measure(args) -> dict:
    """Every mode (every round): the JSON document ``main`` prints, {"preset", "nproc", "rows"}."""
    rounds = [[run_main_job(mode, args.nproc, mode_args(mode, args)) for mode in args.modes] for _ in range(args.repeat)]
    rows = [merge_rounds([r[i] for r in rounds]) for i in range(len(args.modes))]
    add_ratios_to_adam(rows)
    return {"preset": args.preset, "nproc": args.nproc, "rows": rows}


def main(argv=None):
    args = parse_args(argv)
    if args.print_command:
        print(" ".join(command(Job(mode_args(args.print_command, args), nproc=args.nproc))))
        return
    doc = measure(args)
    rows = doc["rows"]
    print(json.dumps(doc, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print("\n| mode | layers | ms/iter | optimizer ms | slowest rank's optimizer ms | vs AdamW | first loss | last loss "
          "| NS paths / AdamW |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | | error | | | | | | |")
        else:
            slowest = max(r.get("median_optimizer_ms_per_rank") or [r["median_optimizer_ms"]])
            paths = sorted(set((r.get("ns_paths") or {}).values())) or [r.get("adam_impl") or "—"]
            print(f"| {r['mode']} | {layers_of(r)} | {r['median_step_ms']:.1f} | {r['median_optimizer_ms']:.1f} | "
                  f"{slowest:.1f} | {r.get('vs_adam', float('nan')):.3f} | {r['first_loss']:.3f} | {r['last_loss']:.3f} "
                  f"| {'; '.join(paths)} |")


if __name__ == "__main__":
    main()
