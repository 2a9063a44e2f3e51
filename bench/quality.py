"""Training quality: AdamW, DMuon's defaults and every fast option, by validation loss over seeds.

    python bench/quality.py --model small --jobs 12 --out docs/results/quality/quality_small_h200   # one GPU
    python bench/quality.py --model tiny --nproc 2 --seeds 3 --out /tmp/quality_tiny          # CPU, gloo

Every run is the project's main job (run by bench/harness.py: megatron-core GPT, Megatron's
schedule, DMuon's owner step or Megatron's AdamW) on the default data (the Python standard
library's bytes, the last 5% held out for validation) or ``--data-path``. Runs need no timing,
so ``--jobs`` of them share the machine (on one GPU, each uses a fraction of it).

Phase 1 sweeps the lr of AdamW and of DMuon's defaults (``--adam-lrs``, ``--dmuon-lrs``; each
lr x each seed). Phase 2 runs every other row at DMuon's best lr (lowest mean final validation
loss): exact DMuon (fp32 standard NS), each fast option, Megatron's own Muon at the same flags.
Output: <out>.json (every run's curves), <out>.md (mean ± std over seeds of the final validation
loss; iterations to reach AdamW's best final validation loss as a share of AdamW's iterations;
each row against exact DMuon) and <out>.png (validation curves, and the lr sweeps).

"Within the seed spread" (the rule for a fast option, docs/quality.md): mean(row) − mean(exact)
≤ 2·max(std(row), std(exact), 0.002); a lower loss always passes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_inputs import OneLineParser, read_json  # noqa: E402
from harness import Job, add_layer_args, has_cuda, in_parallel, job_layer_args, launch_for, layers_of, run  # noqa: E402

# Model, batch and schedule of each preset (flags of the main job); iterations and eval cadence.
MODELS = {
    # the main job's default model (2 CPU ranks in CI)
    "tiny": dict(flags=["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "352",
                        "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "128",
                        "--micro-batch-size", "4", "--global-batch-size", "16", "--lr-warmup-iters", "5"],
                 iters=200, eval_interval=25, adam_lrs=(3e-4, 1e-3, 3e-3), dmuon_lrs=(3e-3, 6e-3, 1.2e-2, 2.4e-2)),
    # 6 x 512, FFN 1408, 8 heads / 4 groups: 18M matrix params
    "small": dict(flags=["--num-layers", "6", "--hidden-size", "512", "--ffn-hidden-size", "1408",
                         "--num-attention-heads", "8", "--num-query-groups", "4", "--seq-length", "512",
                         "--micro-batch-size", "32", "--global-batch-size", "32", "--lr-warmup-iters", "40"],
                  iters=400, eval_interval=25, adam_lrs=(5e-4, 1e-3, 2e-3), dmuon_lrs=(1.5e-3, 3e-3, 6e-3)),
    # 12 x 768, FFN 3072, 12 heads / 4 groups: 104M matrix params
    "medium": dict(flags=["--num-layers", "12", "--hidden-size", "768", "--ffn-hidden-size", "3072",
                          "--num-attention-heads", "12", "--num-query-groups", "4", "--seq-length", "512",
                          "--micro-batch-size", "32", "--global-batch-size", "32", "--lr-warmup-iters", "30"],
                   iters=300, eval_interval=25, adam_lrs=(3e-4, 6e-4, 1.2e-3), dmuon_lrs=(1.5e-3, 3e-3, 6e-3)),
}

# Phase-2 rows: (name, main-job flags on top of DMuon's defaults, needs a GPU)
OPTION_ROWS = [  # in the order they run (the most telling first, all seeds of a row together)
    ("exact (fp32 standard NS)", ["--muon-fp32-matmul-prec", "high", "--dmuon-ns-method", "standard"], False),
    ("Megatron's own Muon (megatron_layerwise)", ["--dmuon-mode", "megatron_layerwise"], True),
    # Megatron's --muon-coefficient-type choices beside the defaults' 'quintic' (Emerging-Optimizers' sets;
    # deepseekv4 is a 10-step schedule: 8 x Keller's, 2 x (2, -1.5, 0.5))
    ("polar_express", ["--muon-coefficient-type", "polar_express"], False),
    ("deepseekv4 (10 steps)", ["--muon-coefficient-type", "deepseekv4", "--muon-num-ns-steps", "10"], False),
    ("adaptive", ["--dmuon-coefficients", "adaptive"], False),
    ("adaptive + standard NS", ["--dmuon-coefficients", "adaptive", "--dmuon-ns-method", "standard"], False),
    ("adaptive + gram NS", ["--dmuon-coefficients", "adaptive", "--dmuon-ns-method", "gram"], False),
    ("gram NS (fp16, restart)", ["--dmuon-ns-method", "gram"], False),
    ("standard NS (bf16)", ["--dmuon-ns-method", "standard"], False),
    ("momentum bf16", ["--dmuon-momentum-dtype", "bf16"], False),
    ("fp8 publish (e4m3)", ["--dmuon-publish-dtype", "fp8_e4m3"], True),
    ("normuon", ["--dmuon-update", "normuon"], False),
    ("dion3 f=1/4 (no Nesterov)", ["--dmuon-update", "dion3", "--dmuon-fraction", "0.25", "--muon-no-nesterov"], False),
    ("megabatch", ["--dmuon-megabatch"], False),
    ("decoupled lr 1e-3 (embedding, output)", ["--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-4"], False),
    ("Megatron's Muon defaults (0.9, no Nesterov, extra scale 1)",
     ["--muon-momentum", "0.9", "--muon-no-nesterov", "--muon-extra-scale-factor", "1.0"], False),
]
EXACT = OPTION_ROWS[0][0]
SPREAD_FLOOR = 0.002


def run_job(spec: dict, workdir: str, nproc: int, gpu: bool) -> dict:
    """One main-job run; its curves and summary, or the error. A run whose timing JSON is in ``workdir``
    already (an earlier attempt with the same flags finished) is read back, not run again."""
    launch = launch_for(nproc, gpu)
    env = dict(PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    if launch == "torchrun":
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    r = run(Job([*(["--bf16"] if gpu else []), *spec["flags"], "--log-interval", "1000000"], nproc=nproc, launch=launch,
                timing_json=os.path.join(workdir, f"{spec['key']}.json"), reuse=True, env=env))
    if not r["ok"]:
        return {**spec, "error": r["error"], "wall_s": r["wall_s"]}
    row = load_run(spec, r["timing"])
    return row if r.get("reused") else {**row, "wall_s": r["wall_s"]}


def load_run(spec: dict, doc: dict) -> dict:
    """A run's row: ``spec`` with its curves and summary from its timing JSON ``doc``."""
    losses = [t["loss"] for t in doc["iterations"]]
    tail = losses[-max(1, len(losses) // 10):]
    return {**spec, "val": [[v["iteration"], v["loss"]] for v in doc["validation"]],
            "train_loss": losses, "final_val_loss": doc["summary"]["val_loss"],
            "final_train_loss": sum(tail) / len(tail), "skipped": doc["summary"]["skipped_iterations"],
            "ns_paths": doc["summary"].get("ns_paths", {}), "layers": layers_of(doc["summary"])}


def job_flags(model: dict, base: list, row_flags: list, lr: float, seed: int, iters: int) -> list:
    return [*model["flags"], *base, "--train-iters", str(iters), "--eval-interval", str(model["eval_interval"]),
            "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", "--seed", str(seed), *row_flags]


def run_all(specs: list, args, gpu: bool, results: list, save) -> None:
    """Run ``specs`` ``args.jobs`` at a time; append each result and save as it finishes."""
    os.makedirs(args.workdir, exist_ok=True)
    in_parallel(lambda spec: run_job(spec, args.workdir, args.nproc, gpu), specs, args.jobs,
                on_done=lambda spec, result: _finish(results, spec, result, save),
                deadline=time.time() + args.budget_s if args.budget_s else None,
                not_started=lambda spec: {**spec, "error": "not started: --budget-s reached"})


def _finish(results, spec, result, save) -> None:
    results.append(result)
    status = "error" if "error" in result else f"val {result['final_val_loss']:.4f}"
    print(f"[{time.strftime('%H:%M:%S')}] {spec['row']} lr={spec['lr']:g} seed={spec['seed']}: {status} "
          f"({result.get('wall_s', 0):.0f} s)", flush=True)
    save()


def summarize(results: list, row: str, lr: float) -> dict | None:
    runs = [r for r in results if r["row"] == row and r["lr"] == lr and "error" not in r]
    if not runs:
        return None
    finals = [r["final_val_loss"] for r in runs]
    its = [v[0] for v in runs[0]["val"]]
    curve = [statistics.fmean(r["val"][i][1] for r in runs) for i in range(len(its))] if all(
        len(r["val"]) == len(its) for r in runs) else None
    return {"row": row, "lr": lr, "seeds": len(runs), "per_seed": {r["seed"]: r["final_val_loss"] for r in runs},
            "mean": statistics.fmean(finals),
            "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "train_tail": statistics.fmean(r["final_train_loss"] for r in runs),
            "skipped": sum(r["skipped"] for r in runs), "iterations": its, "curve": curve,
            "ns_path": ns_path_words(runs)}


def ns_path_words(runs: list) -> str:
    """The NS paths a row's runs ran ('auto' resolved on the device), e.g. 'gram float16 you x5
    (4 shapes); standard bfloat16 you x5 (2)'; '' for AdamW and runs from before it was recorded."""
    counts: dict = {}
    for path in (runs[0].get("ns_paths") or {}).values():
        counts[path] = counts.get(path, 0) + 1
    return "; ".join(f"{p} ({n})" for p, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def best_lr(results: list, row: str, lrs) -> tuple:
    rows = [s for s in (summarize(results, row, lr) for lr in lrs) if s is not None]
    return min(rows, key=lambda s: s["mean"]) if rows else None


def iterations_to_reach(summary: dict, target: float) -> float | None:
    """First iteration at which the mean validation curve reaches ``target`` (linear between eval
    points), or None if it never does."""
    if not summary or not summary["curve"]:
        return None
    prev = None
    for it, loss in zip(summary["iterations"], summary["curve"]):
        if loss <= target:
            if prev is None:
                return float(it)
            (i0, l0) = prev
            return i0 + (it - i0) * (l0 - target) / (l0 - loss)
        prev = (it, loss)
    return None


def paired_delta(row: dict, ref: dict) -> float | None:
    """Mean over the seeds both rows ran of row − ref (same seed: same init and data order)."""
    common = [s for s in row["per_seed"] if s in ref["per_seed"]]
    return statistics.fmean(row["per_seed"][s] - ref["per_seed"][s] for s in common) if common else None


def within_spread(row: dict, ref: dict) -> bool:
    return row["mean"] - ref["mean"] <= 2 * max(row["std"], ref["std"], SPREAD_FLOOR)


def table(doc: dict) -> str:
    rows, adam, exact, dmuon = doc["rows"], doc["adam_best"], doc.get("exact"), doc.get("dmuon_best")
    target = f"({adam['mean']:.4f})" if adam else "(no AdamW run here)"
    layers = f" ({', '.join(doc['layers'])} layers)" if doc.get("layers") else ""
    lines = [f"{doc['model']} model{layers}, {doc['iters']} iterations, {doc['seeds']} seeds, on {doc['machine']}; final "
             f"validation loss (mean ± std over seeds), last-10% training loss; 'to AdamW' = iterations to reach "
             f"AdamW's best final validation loss {target} /",
             f"AdamW's iterations; 'paired Δ' = mean over common seeds of (row − DMuon defaults at the same lr); "
             f"'NS path' = what each run's owner step ran (method, dtype, schedule, steps: number of matrix shapes)", "",
             "| row | lr | seeds | final val loss | train loss (last 10%) | to AdamW | paired Δ | vs exact DMuon | NS path |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in rows:
        reach = iterations_to_reach(s, adam["mean"]) if adam else None
        ratio = "" if adam is None else "never" if reach is None else f"{reach / doc['iters']:.2f}"
        verdict = "" if exact is None or s["row"] == EXACT or s["row"] == "AdamW" else (
            "within spread" if within_spread(s, exact) else f"worse (+{s['mean'] - exact['mean']:.4f})")
        delta = paired_delta(s, dmuon) if dmuon and s["lr"] == dmuon["lr"] and s is not dmuon else None
        lines.append(f"| {s['row']} | {s['lr']:g} | {s['seeds']} | {s['mean']:.4f} ± {s['std']:.4f} | "
                     f"{s['train_tail']:.4f} | {ratio} | {'' if delta is None else f'{delta:+.4f}'} | {verdict} | "
                     f"{s.get('ns_path', '')} |")
    lines += ["", "lr sweeps (final validation loss, mean ± std over seeds):", "", "| row | lr | seeds | final val loss |",
              "|---|---:|---:|---:|"]
    for s in doc["sweeps"]:
        lines.append(f"| {s['row']} | {s['lr']:g} | {s['seeds']} | {s['mean']:.4f} ± {s['std']:.4f} |")
    seen = set()
    for e in doc["errors"]:
        key = (e["row"], e["lr"], e["seed"])
        if key in seen or any((r["row"], r["lr"], r["seed"]) == key for r in doc["runs"] if "error" not in r):
            continue
        seen.add(key)
        last = next((line.strip() for line in reversed(e["error"].splitlines()) if "Error" in line), e["error"][-200:])
        lines.append(("\n" if not seen - {key} else "") + f"- not run / failed: {e['row']} lr={e['lr']:g} seed={e['seed']}: {last[:240]}")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for s in doc["rows"]:
        if s["curve"]:
            ax.plot(s["iterations"], s["curve"], label=f"{s['row']} ({s['mean']:.3f})", lw=1.3)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"validation loss (mean of {doc['seeds']} seeds)")
    ax.set_title(f"{doc['model']} GPT: validation loss")
    finals = [s["mean"] for s in doc["rows"]]
    ax.set_ylim(min(finals) - 0.1, max(finals) + 0.6)
    ax.legend(fontsize=7)
    for row in ("AdamW", "DMuon defaults"):
        pts = sorted((s["lr"], s["mean"], s["std"]) for s in doc["sweeps"] if s["row"] == row)
        if pts:
            bx.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", label=row,
                        capsize=3)
    bx.set_xscale("log")
    bx.set_xlabel("lr")
    bx.set_ylabel("final validation loss")
    bx.set_title("lr sweeps")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_doc(results, args, model, gpu, option_rows, dmuon_lr) -> dict:
    sweeps = [s for row, lrs in (("AdamW", args.adam_lrs), ("DMuon defaults", args.dmuon_lrs))
              for s in (summarize(results, row, lr) for lr in lrs) if s is not None]
    adam = best_lr(results, "AdamW", args.adam_lrs)
    dmuon = best_lr(results, "DMuon defaults", args.dmuon_lrs)
    rows = [r for r in (adam, dmuon) if r] + [s for s in (summarize(results, name, dmuon_lr) for name, _, _ in option_rows)
                                              if s is not None]
    exact = next((s for s in rows if s["row"] == EXACT), None)
    machine = "one H200 (bf16)" if gpu else f"CPU, {args.nproc} gloo ranks (fp32)"
    layers = sorted({r["layers"] for r in results if r.get("layers")})
    return {"model": args.model, "layers": layers, "model_flags": model["flags"], "iters": args.iters, "seeds": len(args.seeds),
            "machine": machine, "adam_best": adam, "dmuon_best": dmuon, "exact": exact, "rows": rows,
            "sweeps": sweeps, "errors": [r for r in results if "error" in r], "runs": results}


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--iters", type=int, default=None, help="training iterations (default: the preset's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--sweep-seeds", type=int, nargs="+", default=None,
                   help="seeds of every lr of the sweeps (default: --seeds); the best lr then gets all --seeds")
    p.add_argument("--adam-lrs", type=float, nargs="+", default=None)
    p.add_argument("--dmuon-lrs", type=float, nargs="+", default=None)
    p.add_argument("--dmuon-lr", type=float, default=None, help="phase 2's lr (default: the sweep's best)")
    p.add_argument("--rows", nargs="+", default=None,
                   help="phase-2 rows: names, or prefixes ending in '*' (default: every row that runs here)")
    p.add_argument("--skip-sweep", action="store_true", help="phase 2 only (needs --dmuon-lr)")
    p.add_argument("--jobs", type=int, default=1,
                   help="concurrent runs (one H200: 12 of the small model; the medium one takes ~20 GiB each, so "
                        "at most 6)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (CPU: gloo)")
    p.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--resume", default=None, help="a previous <out>.json: its finished runs are reused")
    p.add_argument("--out", required=True, help="output prefix (<out>.json/.md/.png)")
    p.add_argument("--report", action="store_true", help="only rewrite <out>.md/.png from <out>.json")
    p.add_argument("--workdir", default=None)
    add_layer_args(p)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="flags for every run")
    args = p.parse_args(argv)
    model = MODELS[args.model]
    args.iters = args.iters or model["iters"]
    args.adam_lrs = args.adam_lrs or list(model["adam_lrs"])
    args.dmuon_lrs = args.dmuon_lrs or list(model["dmuon_lrs"])
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="quality_")
    if args.report:  # the tables again from the runs (any version of this script wrote them)
        old = read_json(p, "--report: --out", args.out + ".json", "the PREFIX of a quality.py run (PREFIX.json)",
                        need=("runs", "iters", "machine"))
        runs = old["runs"]
        args.iters, args.seeds = old["iters"], sorted({r["seed"] for r in runs})
        args.adam_lrs = sorted({r["lr"] for r in runs if r["row"] == "AdamW"})
        args.dmuon_lrs = sorted({r["lr"] for r in runs if r["row"] == "DMuon defaults"})
        present = {r["row"] for r in runs}
        rows = [r for r in OPTION_ROWS if r[0] in present]
        gpu = old["machine"].startswith("one H200")
        best = best_lr(runs, "DMuon defaults", args.dmuon_lrs)
        return write_report(build_doc(runs, args, model, gpu, rows, args.dmuon_lr or best["lr"]), args.out)
    gpu = has_cuda()
    option_rows = [r for r in OPTION_ROWS if (gpu or not r[2]) and (
        args.rows is None or any(r[0] == w or (w.endswith("*") and r[0].startswith(w[:-1])) for w in args.rows))]
    results = []
    if args.resume:
        previous = read_json(p, "--resume", args.resume, "a previous quality.py run's PREFIX.json", need=("runs",))
        if not isinstance(previous["runs"], list) or not all(isinstance(r, dict) for r in previous["runs"]):
            p.error(f"--resume {args.resume}: its 'runs' must be a list of runs; give a previous quality.py run's "
                    "PREFIX.json")
        results = [r for r in previous["runs"] if "error" not in r]

    def spec(row, flags, lr, seed):
        key = f"{row}|{lr:g}|{seed}|{args.iters}"
        return {"row": row, "lr": lr, "seed": seed, "key": "".join(c if c.isalnum() else "_" for c in key)[:150],
                "flags": job_flags(model, [*job_layer_args(args), *args.extra], flags, lr, seed, args.iters)}

    def todo(specs):
        done = {(r["row"], r["lr"], r["seed"]) for r in results}
        return [s for s in specs if (s["row"], s["lr"], s["seed"]) not in done]

    dmuon_lr = args.dmuon_lr

    def save():
        doc = build_doc(results, args, model, gpu, option_rows, dmuon_lr or 0.0)
        with open(args.out + ".json", "w") as f:
            json.dump(doc, f)

    sweep_rows = (("AdamW", ["--optimizer", "adam"], args.adam_lrs), ("DMuon defaults", [], args.dmuon_lrs))
    if not args.skip_sweep:
        seeds = args.sweep_seeds or args.seeds
        run_all(todo([spec(row, flags, lr, seed) for row, flags, lrs in sweep_rows for seed in seeds for lr in lrs]),
                args, gpu, results, save)
        rest = [spec(row, flags, best["lr"], seed) for row, flags, lrs in sweep_rows
                for best in [best_lr(results, row, lrs)] if best for seed in args.seeds]
        run_all(todo(rest), args, gpu, results, save)  # the best lr of each sweep: every seed
    if dmuon_lr is None:
        best = best_lr(results, "DMuon defaults", args.dmuon_lrs)
        if best is None:
            raise SystemExit("no DMuon run of the sweep finished: pass --dmuon-lr")
        dmuon_lr = best["lr"]
    print(f"phase 2 at DMuon's lr {dmuon_lr:g}", flush=True)
    run_all(todo([spec(name, flags, dmuon_lr, seed) for name, flags, _ in option_rows for seed in args.seeds]),
            args, gpu, results, save)
    save()
    write_report(build_doc(results, args, model, gpu, option_rows, dmuon_lr), args.out)


def write_report(doc: dict, out: str) -> None:
    text = table(doc)
    print(text)
    with open(out + ".md", "w") as f:
        f.write(text)
    try:
        plot(doc, out + ".png")
    except ImportError as e:  # the numbers stand without the picture
        print(f"no plot: {e}")


if __name__ == "__main__":
    main()
