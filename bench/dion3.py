"""Muon, NorMuon and Dion3 measured: the owner step's time, and the loss curves of a training run.

    python bench/dion3.py step [--layers 1] [--fractions 1 0.25 0.125] [--reps 10] [--out docs/results/dion3/bench_dion3_h200]
    python bench/dion3.py loss [--nproc 1] [--iters 300] [--out docs/results/dion3/dion3_loss_h200] [--extra ...]

``step``: one process, no process group: ``OwnerMuonAdamW`` (the owner step DMuon runs) owns every matrix
of ``--layers`` decoder layers (q, o 3584x3584; k, v 512x3584; gate, up 18944x3584; down
3584x18944), with Megatron-LM's Muon defaults (DMuonConfig: bf16 NS, 5-step 'you' coefficients,
the kernels' autotuned method). Each rule is timed in the same process, interleaved rep by rep,
on the same gradients (CUDA events, median of ``--reps`` after warm-up); ratios are vs Muon.
Prints one JSON document and a markdown table; writes <out>.json/.md when ``--out`` is given.
On CPU every dimension is divided by ``--scale`` (default 8 there) so it finishes.

``loss``: the main job (bench/harness.py) once per rule under torchrun on a small GPT (same data, seed,
lr schedule and model; bf16 on GPUs); each run's per-iteration losses from its timing JSON. Writes
<out>.json, <out>.md (final loss averaged over the last 10% of iterations, median step and optimizer
ms) and <out>.png (loss vs iteration, smoothed). ``--extra`` goes to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, Job, has_cuda, run  # noqa: E402
from cli_inputs import OneLineParser  # noqa: E402  (one-line usage errors, exit 2)
from megatron_dmuon.runtime.owner_step import MatrixInfo, OwnerMuonAdamW, with_ns_choices  # noqa: E402

# (label, flags): the rules compared; Dion3 at f = 1/4 and 1/8 with NorDion2's lr (no f factor).
# Dion3's momentum has no Nesterov form (it is refused), so its rows turn off the job's default Nesterov.
DION3 = ["--dmuon-update", "dion3", "--muon-no-nesterov"]
RULES = [
    ("muon", []),
    ("normuon", ["--dmuon-update", "normuon"]),
    ("dion3 f=1/4", [*DION3, "--dmuon-fraction", "0.25"]),
    ("dion3 f=1/8", [*DION3, "--dmuon-fraction", "0.125"]),
    ("dion3 f=1/4 lr/sqrt(f)", [*DION3, "--dmuon-fraction", "0.25", "--dmuon-fraction-lr", "inverse_sqrt"]),
]
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "8",
         "--num-query-groups", "4", "--seq-length", "256", "--global-batch-size", "32", "--micro-batch-size", "8",
         "--lr", "3e-3", "--lr-warmup-iters", "20", "--log-interval", "50"]
QWEN25_7B_LAYER = {"q": (3584, 3584), "k": (512, 3584), "v": (512, 3584), "o": (3584, 3584),
                   "gate": (18944, 3584), "up": (18944, 3584), "down": (3584, 18944)}


def default_settings(**overrides):
    """Megatron-LM's `--optimizer muon` defaults (MuonSettings' own) with the measured NS choice."""
    from megatron_dmuon.runtime.owner_step import MuonSettings

    return MuonSettings(**{"ns_method": "auto", **overrides})


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
    for p, info in zip(params, with_ns_choices(infos, settings, device)):
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


def step(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = args.scale or (1 if device.type == "cuda" else 8)
    cases = [("muon", 1.0), ("normuon", 1.0)] + [("dion3", f) for f in args.fractions]
    opts = {case: build(*case, args.layers, scale, device) for case in cases}
    time_ms = timer(device)
    for _ in range(args.warmup):  # compiles/tunes every selected shape before timing
        for opt in opts.values():
            time_ms(opt.step)
    times = {case: [] for case in cases}
    for _ in range(args.reps):  # interleaved: clock drift hits every rule alike
        for case, opt in opts.items():
            times[case].append(time_ms(opt.step))
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


def run_rule(label, flags, args, workdir):
    """One main-job run of a rule: its losses and times, or the error."""
    timing = os.path.join(workdir, label.replace(" ", "_").replace("/", "-") + ".json")
    r = run(Job(["--optimizer", "dmuon", *MODEL, "--train-iters", str(args.iters), *(["--bf16"] if has_cuda() else []),
                 *flags, *args.extra], nproc=args.nproc, timing_json=timing))
    if not r["ok"]:
        return {"label": label, "error": r["error"]}
    doc = r["timing"]
    losses = [t["loss"] for t in doc["iterations"]]
    tail = losses[-max(1, len(losses) // 10):]
    return {"label": label, "flags": flags, "losses": losses, "final_loss": sum(tail) / len(tail),
            "median_step_ms": doc["summary"]["median_step_ms"],
            "median_optimizer_ms": doc["summary"]["median_optimizer_ms"]}


def plot_losses(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if "losses" not in r:
            continue
        w = 10
        smooth = [sum(r["losses"][max(0, i - w + 1):i + 1]) / len(r["losses"][max(0, i - w + 1):i + 1])
                  for i in range(len(r["losses"]))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=f"{r['label']} ({r['final_loss']:.3f})")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (10-iteration mean)")
    ax.set_title("small GPT: Muon vs NorMuon vs Dion3 (DMuon owner step)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def loss(args):
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for label, flags in RULES:
            if label in args.rules:
                results.append(run_rule(label, flags, args, workdir))
                r = results[-1]
                print(json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
    lines = ["| rule | final loss (last 10%) | ms/iter | optimizer ms |", "|---|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | failed | | |")
        else:
            lines.append(f"| {r['label']} | {r['final_loss']:.4f} | {r['median_step_ms']:.1f} | "
                         f"{r['median_optimizer_ms']:.1f} |")
    print("\n".join(lines))
    with open(args.out + ".json", "w") as f:
        json.dump({"model": MODEL, "iters": args.iters, "nproc": args.nproc, "results": results}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        plot_losses(results, args.out + ".png")
    except ImportError as e:  # the numbers above stand without the picture
        print(f"no plot: {e}")


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="measure", required=True)
    s = sub.add_parser("step", help="the owner step's time per rule (one process, Qwen2.5-7B layer shapes)")
    s.add_argument("--layers", type=int, default=1)
    s.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.25, 0.125])
    s.add_argument("--reps", type=int, default=10)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--scale", type=int, default=None, help="divide every dimension (default 1 on CUDA, 8 on CPU)")
    s.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    lp = sub.add_parser("loss", help="loss curves per rule: the main job on a small GPT")
    lp.add_argument("--nproc", type=int, default=1)
    lp.add_argument("--iters", type=int, default=300)
    lp.add_argument("--rules", nargs="+", default=[label for label, _ in RULES])
    lp.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "dion3", "dion3_loss"))
    lp.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    step(args) if args.measure == "step" else loss(args)


if __name__ == "__main__":
    main()
