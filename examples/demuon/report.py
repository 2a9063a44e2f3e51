"""Tables (markdown) and plots (PNG) from the JSON written by the two DeMuon experiments.

    python examples/demuon/report.py regression docs/results/demuon/regression_results_cpu_2026-11-29.json docs/results/demuon
    python examples/demuon/report.py gpt docs/results/demuon/gpt_results_h200_2026-11-29.json docs/results/demuon

Step-size selection: for every (method, graph) the grid point with the best final metric
(f(X̄) − f* for regression; validation loss of the averaged model for GPT) among non-diverged
runs. Two matched-consensus columns (the paper compares at equal or lower consensus error):
each baseline's best metric among its step sizes whose final consensus error is at most
``CONSENSUS_SLACK`` × DeMuon's, and DeMuon's best metric among its step sizes whose consensus
error is at most ``CONSENSUS_SLACK`` × that baseline's.
"""

from __future__ import annotations

import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"demuon": "DeMuon", "demuon_a": "DeMuon-A (q=2)", "dsgd": "DSGD", "dsgd_c": "DSGD-C", "dsgd_n": "DSGD-N"}
GRAPH_LABELS = {"complete": "complete", "directed_exponential": "directed exponential", "ring": "ring"}
CONSENSUS_SLACK = 1.1  # "similar" consensus error: within 10%
COLORS = {"demuon": "C3", "demuon_a": "C1", "dsgd": "C0", "dsgd_c": "C2", "dsgd_n": "C4"}


def finite(x):
    return x is not None and math.isfinite(x)


def best_block(blocks, graph, metric, max_consensus=None):
    cands = [
        b for b in blocks
        if b["graph"] == graph and finite(b["curve"][-1][metric])
        and (max_consensus is None or b["curve"][-1]["consensus_error"] <= max_consensus * CONSENSUS_SLACK + 1e-12)
    ]
    return min(cands, key=lambda b: b["curve"][-1][metric]) if cands else None


def graphs_of(results):
    seen = []
    for m in results["methods"].values():
        for b in m["blocks"]:
            if b["graph"] not in seen:
                seen.append(b["graph"])
    return seen


def fmt(x, digits=4):
    if not finite(x):
        return "diverged"
    return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.3e}"


