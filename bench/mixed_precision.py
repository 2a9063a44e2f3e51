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
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from e2e import PRESETS, add_ratios_to_adam, run_main_job  # noqa: E402

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
    rows = [run_main_job(mode, args.nproc, [*PRESETS[args.preset], *MODES[mode], "--overlap-grad-reduce",
                                             "--overlap-param-gather", "--train-iters", str(args.iters), *args.extra],
                         tail=8) for mode in args.modes]
    add_ratios_to_adam(rows)
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
