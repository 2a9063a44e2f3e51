"""Golden outputs of a tree, for a change that must not change behaviour (a refactor): every iteration's
loss of the CPU main job in each mode and main option, `dmuon plan --json` on a set of layouts, and a
checkpoint this tree wrote, resumed by the other tree.

    git worktree add /tmp/base <old commit>
    (cd /tmp/base && python bench/golden.py capture --out /tmp/golden_old)
    python bench/golden.py capture --out /tmp/golden_new --resume-from /tmp/golden_old
    python bench/golden.py compare /tmp/golden_old /tmp/golden_new

``capture`` writes OUT/golden.json and OUT/checkpoint (a 3-iteration dmuon run, saved), which it resumes
to iteration 6; ``--resume-from OLD`` also resumes OLD/checkpoint here, which ``compare`` sets against
OLD's own resume of it. Losses are compared as floats, exactly (the same
ranks, the same CPU kernels, one thread each): a refactor gives the same numbers or it changed something.
Runs on CPU (gloo, 2 ranks), about 3 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_inputs import OneLineParser, read_json  # noqa: E402  (one-line usage errors, exit 2)
from harness import main_job as main_job_program  # noqa: E402  (the one place bench/ names the main job)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--seq-length", "32", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-layers", "2",
         "--global-batch-size", "8", "--micro-batch-size", "2", "--lr-warmup-iters", "1", "--eval-iters", "0",
         "--log-interval", "1", "--seed", "1234"]
ITERS = 6
# name -> the main job's options (2 CPU ranks): each mode, each update rule, and the options whose path
# through the flags, the config and the plan a refactor of the upper floor touches
RUNS = {
    "dmuon": [],
    "dmuon_normuon": ["--dmuon-update", "normuon"],
    "dmuon_dion3": ["--dmuon-update", "dion3", "--dmuon-fraction", "0.5", "--muon-no-nesterov"],
    "dmuon_overlap_step": ["--dmuon-overlap-step", "on", "--overlap-param-gather", "--overlap-grad-reduce"],
    "dmuon_split_layout": ["--dmuon-dp-layout", "split"],
    "dmuon_numel_lpt_keller": ["--dmuon-balance", "numel_lpt", "--muon-coefficient-type", "quintic"],
    "dmuon_gram_polar_express": ["--dmuon-ns-method", "gram", "--dmuon-coefficients", "polar_express"],
    "dmuon_split_heads_glu": ["--dmuon-split-heads", "--dmuon-split-glu"],
    "dmuon_tp2": ["--tensor-model-parallel-size", "2"],
    "gather_then_compute": ["--dmuon-mode", "gather_then_compute"],
    "megatron_layerwise": ["--dmuon-mode", "megatron_layerwise", "--bf16"],
    "adam": ["--optimizer", "adam"],
}
# dmuon plan's layouts: presets x parallel sizes x planners
PLANS = [
    ["--preset", "qwen7b-4l", "--dp", "8"],
    ["--preset", "qwen7b-4l", "--dp", "4", "--tp", "2", "--planners", "greedy", "numel_lpt", "round_robin"],
    ["--preset", "qwen2.5-7b", "--dp", "256", "--planners", "greedy", "split"],
    ["--preset", "tiny", "--dp", "4", "--dmuon-split-glu", "--dmuon-split-heads", "--dmuon-coefficients", "adaptive"],
    ["--preset", "qwen2.5-32b", "--dp", "128", "--dp-layouts", "--instances", "1", "2"],
    ["--preset", "tiny-moe", "--dp", "4", "--ep", "2", "--planners", "greedy", "megatron_lpt"],
]


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                DMUON_PLAN_CACHE=os.path.join(tempfile.gettempdir(), f"golden_plans_{os.getpid()}.json"),
                DMUON_AUTOTUNE_CACHE=os.path.join(tempfile.gettempdir(), f"golden_tune_{os.getpid()}.json"))


def main_job(options, timing, iters=ITERS):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *main_job_program(gpu=False), "--train-iters", str(iters), "--timing-json", timing,
           *SMALL, *options]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900, cwd=ROOT)
    if done.returncode != 0:
        said = [line for line in (done.stdout + done.stderr).splitlines() if "error:" in line.lower()]
        return {"error": "\n".join(said[:3]) or (done.stdout[-1500:] + done.stderr[-1500:]).strip()}
    with open(timing) as f:
        report = json.load(f)
    return {"losses": [r["loss"] for r in report["iterations"]],
            "skipped": report["summary"]["skipped_iterations"], "ns_paths": report["summary"].get("ns_paths"),
            "plan": report.get("dmuon_plan")}


def resume(checkpoint, tmp, name):
    """``checkpoint`` (3 iterations) continued to ITERS under this run's schedule, saving elsewhere."""
    return main_job(["--load", checkpoint, "--save", os.path.join(tmp, "resumed_" + name),
                     "--override-opt_param-scheduler"], os.path.join(tmp, f"resumed_{name}.json"))


