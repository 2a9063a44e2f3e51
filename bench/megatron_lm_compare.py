"""Megatron-LM's own `--optimizer muon` against `--optimizer dmuon`, same model, same `--muon-*` flags.

    python bench/megatron_lm_compare.py --megatron-lm .mlm --nproc 1 --iters 30 --out "$OUT"

Patches the Megatron-LM checkout (patches/apply.sh, idempotent), then runs its `pretrain_gpt.py`
under torchrun once per optimizer with `--mock-data` and identical flags, and reads Megatron's own
progress lines (`--log-interval 1`). Runs (`--runs`):

* `muon`           Megatron's Muon (emerging_optimizers; with --use-distributed-optimizer its
                   LayerWiseDistributedOptimizer), bf16 Newton-Schulz (`--muon-fp32-matmul-prec medium`);
* `muon_fp32ns`    the same with fp32 Newton-Schulz (`high`): how far bf16 rounding alone moves the
                   loss curve — the noise band DMuon's curve is judged against;
* `muon_syrk`      Megatron's Muon with `--muon-use-syrk` (Emerging-Optimizers' Triton SYRK kernel for
                   the NS's symmetric products): its fastest setting, in the default set where the
                   Emerging-Optimizers this process imports is >= 0.4.0 and the tree has the flag
                   (Megatron-LM main); every table names the Emerging-Optimizers version;
* `dmuon`          DMuon through the hook, same flags (`--dmuon-ns-method auto` by default);
* `dmuon_standard` DMuon with `--dmuon-ns-method standard` (the NS iteration Megatron runs);
* `dmuon_fp32ns`   DMuon with fp32 Newton-Schulz (`high`; full fp32 here, TF32 matmuls in Megatron's);
* `adam`           Megatron's distributed Adam, for the step-time baseline (not in the default set);
* `muon_lsm`       Megatron-LM PR #6683's LayerShardedMuon (`--use-layer-sharding-muon`) at its fastest settings:
                   `--muon-ns-batch-size 32` (same-shape matrices per batched NS), its param groups on streams of
                   their own (its default), `--muon-no-split-qkv` (it refuses split QKV); needs a tree with the
                   flag (`--megatron-lm-for muon_lsm=.mlm_pr6683`). Its NS homes live in the TP x GTP domain: with
                   one rank there (one GPU, TP 1) it leaves them unassigned and steps as Megatron's
                   TensorParallelMuon, one matrix at a time;
* `muon_lsm_syrk`  the same with `--muon-use-syrk` and `--muon-ns-batch-size 1` (Emerging-Optimizers 0.4.0's SYRK
                   kernel runs on unbatched NS only; its batched one needs >= 0.5.0a0).

`--megatron-lm-for RUN=DIR` runs RUN on the tree DIR and every other run on `--megatron-lm`, so Megatron-LM
main's runs and a pull request's sit in one table; every row names its tree (the commit where the tree
holds a git checkout or a COMMIT file, else its folder and megatron-core version) and its NS path.

Prints (and writes under --out) JSON with every iteration's loss and time, and a markdown table:
median ms/iteration over the second half, loss gap to `muon` (max |Δ| over iterations, and the
last iteration), and the bf16 noise band (`muon_fp32ns` vs `muon`). Needs a GPU.

Layers (`--transformer-impl`): Megatron-LM's default Transformer Engine layers where
transformer_engine imports ('auto'), with `--gradient-accumulation-fusion` (Megatron-LM's default)
where Apex's fused_weight_gradient_mlp_cuda imports (launch/build_apex_wgrad.sh), else
`--no-gradient-accumulation-fusion`; `--fp8-format hybrid --fp8-recipe delayed|tensorwise
[--fp8-param-gather]` train in FP8 through TE. Without TE: `--transformer-impl local` and the
fusions off. Every table names the layers and precision it ran.

`--seeds S ...` repeats every run per seed (`--seed S`: init and mock data), so the noise band is a
spread over seeds rather than one sample; `--jobs N` runs N of them at once on the GPU (loss curves
only: with N > 1 the times are not per-iteration times and the table leaves them out). Per seed,
each run's gap is taken to that seed's `muon` and set beside that seed's band.

`--qk-clip T` runs every optimizer with MuonClip (`--qk-clip --qk-clip-threshold T`). Only Transformer
Engine's attention records the max logits MuonClip reads; without TE each run starts through
`megatron_dmuon.testing.local_max_logits`, which makes the local attention record them (the same for
every optimizer) and reports how many of Megatron's `clip_qk` calls found a logit above T.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from cli_inputs import OneLineParser, patch_megatron_lm_tree  # noqa: E402  (one-line usage errors, exit 2)
from harness import ROOT  # noqa: E402

# A Qwen2.5-7B-shaped GPT cut to 4 layers (+32k vocab), as in docs/dmuon_dp.md's measurements
MODELS = {
    "qwen7b-4l": ["--num-layers", "4", "--hidden-size", "3584", "--ffn-hidden-size", "18944",
                  "--num-attention-heads", "28", "--group-query-attention", "--num-query-groups", "4",
                  "--kv-channels", "128", "--seq-length", "4096", "--max-position-embeddings", "4096",
                  "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
                  "--position-embedding-type", "rope", "--rotary-base", "1000000", "--disable-bias-linear",
                  "--add-qkv-bias", "--untie-embeddings-and-output-weights", "--vocab-size", "32000",
                  "--micro-batch-size", "1", "--global-batch-size", "8"],
    "small": ["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
              "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4",
              "--seq-length", "1024", "--max-position-embeddings", "1024", "--swiglu", "--normalization", "RMSNorm",
              "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
              "--vocab-size", "32000", "--micro-batch-size", "2", "--global-batch-size", "16"],
}
COMMON = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--bf16", "--seed", "1234",
          "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
          "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
          "--init-method-std", "0.02", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
          "--log-interval", "1", "--log-throughput", "--eval-iters", "0", "--eval-interval", "1000000",
          "--use-distributed-optimizer"]
# Megatron-LM without Transformer Engine (docs: FACTS)
NO_TE = ["--transformer-impl", "local", "--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
         "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
         "--attention-backend", "unfused"]
# the same Muon flags for Megatron's Muon and for DMuon (Moonlight's AdamW-matched update RMS)
MUON = ["--muon-momentum", "0.95", "--muon-nesterov", "--muon-scale-mode", "spectral",
        "--muon-extra-scale-factor", "0.2", "--muon-coefficient-type", "quintic", "--muon-num-ns-steps", "5",
        "--muon-tp-mode", "duplicated"]
OVERLAP_COMM = ["--overlap-grad-reduce", "--overlap-param-gather"]
LSM = ["--use-layer-sharding-muon", "--muon-no-split-qkv"]  # PR #6683's Muon (it refuses split QKV)
RUNS = {
    "muon": ["--optimizer", "muon", *MUON, "--muon-fp32-matmul-prec", "medium"],
    "muon_fp32ns": ["--optimizer", "muon", *MUON, "--muon-fp32-matmul-prec", "high"],
    "muon_syrk": ["--optimizer", "muon", *MUON, "--muon-fp32-matmul-prec", "medium", "--muon-use-syrk"],
    "dmuon": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium"],
    "dmuon_standard": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium",
                       "--dmuon-ns-method", "standard"],
    "dmuon_fp32ns": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "high"],
    # DMuon's metrics on (docs/metrics.md: Megatron's TensorBoard writer, DMuon's names under dmuon/), against "dmuon"
    "dmuon_metrics": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium",
                      "--tensorboard-dir", os.path.join(tempfile.gettempdir(), "dmuon_metrics_tb")],
    "adam": ["--optimizer", "adam"],
    # Megatron-LM PR #6683 (LayerShardedMuon): its fastest settings, and with its SYRK kernel on unbatched NS
    "muon_lsm": ["--optimizer", "muon", *MUON, "--muon-fp32-matmul-prec", "medium", *LSM, "--muon-ns-batch-size", "32"],
    "muon_lsm_syrk": ["--optimizer", "muon", *MUON, "--muon-fp32-matmul-prec", "medium", *LSM, "--muon-ns-batch-size",
                      "1", "--muon-use-syrk"],
    # Megatron-LM's communication overlap (launch/megatron_lm_common.sh's flags), and DMuon's overlapped
    # step on top of it ('sync': the same per-bucket-group stacks inside the step, its bitwise twin)
    "adam_ogp": ["--optimizer", "adam", *OVERLAP_COMM],
    "muon_ogp": ["--optimizer", "muon", *MUON, "--muon-fp32-matmul-prec", "medium", *OVERLAP_COMM],
    "dmuon_ogp": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium", *OVERLAP_COMM],
    "dmuon_overlap": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium", *OVERLAP_COMM,
                      "--dmuon-overlap-step", "on"],
    "dmuon_overlap_sync": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium", *OVERLAP_COMM,
                           "--dmuon-overlap-step", "sync"],
    # the same three with each NS stack set replayed as one CUDA graph (the step returns at once)
    "dmuon_ogp_graph": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium", *OVERLAP_COMM,
                        "--dmuon-ns-launch", "graph"],
    "dmuon_overlap_graph": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium", *OVERLAP_COMM,
                            "--dmuon-overlap-step", "on", "--dmuon-ns-launch", "graph"],
    "dmuon_overlap_sync_graph": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium", *OVERLAP_COMM,
                                 "--dmuon-overlap-step", "sync", "--dmuon-ns-launch", "graph"],
    # started in the last backward, each bucket group behind its grad reduce (speculative under clipping)
    "dmuon_backward_graph": ["--optimizer", "dmuon", *MUON, "--muon-fp32-matmul-prec", "medium", *OVERLAP_COMM,
                             "--dmuon-overlap-step", "backward", "--dmuon-ns-launch", "graph"],
}
# what each run's Newton-Schulz is (every table row names it)
NS_PATHS = {
    "adam": "none (AdamW)",
    "muon": "Megatron: EO newton_schulz, bf16 (medium), one matrix at a time, Q/K/V apart",
    "muon_fp32ns": "Megatron: EO newton_schulz, fp32 (high), one matrix at a time",
    "muon_syrk": "Megatron: EO newton_schulz + EO SYRK kernel, bf16, one matrix at a time",
    "muon_lsm": "PR #6683: EO newton_schulz bf16, batched stacks of <= 32 on multi-rank TP x GTP homes (one rank: "
                "one matrix at a time), QKV whole",
    "muon_lsm_syrk": "PR #6683: EO newton_schulz + EO SYRK kernel, bf16, one matrix at a time, QKV whole",
    "dmuon_standard": "DMuon: standard NS bf16, batched same-shape stacks (symmetric kernels)",
    "dmuon_fp32ns": "DMuon: auto (Gram / standard) in fp32, batched same-shape stacks",
}
for _name, _flags in RUNS.items():
    if _name.startswith("dmuon"):
        NS_PATHS.setdefault(_name, "DMuon: auto (Gram fp16 wide, standard bf16 square), batched same-shape stacks"
                            + (", CUDA graph" if "graph" in _flags else ""))
    elif _name.startswith("muon") or _name.startswith("adam"):
        NS_PATHS.setdefault(_name, NS_PATHS[_name.split("_")[0]])
CLIP_SUMMARY = re.compile(r"local_max_logits summary: (\{.*\})")
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|")
FIELDS = {"loss": r"lm loss: ([-\d.E+na]+) \|", "grad_norm": r"grad norm: ([\d.E+na]+) \|",
          "tflops": r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|",
          "skipped": r"number of skipped iterations:\s+(\d+) \|", "nan": r"number of nan iterations:\s+(\d+) \|"}


def parse_log(text: str) -> list:
    rows = []
    for line in text.splitlines():
        m = LINE.search(line)
        if not m:
            continue
        row = {"iteration": int(m.group(1)), "ms": float(m.group(2))}
        for key, pattern in FIELDS.items():
            f = re.search(pattern, line)
            row[key] = float(f.group(1)) if f else None
        rows.append(row)
    return rows


def te_available() -> bool:
    """Whether Transformer Engine imports here (Megatron-LM's default layers need it)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def apex_wgrad_available() -> bool:
    """Whether Apex's fused_weight_gradient_mlp_cuda imports (Megatron-LM's default
    --gradient-accumulation-fusion needs it for the non-TE output layer)."""
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except Exception:
        return False
    return True


def layer_flags(args) -> list:
    """Megatron-LM's layer and precision flags for this run set: its TE defaults (fused wgrad
    accumulation where Apex's extension imports, else off) with --fp8-* as asked, or the local layers."""
    if args.transformer_impl == "local":
        return list(NO_TE)
    out = ["--transformer-impl", "transformer_engine"]
    if not args.gradient_accumulation_fusion:
        out.append("--no-gradient-accumulation-fusion")
    if args.fp8_format:
        out += ["--fp8-format", args.fp8_format, "--fp8-recipe", args.fp8_recipe]
        if args.fp8_param_gather:
            out.append("--fp8-param-gather")
    return out


def resolve_layers(args) -> None:
    """'auto' flags resolved against this machine: TE where it imports (else local layers); fused
    wgrad accumulation where Apex's extension imports. FP8 needs TE."""
    if args.transformer_impl == "auto":
        args.transformer_impl = "transformer_engine" if te_available() else "local"
    if args.gradient_accumulation_fusion is None:
        args.gradient_accumulation_fusion = args.transformer_impl == "transformer_engine" and apex_wgrad_available()
    if args.fp8_format and args.transformer_impl != "transformer_engine":
        raise SystemExit("megatron_lm_compare.py: --fp8-format needs Transformer Engine (--transformer-impl "
                         "transformer_engine, and transformer_engine importable)")
    if args.fp8_param_gather and not args.fp8_format:
        raise SystemExit("megatron_lm_compare.py: --fp8-param-gather needs --fp8-format")


def precision_label(args) -> str:
    """'bf16', or e.g. 'fp8 hybrid/delayed + fp8 params', with the layers: what every row of a file ran."""
    precision = "bf16" if not args.fp8_format else f"fp8 {args.fp8_format}/{args.fp8_recipe}" + (
        " + --fp8-param-gather" if args.fp8_param_gather else "")
    layers = "TE layers" if args.transformer_impl == "transformer_engine" else "local layers (no TE)"
    fusion = ", fused wgrad accumulation" if args.gradient_accumulation_fusion else ""
    return f"{layers}, {precision}{fusion}"


def run(name, args, megatron_lm, log_dir, label=None, more=()) -> dict:
    """One run of Megatron-LM's pretrain_gpt.py (bench/harness.py) with RUNS[name] (+ ``more`` flags); its log is
    ``label or name``.log."""
    qk_clip = getattr(args, "qk_clip", None)
    # every run through DMuon's launcher (megatron/run.py: the hook on the unmodified script, as users
    # run it; a patched tree's own install() is the same, idempotent). TE's attention records the max
    # logits MuonClip reads; the local one does through local_max_logits, which then runs that launcher
    local = getattr(args, "transformer_impl", "local") == "local"
    launcher = ["-m", "megatron_dmuon.testing.local_max_logits" if qk_clip and local else "megatron_dmuon.megatron.run"]
    flags = [*MODELS[args.model], *COMMON, *(layer_flags(args) if hasattr(args, "transformer_impl") else NO_TE),
             "--train-iters", str(args.iters), *RUNS[name], *args.extra, *more,
             *(["--qk-clip", "--qk-clip-threshold", str(qk_clip)] if qk_clip else [])]
    env = dict(CUDA_DEVICE_MAX_CONNECTIONS=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"), PYTHONWARNINGS="ignore", **harness.NO_MULTICAST,
               PYTHONPATH=os.pathsep.join([ROOT, megatron_lm] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = harness.run(harness.Job(flags, program=[*launcher, os.path.join(megatron_lm, "pretrain_gpt.py")],
                                     nproc=args.nproc, env=env, cwd=megatron_lm, timeout=args.timeout,
                                     log=os.path.join(log_dir, f"{label or name}.log") if log_dir else None, show=True))
    log, returncode = result["output"], result["returncode"]
    rows = parse_log(log)
    shown = [l for l in log.splitlines() if LINE.search(l)]
    print("\n".join(shown[:2] + (["..."] if len(shown) > 4 else []) + shown[-2:]), flush=True)
    if returncode != 0 or len(rows) < expected_rows(args, flags):
        tail = "\n".join(log.splitlines()[-40:])
        print(f"[{name}] failed (rc {returncode}, {len(rows)} iterations logged):\n{tail}", flush=True)
        return {"run": name, "error": tail, "iterations": rows}
    if not rows:  # (a run that loads and trains nothing)
        return {"run": name, "iterations": rows}
    clips = CLIP_SUMMARY.search(log)
    steady = [r["ms"] for r in rows[len(rows) // 2:]]
    return {"run": name, "iterations": rows, "median_ms": statistics.median(steady),
            "median_tflops": statistics.median([r["tflops"] for r in rows[len(rows) // 2:] if r["tflops"]] or [0]),
            "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
            "skipped": sum(int(r["skipped"] or 0) for r in rows), "nan": sum(int(r["nan"] or 0) for r in rows),
            **({"qk_clip": json.loads(clips.group(1))} if clips else {})}


def expected_rows(args, flags) -> int:
    """The progress lines a finished run prints: one per --log-interval iterations from --start on (a
    --load run), and Megatron's first iteration's line."""
    interval = int(flags[len(flags) - 1 - flags[::-1].index("--log-interval") + 1]) if "--log-interval" in flags else 1
    trained = range(getattr(args, "start", 0) + 1, args.iters + 1)
    return len([i for i in trained if i % interval == 0 or i == 1])


DEFAULT_RUNS = ["muon", "muon_fp32ns", "dmuon", "dmuon_standard"]
SYRK_RUN, SYRK_MIN_EO = "muon_syrk", (0, 4)
SYRK_RUNS = {name for name, flags in RUNS.items() if "--muon-use-syrk" in flags}
LSM_RUNS = {name for name, flags in RUNS.items() if "--use-layer-sharding-muon" in flags}


def tree_flag_refusal(megatron_lm: str, flag: str, fix: str):
    """Why the Megatron-LM tree cannot run ``flag`` (None: its arguments.py registers it)."""
    arguments = os.path.join(megatron_lm, "megatron", "training", "arguments.py")
    if os.path.isfile(arguments) and f"'{flag}'" in open(arguments).read().replace('"', "'"):
        return None
    return f"the Megatron-LM tree {megatron_lm} has no {flag} ({fix})"


def tree_label(megatron_lm: str) -> str:
    """The tree a row ran on: its git commit (a checkout, or a COMMIT file beside a trimmed copy), else its
    folder's name and megatron-core version."""
    commit_file = os.path.join(megatron_lm, "COMMIT")
    if os.path.isfile(commit_file):
        words = open(commit_file).read().split()
        if words:
            return f"{os.path.basename(megatron_lm)} {words[0][:10]}"
    if os.path.exists(os.path.join(megatron_lm, ".git")):
        done = subprocess.run(["git", "-C", megatron_lm, "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True)
        if done.returncode == 0 and done.stdout.strip():
            return f"{os.path.basename(megatron_lm)} {done.stdout.strip()}"
    info = os.path.join(megatron_lm, "megatron", "core", "package_info.py")
    version = ""
    if os.path.isfile(info):
        found = dict(re.findall(r"^(MAJOR|MINOR|PATCH) *= *(\d+)", open(info).read(), re.M))
        version = " core " + ".".join(found.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))
    return os.path.basename(megatron_lm) + version


def parse_tree_for(parser, specs, runs_known) -> dict:
    """--megatron-lm-for RUN=DIR (repeated) -> {run: absolute DIR}; one usage line for a bad one."""
    out = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"--megatron-lm-for {spec!r}: give RUN=DIR (e.g. muon_lsm=.mlm_pr6683)")
        if name not in runs_known:
            parser.error(f"--megatron-lm-for {spec!r}: no run {name!r}; runs: {', '.join(sorted(runs_known))}")
        if not os.path.isfile(os.path.join(path, "megatron", "training", "arguments.py")):
            parser.error(f"--megatron-lm-for {spec!r}: {path} is not a Megatron-LM tree (no "
                         "megatron/training/arguments.py); give a checkout or a trimmed copy (docs/megatron_lm.md §1)")
        out[name] = os.path.abspath(path)
    return out


def emerging_optimizers_version():
    """The Emerging-Optimizers release Megatron's Muon imports in the runs (they inherit this
    process's path; the tree holds none), or None."""
    try:
        import emerging_optimizers
    except ImportError:
        return None
    return str(getattr(emerging_optimizers, "__version__", "unknown"))


def syrk_refusal(version, megatron_lm: str):
    """Why Megatron's Muon cannot run --muon-use-syrk here (None: it can): Megatron-LM refuses it
    below Emerging-Optimizers 0.4.0, and a tree without the flag (core_v0.19.0) would ignore it."""
    try:
        new_enough = tuple(int(p) for p in version.split(".")[:2]) >= SYRK_MIN_EO
    except (AttributeError, ValueError):
        new_enough = False
    if not new_enough:
        return (f"Megatron's --muon-use-syrk needs Emerging-Optimizers >= 0.4.0 and this process imports "
                f"{version or 'none'} (0.4.0 installs from tag v0.4.0 of NVIDIA-NeMo/Emerging-Optimizers)")
    return tree_flag_refusal(megatron_lm, "--muon-use-syrk", "Megatron-LM main has")


def loss_gap(a: dict, b: dict) -> dict:
    pairs = [(x["loss"], y["loss"]) for x, y in zip(a["iterations"], b["iterations"])
             if x["loss"] is not None and y["loss"] is not None]
    return {"max_abs": max(abs(x - y) for x, y in pairs), "last_abs": abs(pairs[-1][0] - pairs[-1][1])}


DEFAULT_SEED = int(COMMON[COMMON.index("--seed") + 1])


def run_all(args, megatron_lm, trees=None) -> dict:
    """Every (seed, run), ``args.jobs`` at a time, each on ``trees[name]`` (default ``megatron_lm``):
    {seed: {name: result}}; logs ``name`` or ``name_s<seed>``."""
    trees = trees or {}

    def one(task):
        seed, name = task
        label = name if len(args.seeds) == 1 else f"{name}_s{seed}"
        return task, run(name, args, trees.get(name, megatron_lm), args.out, label=label,
                         more=() if seed == DEFAULT_SEED else ("--seed", str(seed)))

    tasks = [(seed, name) for seed in args.seeds for name in args.runs]
    done = dict(harness.in_parallel(one, tasks, args.jobs))
    return {seed: {name: done[(seed, name)] for name in args.runs} for seed in args.seeds}


def summarize(results: dict, timed: bool, labels=None) -> dict:
    """One seed's rows: speed-up (when ``timed``) and loss gaps against that seed's ``muon``; each row names
    its tree (``labels``: {run: tree label}) and NS path."""
    base = results.get("muon") if "error" not in results.get("muon", {"error": 1}) else None
    rows = {}
    for name, r in results.items():
        row = {k: r.get(k) for k in ("median_ms", "median_tflops", "first_loss", "last_loss", "skipped", "nan", "qk_clip")}
        row["tree"] = (labels or {}).get(name, "")
        row["ns_path"] = NS_PATHS.get(name, "")
        if "error" in r:
            row["error"] = True
        elif base is not None and name != "muon":
            row["loss_gap_to_muon"] = loss_gap(r, base)
            if timed:
                row["speedup_vs_muon"] = base["median_ms"] / r["median_ms"]
        rows[name] = row
    return rows


EXACT_RUN = "dmuon_fp32ns"  # DMuon's NS in full fp32: the curve nearest exact arithmetic the bench has


def gaps_to(by_seed: dict, reference: str) -> dict:
    """Per run, its max loss gap to ``reference`` at each seed ({seed: {run: result}}): to Megatron's
    bf16 ``muon`` (the band), and to the most exact curve (``EXACT_RUN``)."""
    out = {}
    for seed, runs in by_seed.items():
        if reference not in runs or "error" in runs[reference]:
            continue
        for name, r in runs.items():
            if name != reference and "error" not in r:
                out.setdefault(name, {})[str(seed)] = loss_gap(r, runs[reference])["max_abs"]
    return out


def band_over_seeds(by_seed: dict) -> dict:
    """Per run ({seed: {run: result}}): its max loss gap to ``muon`` at each seed, and at how many seeds
    it is within that seed's noise band (``muon_fp32ns``'s gap)."""
    gaps = gaps_to(by_seed, "muon")
    band = gaps.get("muon_fp32ns", {})
    return {name: {"max_abs_by_seed": per, "max_abs": max(per.values()), "mean_max_abs": statistics.mean(per.values()),
                   "within_band_seeds": sum(int(seed in band and gap <= band[seed]) for seed, gap in per.items())}
            for name, per in gaps.items()}


def table_rows(rows: dict, timed: bool, label: str = "") -> list:
    out = []
    for name, row in rows.items():
        where = f" {row.get('tree', '')} | {row.get('ns_path', '')} |"
        if row.get("error"):
            out.append(f"| {label}{name} | failed | | | | | | | |{where}")
            continue
        gap = row.get("loss_gap_to_muon") or {}
        speed = (f"{row['median_ms']:.1f} | {row['median_tflops']:.1f} | {row.get('speedup_vs_muon', 1.0):.3f}"
                 if timed else "— | — | —")
        out.append(f"| {label}{name} | {speed} | {row['first_loss']:.4f} | {row['last_loss']:.4f} | "
                   f"{gap.get('max_abs', 0.0):.4f} | {gap.get('last_abs', 0.0):.4f} | {row['skipped']} / {row['nan']} |{where}")
    return out


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-lm", default=os.path.join(ROOT, ".mlm"), help="Megatron-LM checkout (core_v0.19.0)")
    p.add_argument("--megatron-lm-for", action="append", default=[], metavar="RUN=DIR",
                   help="run RUN on the Megatron-LM tree DIR instead (repeatable; e.g. muon_lsm=.mlm_pr6683)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs (data-parallel ranks)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--model", default="qwen7b-4l", choices=sorted(MODELS))
    p.add_argument("--runs", nargs="+", default=None, choices=sorted(RUNS),
                   help=f"default: {' '.join(DEFAULT_RUNS)}, and {SYRK_RUN} where Megatron's Muon can run --muon-use-syrk")
    p.add_argument("--seeds", nargs="+", type=int, default=[DEFAULT_SEED],
                   help="every run once per seed (--seed: init and mock data); the band becomes a spread over seeds")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at once on the GPU(s): > 1 compares loss curves only (no times reported)")
    p.add_argument("--timeout", type=int, default=200, help="seconds per run")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the JSON, table and logs")
    p.add_argument("--qk-clip", type=float, default=None, metavar="T",
                   help="every run with --qk-clip --qk-clip-threshold T (max logits from the local attention)")
    p.add_argument("--transformer-impl", choices=["auto", "transformer_engine", "local"], default="auto",
                   help="Megatron-LM's layers: TE (its default; 'auto' where transformer_engine imports) or local")
    p.add_argument("--fp8-format", choices=["hybrid", "e4m3"], default=None, help="FP8 training through TE")
    p.add_argument("--fp8-recipe", choices=["delayed", "tensorwise"], default="delayed")
    p.add_argument("--fp8-param-gather", action="store_true", help="TE FP8 params (the param all-gather moves FP8)")
    p.add_argument("--gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_true",
                   default=None, help="Megatron-LM's default with TE; needs Apex's fused_weight_gradient_mlp_cuda "
                   "(default: on where it imports)")
    p.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more Megatron-LM flags for every run")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    resolve_layers(args)
    timed = args.jobs == 1
    megatron_lm = os.path.abspath(args.megatron_lm)
    trees = parse_tree_for(p, args.megatron_lm_for, RUNS)
    eo_version = emerging_optimizers_version()
    no_syrk = syrk_refusal(eo_version, trees.get(SYRK_RUN, megatron_lm))
    if args.runs is None:
        args.runs = DEFAULT_RUNS + ([SYRK_RUN] if no_syrk is None else [])
    for name in args.runs:
        tree = trees.get(name, megatron_lm)
        why = (syrk_refusal(eo_version, tree) if name in SYRK_RUNS else None) or (
            tree_flag_refusal(tree, "--use-layer-sharding-muon", f"Megatron-LM PR #6683 has: --megatron-lm-for {name}="
                              ".mlm_pr6683, docs/megatron_lm.md §1") if name in LSM_RUNS else None)
        if why:
            p.error(f"--runs {name}: {why}")
    unknown = sorted(set(trees) - set(args.runs))
    if unknown:
        p.error(f"--megatron-lm-for names {', '.join(unknown)}, not among --runs ({' '.join(args.runs)})")
    for name, tree in dict.fromkeys([megatron_lm, *trees.values()], None).items():
        flag = "--megatron-lm" if name == megatron_lm else "--megatron-lm-for"
        patch_megatron_lm_tree(p, flag, name, subprocess.run)
    labels = {name: tree_label(trees.get(name, megatron_lm)) for name in args.runs}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    by_seed = run_all(args, megatron_lm, trees)
    rows_by_seed = {seed: summarize(results, timed, labels) for seed, results in by_seed.items()}
    summary = {"model": args.model, "gpus": args.nproc, "iters": args.iters, "qk_clip_threshold": args.qk_clip,
               "jobs": args.jobs, "timed": timed, "transformer_impl": args.transformer_impl,
               "fp8_format": args.fp8_format, "fp8_recipe": args.fp8_recipe if args.fp8_format else None,
               "fp8_param_gather": args.fp8_param_gather,
               "gradient_accumulation_fusion": args.gradient_accumulation_fusion, "layers": precision_label(args),
               "emerging_optimizers": eo_version, "trees": labels}
    if len(args.seeds) == 1:
        (seed,) = args.seeds
        summary["seed"] = seed
        summary["runs"] = rows_by_seed[seed]
        iterations = {k: v["iterations"] for k, v in by_seed[seed].items()}
    else:
        summary["seeds"] = args.seeds
        summary["runs_by_seed"] = {str(s): rows for s, rows in rows_by_seed.items()}
        summary["band_over_seeds"] = band_over_seeds(by_seed)
        if EXACT_RUN in args.runs:
            summary["gap_to_exact_by_seed"] = gaps_to(by_seed, EXACT_RUN)
        iterations = {f"{k}_s{s}": v["iterations"] for s, results in by_seed.items() for k, v in results.items()}
    print(json.dumps({"summary": summary, "iterations": iterations}))
    table = [f"{args.model}, {precision_label(args)}, {args.nproc} GPU(s), {args.iters} iterations; NS paths: "
             "muon = Megatron's bf16 standard NS (medium), dmuon = DMuon's defaults (auto: Gram fp16 for wide "
             "matrices, standard bf16 for square), *_fp32ns = fp32 NS, dmuon_standard = DMuon's standard bf16 NS; "
             f"Megatron's Muon rows (muon*): Emerging-Optimizers {eo_version or 'not importable'}, without "
             f"--muon-use-syrk except {', '.join(sorted(SYRK_RUNS))}", "",
             "| run | ms/iter (median, 2nd half) | TFLOP/s/GPU | speed-up vs muon | first loss | last loss | "
             "max abs loss gap to muon | last-iteration gap | skipped / nan | tree | NS path |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for seed, rows in rows_by_seed.items():
        table += table_rows(rows, timed, "" if len(args.seeds) == 1 else f"seed {seed}: ")
    if args.qk_clip:
        table += ["", f"--qk-clip --qk-clip-threshold {args.qk_clip} (max logits recorded by the local attention, "
                  "megatron_dmuon.testing.local_max_logits):"]
        for seed, rows in rows_by_seed.items():
            table += [f"- {'' if len(args.seeds) == 1 else f'seed {seed}, '}{name}: {row['qk_clip']['clipped_calls']} of "
                      f"{row['qk_clip']['clip_qk_calls']} clip_qk calls clipped, max logit "
                      f"{row['qk_clip']['first_step_max_logit']:.1f} (first step) / {row['qk_clip']['max_logit']:.1f} "
                      f"(max) / {row['qk_clip']['last_step_max_logit']:.1f} (last)"
                      for name, row in rows.items() if row.get("qk_clip")]
    verdict = []
    if len(args.seeds) == 1:
        runs = summary["runs"]
        noise = runs.get("muon_fp32ns", {}).get("loss_gap_to_muon")
        gap = runs.get("dmuon", {}).get("loss_gap_to_muon")
        if noise and gap:
            speed = f"; dmuon {runs['dmuon']['speedup_vs_muon']:.2f}x muon's iteration speed" if timed else ""
            verdict.append(f"dmuon vs muon: max loss gap {gap['max_abs']:.4f} (bf16 noise band, muon fp32-NS vs "
                           f"bf16-NS: {noise['max_abs']:.4f}){speed}")
        if timed and all(k in runs and not runs[k].get("error") for k in ("adam", "dmuon")):
            over = runs["dmuon"]["median_ms"] / runs["adam"]["median_ms"] - 1.0
            verdict.append(f"dmuon vs Megatron's AdamW ({'TE FusedAdam' if args.transformer_impl != 'local' else 'its Adam'}): "
                           f"{runs['dmuon']['median_ms']:.1f} vs {runs['adam']['median_ms']:.1f} ms/iteration "
                           f"({over:+.1%})")
    else:
        verdict += ["| run | max loss gap to muon, per seed | largest | mean | within the seed's band |",
                    "|---|---|---:|---:|---:|"]
        for name, b in summary["band_over_seeds"].items():
            per = ", ".join(f"{g:.4f}" for g in b["max_abs_by_seed"].values())
            verdict.append(f"| {name}{' (band)' if name == 'muon_fp32ns' else ''} | {per} | {b['max_abs']:.4f} | "
                           f"{b['mean_max_abs']:.4f} | {b['within_band_seeds']} / {len(b['max_abs_by_seed'])} |")
        if "gap_to_exact_by_seed" in summary:
            verdict += ["", f"| run | max loss gap to {EXACT_RUN} (fp32 NS), per seed | largest |", "|---|---|---:|"]
            verdict += [f"| {name} | {', '.join(f'{g:.4f}' for g in per.values())} | {max(per.values()):.4f} |"
                        for name, per in summary["gap_to_exact_by_seed"].items()]
    text = "\n".join(table + [""] + verdict)
    print("\n" + text, flush=True)
    if args.out:
        with open(os.path.join(args.out, "megatron_lm_compare.json"), "w") as f:
            json.dump({"summary": summary, "iterations": iterations,
                       "flags": {"model": MODELS[args.model], "common": COMMON + layer_flags(args), "runs": RUNS,
                                 "extra": args.extra, "trees": {n: trees.get(n, megatron_lm) for n in args.runs}}},
                      f, indent=1)
        with open(os.path.join(args.out, "megatron_lm_compare.md"), "w") as f:
            f.write(text + "\n")
    ok = all("error" not in r for results in by_seed.values() for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
