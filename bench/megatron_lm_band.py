"""The noise band over seeds and Megatron-LM trees, from bench/megatron_lm_compare.py's JSON files.

    python bench/megatron_lm_band.py --tree main A.json --tree core_v0.19.0 B.json [--out DIR]

One run per (tree, seed) is one sample of a noisy statistic: with `--qk-clip` the max loss gap of
30 iterations is set by a transient where a clip factor flips, and two correct Muon implementations
differ there by 0.0005 at one seed and 0.003 at the next. So the band is read from every pair of
*reference* curves a file set holds, pooled over seeds and trees:

* within one tree and seed, every pair of `muon` (Megatron's bf16 NS), `muon_fp32ns` (its TF32 NS)
  and `dmuon_fp32ns` (DMuon with full fp32 NS: the curve nearest exact arithmetic);
* across trees, the same seed: Megatron's own run under the same flags on its two trees (its code
  differs between them; the runs are deterministic, so a gap here is a code difference).

A candidate (`dmuon`, `dmuon_standard`) is compared by its gap to `muon` at every (tree, seed). It is
*within the band* when its largest gap is at most the largest reference gap and its mean gap (over
the samples) at most the mean of the widest reference pair: no wider than the spread that correct
implementations show against each other. The per-seed verdict of compare.py (gap <= that seed's
`muon_fp32ns` gap) is printed beside it: on a heavy-tailed statistic it is a coin flip even for the
exact curve, which is why it is not the criterion here.

A one-seed file that does not record its seed (compare.py before 2026-12-03) is named `PATH@SEED`;
a later file's (tree, seed, run) replaces an earlier one (a re-run after a fix).
Prints JSON and a markdown table; writes band.json / band.md under --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_lm_compare import loss_gap  # noqa: E402
from cli_inputs import OneLineParser, read_json  # noqa: E402

REFERENCE_RUNS = ("muon", "muon_fp32ns", "dmuon_fp32ns")
CROSS_TREE_RUNS = ("muon", "muon_fp32ns")  # Megatron's code differs between trees; DMuon's does not
CANDIDATES = ("dmuon", "dmuon_standard")


def max_gap(a: dict, b: dict) -> float:
    return loss_gap(a, b)["max_abs"]


def read_curves(path: str) -> dict:
    """{(seed, run): {"iterations": rows}} of one compare.py JSON (``PATH@SEED`` for a one-seed file that does not
    record its seed: compare.py before 2026-12-03)."""
    path, _, given = path.partition("@")
    with open(path) as f:
        doc = json.load(f)  # (main checked it: read_json)
    one_seed = given or doc["summary"].get("seed")
    curves = {}
    for key, rows in doc["iterations"].items():
        run, _, tail = key.rpartition("_s")
        if "seeds" in doc["summary"] and tail.isdigit():
            this = int(tail)
        elif one_seed:
            run, this = key, int(one_seed)
        else:
            raise SystemExit(f"{path}: holds one seed and does not name it: pass {path}@SEED")
        curves[(this, run)] = {"iterations": rows}
    return curves


def pooled_band(trees: dict, candidates=CANDIDATES) -> dict:
    """``trees``: {tree: {(seed, run): curve}} -> reference pairs, candidates and their verdicts."""
    refs, cands = {}, {}
    for tree, curves in trees.items():
        for seed in sorted({s for s, _ in curves}):
            have = {run: c for (s, run), c in curves.items() if s == seed}
            for a, b in itertools.combinations([r for r in REFERENCE_RUNS if r in have], 2):
                refs.setdefault(f"{b} vs {a}", {})[f"{tree} {seed}"] = max_gap(have[a], have[b])
            if "muon" in have:
                for run in candidates:
                    if run in have:
                        cands.setdefault(run, {})[f"{tree} {seed}"] = {
                            "gap": max_gap(have[run], have["muon"]),
                            "per_seed_band": (max_gap(have["muon_fp32ns"], have["muon"])
                                              if "muon_fp32ns" in have else None)}
    for t1, t2 in itertools.combinations(trees, 2):
        for run in CROSS_TREE_RUNS:
            for (seed, r), c in trees[t1].items():
                if r == run and (seed, run) in trees[t2]:
                    refs.setdefault(f"{run}: {t2} vs {t1}", {})[str(seed)] = max_gap(c, trees[t2][(seed, run)])
    ref_max = max((g for per in refs.values() for g in per.values()), default=None)
    ref_mean = max((statistics.mean(per.values()) for per in refs.values()), default=None)
    verdicts = {}
    for run, per in cands.items():
        gaps = [v["gap"] for v in per.values()]
        verdicts[run] = {"largest": max(gaps), "mean": statistics.mean(gaps), "samples": len(gaps),
                         "within_per_seed_band": sum(int(v["per_seed_band"] is not None and v["gap"] <= v["per_seed_band"])
                                                     for v in per.values()),
                         "within_band": ref_max is not None and max(gaps) <= ref_max and statistics.mean(gaps) <= ref_mean}
    return {"reference_pairs": refs, "reference_largest": ref_max, "reference_widest_mean": ref_mean,
            "candidates": cands, "verdicts": verdicts}


def table(band: dict) -> str:
    out = ["| pair | max loss gap per sample | mean | largest |", "|---|---|---:|---:|"]
    for name, per in band["reference_pairs"].items():
        out.append(f"| {name} | {', '.join(f'{k}: {g:.4f}' for k, g in per.items())} | "
                   f"{statistics.mean(per.values()):.4f} | {max(per.values()):.4f} |")
    for run, per in band["candidates"].items():
        gaps = [v["gap"] for v in per.values()]
        samples = ", ".join(f"{k}: {v['gap']:.4f}" for k, v in per.items())
        out.append(f"| **{run} vs muon** | {samples} | "
                   f"**{statistics.mean(gaps):.4f}** | **{max(gaps):.4f}** |")
    out.append("")
    if band["reference_largest"] is None:
        return "\n".join(out + ["no reference pair: run muon_fp32ns or dmuon_fp32ns beside muon"])
    out.append(f"band: largest reference gap {band['reference_largest']:.4f}, widest reference mean "
               f"{band['reference_widest_mean']:.4f}")
    for run, v in band["verdicts"].items():
        out.append(f"- {run}: largest {v['largest']:.4f}, mean {v['mean']:.4f} over {v['samples']} samples: "
                   f"{'within' if v['within_band'] else 'OUTSIDE'} the band (per-seed rule, gap <= that seed's "
                   f"muon_fp32ns gap: {v['within_per_seed_band']} / {v['samples']})")
    return "\n".join(out)


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", nargs="+", action="append", required=True, metavar=("NAME", "JSON"),
                   help="a tree's name and its compare.py JSON files (PATH@SEED for a one-seed file)")
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES),
                   help="runs judged against the band (leave out one whose curves predate a change)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    trees = {}
    for name, *paths in args.tree:
        if not paths:
            p.error(f"--tree {name}: name at least one JSON file")
        for path in paths:
            file, _, seed = path.partition("@")
            doc = read_json(p, f"--tree {name}", file, "a JSON of bench/megatron_lm_compare.py",
                            need=("summary", "iterations"))
            if seed and not seed.isdigit():
                p.error(f"--tree {name} {path}: the seed after '@' must be a whole number")
            if not isinstance(doc["summary"], dict) or not isinstance(doc["iterations"], dict):
                p.error(f"--tree {name} {file}: 'summary' and 'iterations' must be objects; give a JSON of "
                        "bench/megatron_lm_compare.py")
            trees.setdefault(name, {}).update(read_curves(path))
    band = pooled_band(trees, args.candidates)
    text = table(band)
    print(json.dumps(band))
    print("\n" + text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "band.json"), "w") as f:
            json.dump({"inputs": args.tree, "candidates_asked": args.candidates, **band}, f, indent=1)
        with open(os.path.join(args.out, "band.md"), "w") as f:
            f.write(text + "\n")
    return 0 if all(v["within_band"] for v in band["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
