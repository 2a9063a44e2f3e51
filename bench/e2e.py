"""End-to-end step time: DMuon vs Megatron AdamW (and optional baselines) on the same model, one run.

    python bench/e2e.py --preset qwen7b-4l --iters 12 --modes adam dmuon gather_then_compute

Runs examples/pretrain_gpt.py under torchrun once per mode, then prints JSON and a markdown table
(median ms/iteration and optimizer ms over the second half of the iterations).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {
    # Qwen2.5-7B-shaped layers (4 of them), as in the [megatron-dp] acceptance
    "qwen7b-4l": ["--num-layers", "4", "--hidden-size", "3584", "--ffn-hidden-size", "18944",
                  "--num-attention-heads", "28", "--num-query-groups", "4", "--vocab-size", "32000",
                  "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16"],
    "tiny": ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "352", "--seq-length", "128",
             "--micro-batch-size", "4", "--global-batch-size", "16"],
}


def run_main_job(mode: str, nproc: int, job_args: list, tail: int = 12) -> dict:
    """One examples/pretrain_gpt.py run under torchrun: its summary (with ``mode``), or the error."""
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "examples", "pretrain_gpt.py"), *job_args, "--log-interval", "4", "--timing-json", out]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in (proc.stdout + proc.stderr).splitlines()
             if l.startswith((" iteration", ">", "Traceback", "  File")) or "Error" in l]
    print("\n".join(lines[-tail:]), flush=True)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"mode": mode, "error": (proc.stdout + proc.stderr)[-3000:]}
    return {**json.load(open(out))["summary"], "mode": mode}


def add_ratios_to_adam(rows: list) -> None:
    """``vs_adam``: each row's median step time over the AdamW row's of the same run."""
    base = next((r for r in rows if r["mode"] == "adam" and "error" not in r), None)
    for r in rows:
        if base and "error" not in r:
            r["vs_adam"] = r["median_step_ms"] / base["median_step_ms"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--modes", nargs="+", default=["adam", "dmuon"],
                   help="adam, dmuon, gather_then_compute, megatron_layerwise; ':gram'/':standard' picks the NS "
                        "method, '+adaptive' (any --dmuon-coefficients name) the NS schedule, '~graph' the NS launch mode, "
                        "megatron_layerwise@duplicated the TP mode of Megatron's own Muon")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    rows = []
    for mode in args.modes:
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
        rows.append(run_main_job(mode, args.nproc, [*PRESETS[args.preset], *opt, "--train-iters", str(args.iters),
                                                     *args.extra]))
    add_ratios_to_adam(rows)
    print(json.dumps({"preset": args.preset, "nproc": args.nproc, "rows": rows}, indent=1))
    print("\n| mode | ms/iter | optimizer ms | vs AdamW | first loss | last loss |\n|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | error | | | | |")
        else:
            print(f"| {r['mode']} | {r['median_step_ms']:.1f} | {r['median_optimizer_ms']:.1f} | "
                  f"{r.get('vs_adam', float('nan')):.3f} | {r['first_loss']:.3f} | {r['last_loss']:.3f} |")


if __name__ == "__main__":
    main()
