"""Loss curves of Muon, NorMuon and Dion3 on the small GPT of examples/pretrain_gpt.py.

    python bench/dion3_loss.py [--nproc 1] [--iters 300] [--out docs/results/dion3/dion3_loss_h200] [--extra ...]

Runs the project's main job once per rule under torchrun (same data, seed, lr schedule and model;
bf16 on GPUs), reads each run's per-iteration losses from ``--timing-json`` and writes
<out>.json, <out>.md (final loss averaged over the last 10% of iterations, median step and
optimizer ms) and <out>.png (loss vs iteration, smoothed). ``--extra`` goes to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (label, flags): the rules compared; Dion3 at f = 1/4 and 1/8 with NorDion2's lr (no f factor)
RULES = [
    ("muon", []),
    ("normuon", ["--dmuon-update", "normuon"]),
    ("dion3 f=1/4", ["--dmuon-update", "dion3", "--dmuon-fraction", "0.25"]),
    ("dion3 f=1/8", ["--dmuon-update", "dion3", "--dmuon-fraction", "0.125"]),
    ("dion3 f=1/4 lr/sqrt(f)", ["--dmuon-update", "dion3", "--dmuon-fraction", "0.25",
                                "--dmuon-fraction-lr", "inverse_sqrt"]),
]
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "8",
         "--num-query-groups", "4", "--seq-length", "256", "--global-batch-size", "32", "--micro-batch-size", "8",
         "--lr", "3e-3", "--lr-warmup-iters", "20", "--log-interval", "50"]


def run(label, flags, args, workdir):
    timing = os.path.join(workdir, label.replace(" ", "_").replace("/", "-") + ".json")
    gpu = _has_cuda()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           os.path.join(ROOT, "examples", "pretrain_gpt.py"), "--optimizer", "dmuon", *MODEL,
           "--train-iters", str(args.iters), "--timing-json", timing, *(["--bf16"] if gpu else []), *flags,
           *args.extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(timing):
        return {"label": label, "error": (proc.stdout + proc.stderr)[-3000:]}
    with open(timing) as f:
        doc = json.load(f)
    losses = [t["loss"] for t in doc["iterations"]]
    tail = losses[-max(1, len(losses) // 10):]
    return {"label": label, "flags": flags, "losses": losses, "final_loss": sum(tail) / len(tail),
            "median_step_ms": doc["summary"]["median_step_ms"],
            "median_optimizer_ms": doc["summary"]["median_optimizer_ms"]}


def _has_cuda():
    import torch

    return torch.cuda.is_available()


def plot(results, path):
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rules", nargs="+", default=[label for label, _ in RULES])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "dion3", "dion3_loss"))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for label, flags in RULES:
            if label in args.rules:
                results.append(run(label, flags, args, workdir))
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
        plot(results, args.out + ".png")
    except ImportError as e:  # the numbers above stand without the picture
        print(f"no plot: {e}")


if __name__ == "__main__":
    main()
