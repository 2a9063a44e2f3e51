"""What one team home's NS costs on this GPU against the planner's model of it (planning/split_layout.
team_block_cost), for the largest Muon matrices of Qwen2.5-7B / 32B and each team size the planner tries.

A team home runs distributed Gram NS on its block of the long side (runtime/team_ns.team_orthogonalize; the
team's reductions are modelled, not timed here: the reduce is the identity, one GPU has no peer), timed as
the per-rank emulation times it (runtime/ns_timing.time_owner_step ``team_blocks``), beside one home's NS of
the whole matrix through the owner step (the same call, the matrix owned whole).

    python bench/team_block_cost.py --out /tmp/team_block_cost   # writes .json and .md
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_dmuon.planning.owner_layout import ParamItem  # noqa: E402
from megatron_dmuon.planning.split_layout import team_block_cost  # noqa: E402
from megatron_dmuon.runtime.muon_settings import MuonSettings  # noqa: E402
from megatron_dmuon.runtime.ns_timing import time_owner_step  # noqa: E402

SHAPES = {"qwen2.5-7b fc1": (37888, 3584), "qwen2.5-7b fc2": (3584, 18944),
          "qwen2.5-32b fc1": (55296, 5120), "qwen2.5-32b fc2": (5120, 27648)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    p.add_argument("--sizes", default="1,2,4,8,16", help="team sizes (1: the whole matrix's block on one home)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shrink", type=int, default=1, help="every dimension / this (a smoke run on the CPU)")
    args = p.parse_args(argv)
    rows = []
    for name, (r, c) in SHAPES.items():
        r, c = r // args.shrink, c // args.shrink
        # the whole matrix on one home as the run steps it (--dmuon-ns-method auto: Gram where it is faster)
        whole, _ = time_owner_step([(name, (r, c), None)], [], MuonSettings(ns_method="auto"), iters=args.iters,
                                   warmup=args.warmup, device=args.device)
        item = ParamItem(name, r * c, True, cost=1.0, pieces=((r, c),))
        long = max(r, c)
        for k in map(int, args.sizes.split(",")):
            part = -(-long // k)
            ms, _ = time_owner_step([], [], MuonSettings(ns_method="gram"), iters=args.iters, warmup=args.warmup,
                                    device=args.device, team_blocks=[(r, c, 0, part)])
            rows.append({"matrix": name, "shape": [r, c], "team_size": k, "block_long": part, "block_ms": ms,
                         "whole_ms": whole, "measured_share": ms / whole, "model_share": team_block_cost(item, part)})
            print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    with open(args.out + ".json", "w") as f:
        json.dump({"device": device, "ns_method": {"whole": "auto", "team block": "gram"}, "rows": rows}, f, indent=1)
    lines = [f"# team block NS on {device} (a block: Gram NS, the team's reductions not timed; the whole matrix: "
             "--dmuon-ns-method auto)", "",
             "| matrix | team size | block (long side) | block ms | whole matrix ms (one home) | measured share | "
             "model share (team_block_cost) |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {x['matrix']} {x['shape'][0]}x{x['shape'][1]} | {x['team_size']} | {x['block_long']} | "
              f"{x['block_ms']:.2f} | {x['whole_ms']:.2f} | {x['measured_share']:.2f} | {x['model_share']:.2f} |"
              for x in rows]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
