"""Mixed precision measured: BF16 and FP8 publish against AdamW on one GPU, and their loss curves on CPU.

    python bench/mixed_precision.py speed                  # one H200, ~3 minutes
    python bench/mixed_precision.py accuracy --steps 60 --out docs/results/mixed_precision/mixed_precision_cpu   # ~3 min on 2 cores

``speed``: the main job (bf16, --use-distributed-optimizer semantics built in; bench/e2e.py's runner)
once per mode under torchrun, all modes in one invocation on the same GPU, then JSON and a markdown
table: median ms/iteration and optimizer ms over the second half of the iterations,
torch.cuda.max_memory_allocated, optimizer-state bytes per rank (counted from the state tensors)
and the bytes the param all-gathers deliver per step (the packed FP8 blocks vs the bf16 buckets;
on one GPU nothing crosses a wire, at DP=D each rank sends (D-1)/D of it).

``accuracy`` (CPU, gloo; the measurements behind docs/mixed_precision.md): loss curves of the tiny GPT
on text with bf16 publish, FP8 publish (e4m3, e5m2) and bf16 momentum at DP=2, and the bf16 distance
to the fp32 reference at DP=1, 2, 4 (20 steps, synthetic tokens, as tests/megatron/test_publish.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from e2e import PRESETS, add_ratios_to_adam, run_main_job  # noqa: E402
from cli_inputs import OneLineParser  # noqa: E402  (one-line usage errors, exit 2)

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


def speed(args):
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


ACCURACY_RUNS = {  # label -> train_text kwargs (all bf16 params, bf16 NS, DP=2)
    "fp32 params (no bf16)": dict(shape_kw={}, ns_dtype="float32"),
    "bf16, bf16 publish": {},
    "bf16, FP8 e4m3 publish": dict(publish_dtype="fp8_e4m3"),
    "bf16, FP8 e5m2 publish": dict(publish_dtype="fp8_e5m2"),
    "bf16, bf16 momentum": dict(muon_kw=dict(momentum_dtype="bfloat16")),
    "bf16, FP8 e4m3 + bf16 momentum": dict(publish_dtype="fp8_e4m3", muon_kw=dict(momentum_dtype="bfloat16")),
}


def accuracy(args):
    from megatron_dmuon.testing.compare import full_params, rel_diffs, run_dmuon, run_reference
    from megatron_dmuon.testing.multiproc import run_distributed

    curves = {}
    for label, kw in ACCURACY_RUNS.items():
        kw = dict(dict(shape_kw=dict(bf16=True), ns_dtype="bfloat16"), **kw)
        r = run_distributed("megatron_dmuon.testing.mixed_precision:train_text", 2,
                            kwargs=dict(steps=args.steps, grad_accum=1, count_bytes=False, **kw))[0]
        curves[label] = {"losses": r["losses"], "state_bytes": r["state_bytes"]}
        print(f"{label}: loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, state/rank {r['state_bytes']}", flush=True)
    band = {}
    for dp in (1, 2, 4):
        kw = dict(steps=20, grad_accum=1)
        res = run_dmuon(dp, shape_kw=dict(bf16=True), ns_dtype="bfloat16", **kw)
        ref = run_reference(dp, **kw)
        band[dp] = {"max_rel_param_diff": max(rel_diffs(full_params(res), ref["params"]).values()),
                    "max_rel_loss_diff": max(abs(a - b) / b for a, b in zip(res[0]["losses"], ref["losses"]))}
        print(f"bf16 vs fp32 reference at DP={dp}: {band[dp]}", flush=True)
    report = {"steps": args.steps, "curves": curves, "bf16_vs_fp32_reference": band}
    base = curves["bf16, bf16 publish"]["losses"]
    print("\n| run (DP=2, text) | first loss | mean loss, last 10 steps | vs bf16 publish | Muon momentum bytes/rank |")
    print("|---|---|---|---|---|")
    for label, c in curves.items():
        tail = sum(c["losses"][-10:]) / 10
        print(f"| {label} | {c['losses'][0]:.3f} | {tail:.3f} | {tail - sum(base[-10:]) / 10:+.3f} | "
              f"{c['state_bytes']['momentum']} |")
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for label, c in curves.items():
            ax.plot(range(1, len(c["losses"]) + 1), c["losses"], label=label, lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("lm loss (nats/byte)")
        ax.set_title("Tiny megatron-core GPT, DMuon DP=2 (gloo, CPU), Python stdlib bytes")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="measure", required=True)
    s = sub.add_parser("speed", help="step time, memory and optimizer state vs AdamW: the main job, one GPU")
    s.add_argument("--preset", default="gpt-small", choices=sorted(PRESETS))
    s.add_argument("--nproc", type=int, default=1)
    s.add_argument("--iters", type=int, default=16)
    s.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    s.add_argument("--out", default=None, help="write the JSON here too")
    s.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    a = sub.add_parser("accuracy", help="loss curves and the bf16 distance to the fp32 reference: CPU, gloo")
    a.add_argument("--steps", type=int, default=60)
    a.add_argument("--out", default=None, help="PREFIX: writes PREFIX.json and PREFIX.png")
    args = p.parse_args(argv)
    speed(args) if args.measure == "speed" else accuracy(args)


if __name__ == "__main__":
    main()