def _without_timings(value):
    """A plan report without what the clock measured (``*_seconds``): the rest is the plan."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if not (k == "seconds" or k.endswith("_seconds"))}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def dmuon_plan(options):
    done = subprocess.run([sys.executable, "-m", "megatron_dmuon.planning.plan_cli", *options, "--json"],
                          capture_output=True, text=True, env=_env(), timeout=900, cwd=ROOT)
    if done.returncode != 0:
        return {"error": done.stderr[-1500:].strip()}
    return _without_timings(json.loads(done.stdout))


def capture(args):
    os.makedirs(args.out, exist_ok=True)
    golden = {"runs": {}, "plans": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in RUNS.items():
            golden["runs"][name] = main_job(options, os.path.join(tmp, name + ".json"))
            print(name, "error" if "error" in golden["runs"][name] else golden["runs"][name]["losses"][-1], flush=True)
        save = os.path.join(args.out, "checkpoint")
        golden["saved"] = main_job(["--save", save], os.path.join(tmp, "saved.json"), iters=3)
        golden["resumed_self"] = resume(save, tmp, "self")
        if args.resume_from:
            golden["resumed_old"] = resume(os.path.join(args.resume_from, "checkpoint"), tmp, "old")
    for options in PLANS:
        golden["plans"][" ".join(options)] = dmuon_plan(options)
    with open(os.path.join(args.out, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
    print(f"wrote {args.out}/golden.json")


def compare(args, parser):
    old = read_json(parser, "OLD", os.path.join(args.old, "golden.json"), "a `capture --out` folder", need=("runs",))
    new = read_json(parser, "NEW", os.path.join(args.new, "golden.json"), "a `capture --out` folder", need=("runs",))
    differ = []
    for name in sorted(set(old["runs"]) | set(new["runs"])):
        if old["runs"].get(name) != new["runs"].get(name):
            differ.append(f"run {name}: {_first_difference(old['runs'].get(name), new['runs'].get(name))}")
    for key in sorted(set(old["plans"]) | set(new["plans"])):
        if old["plans"].get(key) != new["plans"].get(key):
            differ.append(f"dmuon plan {key}: {_first_difference(old['plans'].get(key), new['plans'].get(key))}")
    for name in ("saved", "resumed_self"):
        if old.get(name) != new.get(name):
            differ.append(f"{name}: {_first_difference(old.get(name), new.get(name))}")
    if "resumed_old" in new and new["resumed_old"] != old.get("resumed_self"):
        differ.append("the old tree's checkpoint resumed here vs there: "
                      + _first_difference(old.get("resumed_self"), new["resumed_old"]))
    print("\n".join(differ) if differ else f"identical: {len(new['runs'])} runs, {len(new['plans'])} plans, a save and "
          "its resume" + (", the old tree's checkpoint resumed here as there" if "resumed_old" in new else ""))
    return 1 if differ else 0


def _first_difference(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path or 'value'}: {str(a)[:300]} vs {str(b)[:300]}"


def main(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="how", required=True)
    c = sub.add_parser("capture", help="this tree's golden outputs into OUT")
    c.add_argument("--out", required=True)
    c.add_argument("--resume-from", help="a capture folder of another tree: resume its checkpoint here")
    d = sub.add_parser("compare", help="two capture folders; exit 1 where they differ")
    d.add_argument("old")
    d.add_argument("new")
    args = p.parse_args(argv)
    if args.how == "capture":
        if os.path.exists(os.path.join(args.out, "checkpoint")):
            p.error(f"--out {args.out} already holds a capture (its checkpoint/): give a new folder")
        if args.resume_from and not os.path.isdir(os.path.join(args.resume_from, "checkpoint")):
            p.error(f"--resume-from {args.resume_from} holds no checkpoint/: give a `capture --out` folder")
        return capture(args)
    return compare(args, p)


if __name__ == "__main__":
    sys.exit(main())
