"""The picture in docs/dmuon_dp.md: one bucket under the whole-matrix layout and under the split layout
(planning/owner_layout.py, planning/split_layout.py), drawn from real plans of a small model at DP 8.

    python bench/draw_dp_layouts.py docs/images/dp_layouts.png
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dmuon.planning.owner_layout import ParamItem, plan_owner_layout  # noqa: E402
from megatron_dmuon.planning.split_layout import plan_split_layout  # noqa: E402

# 3 matrices (big, mid, small) and 2 element-wise params on 8 DP ranks: more ranks than matrices
ITEMS = [ParamItem("embed", 300, False), ParamItem("fc1", 900, True, cost=9.0),
         ParamItem("proj", 300, True, cost=3.0), ParamItem("qkv", 450, True, cost=4.5), ParamItem("ln", 50, False)]
COLORS = {"fc1": "#4C72B0", "proj": "#DD8452", "qkv": "#55A868", "embed": "#BBBBBB", "ln": "#999999"}


def draw(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    world = 8
    layouts = {"whole: each matrix inside its owner's shard (shards padded to the largest)":
               plan_owner_layout(ITEMS, world, None, 0.02),
               "split: Megatron's own equal shards cut matrices; one NS home per matrix":
               plan_split_layout(ITEMS, world, None, move_cost=0.001)}
    fig, axes = plt.subplots(2, 1, figsize=(11, 4.6))
    for ax, (title, layout) in zip(axes, layouts.items()):
        total = layout.numel
        shard = layout.buckets[0].shard_size
        for r in range(world):
            ax.add_patch(Rectangle((r * shard / total, 0), shard / total, 1, fill=False, lw=1.2))
            ax.text((r + 0.5) * shard / total, -0.18, f"rank {r}", ha="center", va="top", fontsize=8)
        for name, (s, e, _) in layout.param_ranges.items():
            ax.add_patch(Rectangle((s / total, 0.15), (e - s) / total, 0.5, color=COLORS[name], alpha=0.85))
            ax.text((s + e) / 2 / total, 0.4, name, ha="center", va="center", fontsize=7, color="black")
        for name, home in layout.owners.items():  # the NS home: where the matrix is orthogonalized
            s, e, _ = layout.param_ranges[name]
            x_home = (home + 0.5) * shard / total
            ax.plot([x_home], [0.85], marker="v", color=COLORS[name], ms=9)
            if layout.scheme == "split":
                for r, lo, hi in layout.pieces(name):
                    if r != home:
                        x = (s + (lo + hi) / 2) / total
                        ax.add_patch(FancyArrowPatch((x, 0.66), (x_home, 0.82), arrowstyle="->",
                                                     connectionstyle="arc3,rad=-0.3", color=COLORS[name], lw=1))
        pad = total - layout.numel_unpadded
        ax.set_title(f"{title}; buffer {total} elements ({pad} padding)", fontsize=9, loc="left")
        ax.set_xlim(-0.01, 1.01)
        ax.set_ylim(-0.35, 1.05)
        ax.axis("off")
    fig.text(0.99, 0.01, "triangle: the matrix's NS home; arrow: a piece of its update goes there, its direction "
             "comes back", ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "dp_layouts.png")
