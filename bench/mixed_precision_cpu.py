"""CPU (gloo) measurements behind docs/mixed_precision.md: loss curves of the tiny GPT on text with
bf16 publish, FP8 publish (e4m3, e5m2) and bf16 momentum at DP=2, and the bf16 distance to the fp32
reference at DP=1, 2, 4 (20 steps, synthetic tokens, as tests/test_mixed_precision.py).

    python bench/mixed_precision_cpu.py --steps 60 --out docs/results/mixed_precision/mixed_precision_cpu   # ~3 min on 2 cores
"""
from __future__ import annotations

import argparse
import json

RUNS = {  # label -> train_text kwargs (all bf16 params, bf16 NS, DP=2)
    "fp32 params (no bf16)": dict(shape_kw={}, ns_dtype="float32"),
    "bf16, bf16 publish": {},
    "bf16, FP8 e4m3 publish": dict(publish_dtype="fp8_e4m3"),
    "bf16, FP8 e5m2 publish": dict(publish_dtype="fp8_e5m2"),
    "bf16, bf16 momentum": dict(muon_kw=dict(momentum_dtype="bfloat16")),
    "bf16, FP8 e4m3 + bf16 momentum": dict(publish_dtype="fp8_e4m3", muon_kw=dict(momentum_dtype="bfloat16")),
}


def main():
    from megatron_dmuon.testing.compare import full_params, rel_diffs, run_dmuon, run_reference
    from megatron_dmuon.testing.multiproc import run_distributed

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=None, help="PREFIX: writes PREFIX.json and PREFIX.png")
    args = p.parse_args()
    curves = {}
    for label, kw in RUNS.items():
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


if __name__ == "__main__":
    main()
