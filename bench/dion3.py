"""Owner-step time of Muon, NorMuon and Dion3 (f = 1, 1/4, 1/8) on Qwen2.5-7B layer shapes.

    python bench/dion3.py [--layers 1] [--fractions 1 0.25 0.125] [--reps 10] [--out docs/results/dion3/bench_dion3_h200]

One process, no process group: ``OwnerMuonAdamW`` (the owner step DMuon runs) owns every matrix
of ``--layers`` decoder layers (q, o 3584x3584; k, v 512x3584; gate, up 18944x3584; down
3584x18944), with Megatron-LM's Muon defaults (DMuonConfig: bf16 NS, 5-step 'you' coefficients,
the kernels' autotuned method). Each rule is timed in the same process, interleaved rep by rep,
on the same gradients (CUDA events, median of ``--reps`` after warm-up); ratios are vs Muon.
Prints one JSON document and a markdown table; writes <out>.json/.md when ``--out`` is given.
On CPU every dimension is divided by ``--scale`` (default 8 there) so it finishes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dmuon.runtime.owner_step import MatrixInfo, OwnerMuonAdamW  # noqa: E402

QWEN25_7B_LAYER = {"q": (3584, 3584), "k": (512, 3584), "v": (512, 3584), "o": (3584, 3584),
                   "gate": (18944, 3584), "up": (18944, 3584), "down": (3584, 18944)}


def default_settings(**overrides):
    """Megatron-LM's `--optimizer muon` defaults, as DMuonConfig() carries them (no megatron import)."""
    from megatron_dmuon.runtime.owner_step import MuonSettings

    kw = dict(momentum=0.9, nesterov=False, coefficients="you", ns_steps=5, ns_dtype=torch.bfloat16,
              scale_mode="spectral", ns_method="auto")
    kw.update(overrides)
    return MuonSettings(**kw)


def build(rule: str, fraction: float, layers: int, scale: int, device):
    params, infos = [], []
    g = torch.Generator(device="cpu").manual_seed(0)
    for layer in range(layers):
        for name, (r, c) in QWEN25_7B_LAYER.items():
            r, c = max(1, r // scale), max(1, c // scale)
            p = torch.nn.Parameter(torch.randn(r, c, generator=g).mul_(0.02).to(device))
            p.grad = torch.randn(r, c, generator=g).to(device)
            params.append(p)
            infos.append(MatrixInfo(f"layer{layer}.{name}", (r, c)))
    settings = default_settings(update=rule, fraction=fraction)
    opt = OwnerMuonAdamW([{"params": params, "use_muon": True}], lr=1e-3, weight_decay=0.1, muon=settings)
    for p, info in zip(params, infos):
        opt.register_matrix(p, info)
    opt.init_state()
    return opt


def timer(device):
    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        return run

    def run(fn):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.25, 0.125])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--scale", type=int, default=None, help="divide every dimension (default 1 on CUDA, 8 on CPU)")
    p.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = args.scale or (1 if device.type == "cuda" else 8)
    cases = [("muon", 1.0), ("normuon", 1.0)] + [("dion3", f) for f in args.fractions]
    opts = {case: build(*case, args.layers, scale, device) for case in cases}
    run = timer(device)
    for _ in range(args.warmup):  # compiles/tunes every selected shape before timing
        for opt in opts.values():
            run(opt.step)
    times = {case: [] for case in cases}
    for _ in range(args.reps):  # interleaved: clock drift hits every rule alike
        for case, opt in opts.items():
            times[case].append(run(opt.step))
    muon_ms = statistics.median(times[("muon", 1.0)])
    rows = []
    for (rule, f), ts in times.items():
        ms = statistics.median(ts)
        rows.append({"rule": rule, "fraction": f, "median_ms": ms, "vs_muon": ms / muon_ms,
                     "ns_calls": opts[(rule, f)].stats["ns_calls"]})
    doc = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "scale": scale,
           "layers": args.layers, "reps": args.reps, "torch": torch.__version__, "rows": rows}
    lines = [f"Owner step, {args.layers} Qwen2.5-7B layer(s) ({doc['device']}, dims / {scale}), median of {args.reps}",
             "", "| rule | f | ms | vs Muon | NS calls |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['rule']} | {r['fraction']:g} | {r['median_ms']:.2f} | {r['vs_muon']:.3f} | {r['ns_calls']} |"
              for r in rows]
    print(json.dumps(doc, indent=1))
    print("\n".join(lines))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