def table(results, metric, metric_title, extra=()):
    lines = [
        f"| graph | method | step size η₀ | {metric_title} | " + " | ".join(t for _, t in extra)
        + (" | " if extra else "") + "consensus error ‖X−1⊗X̄‖_F | this method at consensus ≤ DeMuon's | "
        "DeMuon at consensus ≤ this method's |",
    ]
    lines.append("|" + "---|" * (7 + len(extra)))
    demuon_blocks = results["methods"].get("demuon", {"blocks": []})["blocks"]
    for graph in graphs_of(results):
        ref = best_block(demuon_blocks, graph, metric)
        ref_cons = ref["curve"][-1]["consensus_error"] if ref else None
        for method, data in results["methods"].items():
            b = best_block(data["blocks"], graph, metric)
            if b is None:
                lines.append(f"| {GRAPH_LABELS.get(graph, graph)} | {LABELS[method]} | all diverged |" + " |" * (4 + len(extra)))
                continue
            last = b["curve"][-1]
            matched = reverse = "—"
            if method != "demuon" and ref_cons is not None:
                mb = best_block(data["blocks"], graph, metric, max_consensus=ref_cons)
                matched = f"{fmt(mb['curve'][-1][metric])} (η₀={mb['lr']:g})" if mb else "none"
                rb = best_block(demuon_blocks, graph, metric, max_consensus=last["consensus_error"])
                reverse = (f"{fmt(rb['curve'][-1][metric])} (η₀={rb['lr']:g}, cons. {fmt(rb['curve'][-1]['consensus_error'], 2)})"
                           if rb else "none")
            cells = [GRAPH_LABELS.get(graph, graph), LABELS[method], f"{b['lr']:g}", fmt(last[metric])]
            cells += [fmt(last[k]) for k, _ in extra]
            cells += [fmt(last["consensus_error"], 3), matched, reverse]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def grid_table(results, metric):
    lines = ["| method | graph | " + f"η₀ → final {metric} (consensus error) |", "|---|---|---|"]
    for method, data in results["methods"].items():
        for graph in graphs_of(results):
            cells = [
                f"{b['lr']:g}: {fmt(b['curve'][-1][metric])} ({fmt(b['curve'][-1]['consensus_error'], 2)})"
                for b in data["blocks"] if b["graph"] == graph
            ]
            lines.append(f"| {LABELS[method]} | {GRAPH_LABELS.get(graph, graph)} | " + "; ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, metric, ylabel, path, logy, shown=None):
    """Best step size per (method, graph) by ``metric``; top row plots ``shown`` (default metric)."""
    shown = shown or metric
    graphs = graphs_of(results)
    fig, axes = plt.subplots(2, len(graphs), figsize=(5 * len(graphs), 7.5), squeeze=False)
    for col, graph in enumerate(graphs):
        for method, data in results["methods"].items():
            b = best_block(data["blocks"], graph, metric)
            if b is None:
                continue
            xs = [p["iter"] for p in b["curve"]]
            label = f"{LABELS[method]} (η₀={b['lr']:g})"
            pts = [(p["iter"], p[shown]) for p in b["curve"] if p[shown] is not None]
            axes[0][col].plot([x for x, _ in pts], [y for _, y in pts], color=COLORS[method], label=label)
            cons = [(x, p["consensus_error"]) for x, p in zip(xs, b["curve"]) if p["consensus_error"] > 1e-9]
            if cons:
                axes[1][col].plot([x for x, _ in cons], [c for _, c in cons], color=COLORS[method], label=label)
        axes[0][col].set_title(GRAPH_LABELS.get(graph, graph))
        axes[0][col].set_ylabel(ylabel)
        axes[1][col].set_ylabel("consensus error ‖X − 1⊗X̄‖_F")
        if axes[1][col].lines:
            axes[1][col].set_yscale("log")
        else:  # W = 11ᵀ/N averages exactly: every agent holds X̄ after each round
            axes[1][col].text(0.5, 0.5, "consensus error ≤ 1e-9 for every method\n(W = 11ᵀ/N averages exactly)",
                              ha="center", va="center", transform=axes[1][col].transAxes)
        for r in range(2):
            axes[r][col].set_xlabel("iteration")
            axes[r][col].grid(alpha=0.3)
        if logy:
            axes[0][col].set_yscale("log")
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pareto(results, metric, ylabel, path):
    """Final metric against final consensus error for every grid point (non-complete graphs)."""
    graphs = [g for g in graphs_of(results) if g != "complete"]
    fig, axes = plt.subplots(1, len(graphs), figsize=(5.5 * len(graphs), 4.2), squeeze=False)
    for col, graph in enumerate(graphs):
        ax = axes[0][col]
        for method, data in results["methods"].items():
            pts = sorted((b["curve"][-1]["consensus_error"], b["curve"][-1][metric], b["lr"]) for b in data["blocks"]
                         if b["graph"] == graph and finite(b["curve"][-1][metric]))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[method], label=LABELS[method], ms=4)
            for c, v, lr in pts:
                ax.annotate(f"{lr:g}", (c, v), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log" if metric == "suboptimality" else "linear")
        ax.set_xlabel("final consensus error ‖X − 1⊗X̄‖_F")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{GRAPH_LABELS.get(graph, graph)}: every step size η₀ (labels)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def regression(results, outdir):
    s = results["settings"]
    head = (
        f"Decentralized matrix regression: N={s['agents']} agents, X ∈ R^{s['d_in']}×{s['d_out']}, "
        f"{s['rows']} rows per agent, minibatch {s['batch']}, {s['iters']} iterations, η_k = η₀/√k, "
        f"momentum μ={s['momentum']}, seed {s['seed']}. f* = {results['f_star']:.6g}; at X=0: "
        f"f − f* = {results['initial']['suboptimality']:.4g}, ‖∇f‖_* = {results['initial']['grad_nuclear']:.4g}. "
        f"CPU wall time {results['total_seconds']:.0f} s.\n"
    )
    md = head + "\n" + table(results, "suboptimality", "f(X̄) − f*", extra=(("grad_nuclear", "‖∇f(X̄)‖_*"),))
    md += "\n\nFull step-size grid (final f(X̄) − f*, consensus error in parentheses):\n\n" + grid_table(results, "suboptimality")
    with open(os.path.join(outdir, "regression_table.md"), "w") as f:
        f.write(md + "\n")
    plot(results, "suboptimality", "f(X̄) − f*", os.path.join(outdir, "regression.png"), logy=True)
    pareto(results, "suboptimality", "final f(X̄) − f*", os.path.join(outdir, "regression_pareto.png"))
    print(md)


def gpt(results, outdir):
    s = results["settings"]
    head = (
        f"GPT on the Python standard library: {results['model_parameters']:,} parameters per agent "
        f"(d={s['d_model']}, {s['layers']} layers, {s['heads']} heads, ff={s['d_ff']}, vocab {s['vocab']} BPE, "
        f"context {s['seq']}), N={s['agents']} agents, batch {s['batch']} sequences per agent, "
        f"{results['iterations']} iterations, constant step size, momentum μ={s['momentum']}, "
        f"{s['val_windows']} validation windows, seed {s['seed']}. Data: {results['data']}. "
        f"Device: {results['device']} (torch {results['torch']}), total {results.get('total_seconds', float('nan')):.0f} s.\n"
    )
    extra = (("val_loss_agents_mean", "mean agent val loss"), ("train_loss", "train loss (last batch)"))
    md = head + "\n" + table(results, "val_loss_avg_model", "val loss of X̄ (ppl)", extra=extra)
    # perplexity next to the loss
    md = md.replace("val loss of X̄ (ppl)", "val loss of X̄")
    ppl_lines = []
    for graph in graphs_of(results):
        for method, data in results["methods"].items():
            b = best_block(data["blocks"], graph, "val_loss_avg_model")
            if b:
                ppl_lines.append(f"{GRAPH_LABELS.get(graph, graph)} / {LABELS[method]}: "
                                 f"perplexity {math.exp(b['curve'][-1]['val_loss_avg_model']):.2f}")
    md += "\n\nPerplexity of the averaged model (exp of its val loss): " + "; ".join(ppl_lines) + "."
    md += "\n\nFull step-size grid (final val loss of X̄, consensus error in parentheses):\n\n" + grid_table(results, "val_loss_avg_model")
    with open(os.path.join(outdir, "gpt_table.md"), "w") as f:
        f.write(md + "\n")
    plot(results, "val_loss_avg_model", "validation loss of the averaged model", os.path.join(outdir, "gpt_val_loss.png"), logy=False)
    pareto(results, "val_loss_avg_model", "final val loss of X̄", os.path.join(outdir, "gpt_pareto.png"))
    plot(results, "val_loss_avg_model", "training loss (mean over agents, current batch)",
         os.path.join(outdir, "gpt_train_loss.png"), logy=False, shown="train_loss")
    print(md)


def main(argv=None):
    argv = argv or sys.argv[1:]
    if len(argv) != 3 or argv[0] not in ("regression", "gpt"):
        raise SystemExit("usage: report.py {regression|gpt} RESULTS.json OUTDIR")
    kind, path, outdir = argv
    with open(path) as f:
        results = json.load(f)
    os.makedirs(outdir, exist_ok=True)
    (regression if kind == "regression" else gpt)(results, outdir)


if __name__ == "__main__":
    main()
