"""ms/iteration vs GPU count for DMuon, gather_then_compute and Megatron AdamW ([multi-gpu-dp]).

    python bench/scaling.py --gpus 1 2 4 8 --preset qwen7b-4l --iters 12 --out docs/results/scaling/scaling

For each GPU count runs bench/e2e.py (global batch scaled with DP: 8 x GPUs) and `dmuon-verify`
under torchrun (bf16, NCCL); writes <out>.json, <out>.md and <out>.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ["adam", "dmuon", "gather_then_compute"]


def run_e2e(nproc, preset, iters, modes):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "e2e.py"), "--preset", preset, "--nproc", str(nproc),
           "--iters", str(iters), "--modes", *modes, "--extra", "--global-batch-size", str(8 * nproc)]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    start = out.index("{\n")
    return json.loads(out[start:out.index("\n}\n", start) + 3])["rows"]


def run_verify(nproc):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megatron_dmuon.testing.verify_cli", "--bf16", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else {"ok": False, "error": proc.stderr[-2000:]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--preset", default="qwen7b-4l")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--modes", nargs="+", default=MODES)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "scaling", "scaling"))
    args = p.parse_args()
    results = {}
    for n in args.gpus:
        try:
            e2e = run_e2e(n, args.preset, args.iters, args.modes)
        except Exception as exc:  # keep the other GPU counts; say what failed
            e2e = [{"mode": mode, "error": f"{type(exc).__name__}: {exc}"} for mode in args.modes]
        results[n] = {"e2e": e2e, "verify": run_verify(n) if n > 1 else None}
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


if __name__ == "__main__":
    main()
