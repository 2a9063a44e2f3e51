"""The DeMuon paper's GPT comparison on the Python standard library, in the N-agent simulator.

For each method, every (graph, step size) pair is one independent block of N agents; all blocks
run side by side in one stacked simulation (block-diagonal mixing, per-agent step size), and all
blocks see the same minibatches (agent i's batch at step k depends only on i and k). Agents start
from one initialisation; M and V start at zero; constant step size (the reference's default).

Writes a JSON with per-block curves; ``report.py`` turns it into the table and plots.

Example (what docs/demuon.md ran on one H200; see there for the exact command)::

    python examples/demuon/gpt_experiment.py --device cuda --amp --time-budget 200 \
        --out docs/results/demuon/gpt_results.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from batched_gpt import GPTConfig, init_params, make_layout, per_agent_loss  # noqa: E402
from stdlib_data import build_corpus, describe, fixed_windows, sample_windows  # noqa: E402

from megatron_dmuon.decentralized.demuon import DecentralizedConfig  # noqa: E402
from megatron_dmuon.decentralized.topology import make_topology  # noqa: E402
from megatron_dmuon.decentralized.simulator import DecentralizedSimulator  # noqa: E402

# Step-size grids (×2 spacing) bracketing each method's usable range for this model.
DEFAULT_GRIDS = {
    "demuon": [0.005, 0.01, 0.02, 0.04, 0.08],
    "demuon_a": [0.01, 0.02, 0.04],
    "dsgd": [0.125, 0.25, 0.5, 1.0, 2.0],
    "dsgd_c": [0.25, 0.5, 1.0, 2.0, 4.0],
    "dsgd_n": [0.25, 0.5, 1.0, 2.0, 4.0],
}
GRAPHS = ["complete", "directed_exponential", "ring"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--amp", action="store_true", help="bf16 autocast for the model (GPU)")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--graphs", nargs="+", default=GRAPHS)
    ap.add_argument("--methods", nargs="+", default=["demuon", "dsgd", "dsgd_c", "dsgd_n", "demuon_a"])
    ap.add_argument("--grid", action="append", default=[], help="method=lr1,lr2,... overrides a grid")
    ap.add_argument("--iters", type=int, default=1000, help="upper bound; --time-budget may lower it")
    ap.add_argument("--min-iters", type=int, default=20)
    ap.add_argument("--time-budget", type=float, default=0.0, help="seconds for the whole run (0: no limit)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per agent per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--momentum", type=float, default=0.8)
    ap.add_argument("--evals", type=int, default=10, help="evaluation points over the run")
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default=None, help="a cached corpus .pt from stdlib_data.build_corpus (skips building)")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def grids(args) -> dict[str, list[float]]:
    out = {m: list(DEFAULT_GRIDS[m]) for m in args.methods}
    for item in args.grid:
        method, values = item.split("=")
        out[method] = [float(v) for v in values.split(",")]
    return out


class Run:
    """One method: all (graph, lr) blocks stacked into one simulator."""

    def __init__(self, args, method, lrs, model_cfg, layout, x0, device):
        self.blocks = [(g, lr) for g in args.graphs for lr in lrs]
        n = args.agents
        topologies = [make_topology(g, n) for g, _ in self.blocks]
        lr_per_agent = torch.tensor([lr for _, lr in self.blocks for _ in range(n)], dtype=torch.float32)
        cfg = DecentralizedConfig(
            method=method, lr=lr_per_agent.to(device), momentum=args.momentum, extrapolation_points=2
        )
        self.sim = DecentralizedSimulator(cfg, topologies, layout, x0.to(device))
        self.method, self.args, self.model_cfg, self.layout, self.device = method, args, model_cfg, layout, device
        self.n = n
        self.last_train = None

    def loss_fn(self, flat, idx, targets):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.args.amp and self.device.type == "cuda"):
            return per_agent_loss(self.model_cfg, self.layout, flat, idx, targets)

    def step(self, windows):
        """``windows`` [N, B, T+1] for agent indices 0..N-1, shared by every block."""
        reps = len(self.blocks)
        batch = windows.to(self.device).repeat(reps, 1, 1)
        idx, targets = batch[:, :, :-1], batch[:, :, 1:]
        first = []

        def grad_fn(points):
            leaf = points.detach().requires_grad_(True)
            losses = self.loss_fn(leaf, idx, targets)
            losses.sum().backward()
            if not first:
                first.append(losses.detach())
            return leaf.grad

        self.sim.step(grad_fn)
        self.last_train = first[0]

    @torch.no_grad()
    def evaluate(self, val):
        """Per block: val loss of the averaged model, mean val loss of the agents, consensus error."""
        idx, targets = val[:, :-1].to(self.device), val[:, 1:].to(self.device)
        averages = self.sim.block_average()
        nb = averages.shape[0]
        avg_loss = self.loss_fn(averages, idx.expand(nb, -1, -1), targets.expand(nb, -1, -1))
        params = self.sim.params
        agent_loss = torch.cat(
            [
                self.loss_fn(params[s : s + self.n], idx.expand(self.n, -1, -1), targets.expand(self.n, -1, -1))
                for s in range(0, params.shape[0], self.n)
            ]
        )
        train = self.last_train.view(nb, self.n).mean(1) if self.last_train is not None else None
        cons = self.sim.consensus_errors()
        stat = self.sim.stationarity_proxies()
        out = []
        for b in range(nb):
            out.append(
                {
                    "val_loss_avg_model": float(avg_loss[b]),
                    "val_loss_agents_mean": float(agent_loss[b * self.n : (b + 1) * self.n].mean()),
                    "train_loss": None if train is None else float(train[b]),
                    "consensus_error": cons[b],
                    "stationarity_proxy": stat[b],
                }
            )
        return out


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    start = time.time()
    data = torch.load(args.corpus) if args.corpus else build_corpus(args.agents, args.vocab)
    if data["vocab_size"] != args.vocab or len(data["agent_tokens"]) != args.agents:
        raise SystemExit(f"corpus has vocab {data['vocab_size']} and {len(data['agent_tokens'])} agents; "
                         f"asked for --vocab {args.vocab} --agents {args.agents}")
    print(describe(data), flush=True)
    model_cfg = GPTConfig(args.vocab, args.seq, args.d_model, args.layers, args.heads, args.d_ff)
    layout = make_layout(model_cfg)
    x0 = init_params(model_cfg, layout, seed=args.seed)
    val = fixed_windows(data["val_tokens"], args.val_windows, args.seq)
    method_grids = grids(args)
    print(f"model parameters per agent: {layout.total_numel}", flush=True)

    def batch_at(step):
        return torch.stack(
            [
                sample_windows(tok, args.batch, args.seq, torch.Generator().manual_seed(args.seed * 7919 + 104729 * i + step))
                for i, tok in enumerate(data["agent_tokens"])
            ]
        )

    # Pre-flight: time a few iterations of each method, then fix one iteration count for all.
    per_iter = {}
    for method in args.methods:
        run = Run(args, method, method_grids[method], model_cfg, layout, x0, device)
        run.step(batch_at(0))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.time()
        for k in range(1, 4):
            run.step(batch_at(k))
        if device.type == "cuda":
            torch.cuda.synchronize()
        per_iter[method] = (time.time() - t) / 3
        del run
    iters = args.iters
    if args.time_budget > 0:
        left = args.time_budget - (time.time() - start)
        afford = int(left / (sum(per_iter.values()) * 1.15))  # 15% for evaluation
        iters = min(args.iters, max(args.min_iters, afford))
    print(f"seconds per iteration {per_iter}; running {iters} iterations", flush=True)
    eval_at = sorted({0, iters} | {round(iters * j / args.evals) for j in range(1, args.evals)})

    results = {
        "settings": {k: v for k, v in vars(args).items()},
        "iterations": iters,
        "eval_at": eval_at,
        "model_parameters": layout.total_numel,
        "data": describe(data),
        "heterogeneity_sym_kl": data["heterogeneity_sym_kl"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seconds_per_iteration": per_iter,
        "methods": {},
    }
    for method in args.methods:
        t0 = time.time()
        run = Run(args, method, method_grids[method], model_cfg, layout, x0, device)
        curves = [[] for _ in run.blocks]
        for k in range(iters + 1):
            if k > 0:
                run.step(batch_at(k))
            if k in eval_at:
                for b, rec in enumerate(run.evaluate(val)):
                    curves[b].append({"iter": k, **rec})
        results["methods"][method] = {
            "blocks": [
                {"graph": g, "lr": lr, "curve": curve, "diverged": not math.isfinite(curve[-1]["val_loss_avg_model"])}
                for (g, lr), curve in zip(run.blocks, curves)
            ],
            "wall_seconds": time.time() - t0,
        }
        best = min(
            (c[-1]["val_loss_avg_model"], g, lr) for (g, lr), c in zip(run.blocks, curves) if math.isfinite(c[-1]["val_loss_avg_model"])
        ) if any(math.isfinite(c[-1]["val_loss_avg_model"]) for c in curves) else None
        print(f"{method}: {time.time() - t0:.1f}s, best final avg-model val loss {best}", flush=True)
        del run
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    results["total_seconds"] = time.time() - start
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"done in {results['total_seconds']:.1f}s -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
