"""``dmuon plan --plot FILE.png``: each GPU's predicted NS and bytes under each planner, and the DP
layouts' candidates, in one picture (matplotlib, imported only when asked)."""
from __future__ import annotations


def plot_report(report: dict, path: str) -> None:
    """Draw ``dmuon plan``'s report into ``path``: per GPU, the predicted owner NS of every planner
    (the one the job runs drawn bold: the split layout where the DP layouts pick it, else the greedy) and
    the bytes each moves per step; beside it the DP layouts' candidates (modelled step vs bytes, the
    pick marked)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError(f"--plot needs matplotlib ({e}): pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = report["plans"]
    layouts = report.get("dp_layouts")
    picked = layouts["candidates"][layouts["picked"]]["scheme"] if layouts else "whole"
    # what the job runs: the split layout where the DP layouts' pick is split, else its balance (cost)
    chosen = next((p for p in (("split",) if picked == "split" else ("greedy", "milp")) if p in plans), list(plans)[-1])
    fig, axes = plt.subplots(1, 3 if layouts else 2, figsize=(16 if layouts else 11, 4.2))
    ns_ax, bytes_ax = axes[0], axes[1]
    for name, p in plans.items():
        bold = name == chosen
        ns_ax.plot(range(len(p["rank_ms"])), p["rank_ms"], lw=2.2 if bold else 1, marker="." if len(p["rank_ms"]) < 70 else None,
                   label=f"{name} (makespan {p['makespan_ms']:.1f} ms)" + (" <- chosen" if bold else ""))
        bytes_ax.bar(name, p["bytes_per_rank"] / 1e9, color="C3" if bold else "C0")
    ns_ax.axhline(report["lower_bound_ms"], color="k", ls=":", lw=1, label=f"lower bound {report['lower_bound_ms']:.1f} ms")
    par = report["parallel"]
    ns_ax.set(title=f"{report['model']}: predicted owner NS per GPU (DP {par['dp']} x TP {par['tp']})", xlabel="GPU",
              ylabel="ms")
    ns_ax.legend(fontsize=7)
    bytes_ax.set(title="GB reduced + published (+ exchanged) per GPU per step", ylabel="GB")
    bytes_ax.tick_params(axis="x", rotation=30, labelsize=8)
    if layouts:
        ax = axes[2]
        adam = layouts["adamw"]
        for i, c in enumerate(layouts["candidates"]):
            picked = i == layouts["picked"]
            ax.scatter(c["bytes_vs_adamw"], c["optimizer_step_ms"], s=80 if picked else 30,
                       color="C3" if picked else ("C0" if c["scheme"] == "whole" else "C2"), zorder=3)
            ax.annotate(f"{c['instances']}x{c['scheme']}" + (" (picked)" if picked else ""),
                        (c["bytes_vs_adamw"], c["optimizer_step_ms"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(adam["optimizer_step_ms"], color="k", ls=":", lw=1, label=f"AdamW {adam['optimizer_step_ms']:.0f} ms")
        ax.set(title="DP layouts: modelled step vs bytes (x AdamW)", xlabel="bytes per rank / AdamW's", ylabel="ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
