"""BF16 and FP8 publish on one GPU: step time, optimizer time, peak memory and optimizer state vs AdamW.

    python bench/mixed_precision.py                       # one H200, ~3 minutes

Runs examples/pretrain_gpt.py (bf16, --use-distributed-optimizer semantics built in) once per mode
under torchrun, all modes in one invocation on the same GPU, then prints JSON and a markdown table:
median ms/iteration and optimizer ms over the second half of the iterations,
torch.cuda.max_memory_allocated, optimizer-state bytes per rank (counted from the state tensors)
and the bytes the param all-gathers deliver per step (the packed FP8 blocks vs the bf16 buckets;
on one GPU nothing crosses a wire, at DP=D each rank sends (D-1)/D of it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from e2e import PRESETS  # noqa: E402

PRESETS = dict(PRESETS)
# a small GPT (~0.3B with the 32k vocab): 12 layers of width 1024, seq 2048
PRESETS["gpt-small"] = ["--num-layers", "12", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
                        "--num-attention-heads", "16", "--num-query-groups", "16", "--vocab-size", "32000",
                        "--seq-length", "2048", "--micro-batch-size", "4", "--global-batch-size", "8", "--bf16"]
MODES = {
    "adam": ["--optimizer", "adam"],
    "dmuon_bf16": ["--optimizer", "dmuon"],
    "dmuon_fp8_publish": ["--optimizer", "dmuon", "--dmuon-publish-dtype", "fp8_e4m3"],
    "dmuon_fp8_publish_bf16_momentum": ["--optimizer", "dmuon", "--dmuon-publish-dtype", "fp8_e4m3",
                                        "--dmuon-momentum-dtype", "bf16"],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gpt-small", choices=sorted(PRESETS))
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    rows = []
    for mode in args.modes:
        out = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               os.path.join(ROOT, "examples", "pretrain_gpt.py"), *PRESETS[args.preset], *MODES[mode],
               "--overlap-grad-reduce", "--overlap-param-gather",
               "--train-iters", str(args.iters), "--log-interval", "4", "--timing-json", out, *args.extra]
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [l for l in (proc.stdout + proc.stderr).splitlines()
                 if l.startswith((" iteration", ">", "Traceback", "  File")) or "Error" in l]
        print("\n".join(lines[-8:]), flush=True)
        if proc.returncode != 0 or not os.path.exists(out):
            rows.append({"mode": mode, "error": (proc.stdout + proc.stderr)[-3000:]})
            continue
        rows.append({**json.load(open(out))["summary"], "mode": mode})
    base = next((r for r in rows if r["mode"] == "adam" and "error" not in r), None)
    for r in rows:
        if base and "error" not in r:
            r["vs_adam"] = r["median_step_ms"] / base["median_step_ms"]
    report = {"preset": args.preset, "nproc": args.nproc, "iters": args.iters, "rows": rows}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    mib = 2 ** 20
    print("\n| mode | ms/iter | optimizer ms | vs AdamW | peak MiB | optimizer state MiB/rank | "
          "AdamW DistOpt state MiB/rank | gathered MiB/step | first loss | last loss |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | error | | | | | | | | |")
            continue
        publish = r.get("publish_gathered_bytes")
        print(f"| {r['mode']} | {r['median_step_ms']:.1f} | {r['median_optimizer_ms']:.1f} | "
              f"{r.get('vs_adam', float('nan')):.3f} | {r.get('max_memory_allocated_mib', float('nan')):.0f} | "
              f"{r['optimizer_state_bytes'] / mib:.1f} | {r['adamw_distopt_state_bytes'] / mib:.1f} | "
              f"{(publish or 0) / mib:.1f} | {r['first_loss']:.3f} | {r['last_loss']:.3f} |")


if __name__ == "__main__":
    main()
