"""Real NS inputs from a training run, and every NS path measured on them.

    python bench/momentum_spectra.py record --out DIR --at 50 200 400 -- [main-job flags]
    python bench/momentum_spectra.py evaluate DIR/ns_inputs_it*.pt [--device cuda]

``record`` runs the main job (bench/harness.py's, one rank, in this process) and watches its
owner step: every step, per shape group, the largest singular value of each NS output (the
probe estimate ``algorithms.ns_metrics.orthogonality_overshoot``); every ``--exact-every`` steps
the distance of each output to the float32 standard NS of the same schedule; at the ``--at``
iterations the NS inputs themselves (the Nesterov momenta, ``--keep`` matrices per shape group,
float32) are saved. It writes DIR/trace.json (+ the main job's timing JSON) and DIR/ns_inputs_itN.pt.

``evaluate`` runs every NS path on saved inputs against the float64 polar factor and against the
exact-arithmetic result of each path's own schedule (``newton_schulz_reference``); it prints JSON
and a markdown table: relative error and the largest singular value of each result.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import main_job_module  # noqa: E402  (it puts the repository on the path too)
from cli_inputs import OneLineParser, check_device, without_fix  # noqa: E402
from megatron_dmuon.files import check_regular_file  # noqa: E402


def _stack_label(plan, g) -> str:
    m, n, _ = plan.groups[g]
    return f"{m}x{n}"


def install_recorder(out_dir: str, at: set, keep: int, exact_every: int) -> dict:
    """Wrap OwnerMuonAdamW._check_outputs (once per step without --dmuon-overlap-step); returns the trace being filled."""
    from megatron_dmuon.algorithms.ns_metrics import orthogonality_overshoot
    from megatron_dmuon.runtime.owner_step import OwnerMuonAdamW

    original = OwnerMuonAdamW._check_outputs
    trace = {"steps": []}

    def recording(self, plan, outputs, stacks, *args, **kwargs):
        outputs = original(self, plan, outputs, stacks, *args, **kwargs)
        step = len(trace["steps"]) + 1
        row = {"step": step, "groups": {}}
        exact = step % exact_every == 0 or step in at
        for g, (x, o) in enumerate(zip(stacks, outputs)):
            over = orthogonality_overshoot(o, probes=2, iterations=12)
            entry = {"sigma_max": [float(v) ** 0.5 if v > -1 else 0.0 for v in (over + 1).clamp(min=0).tolist()]}
            if exact:
                reference = self._fp32_orthogonalizer(x)
                err = (o.float() - reference).flatten(1).norm(dim=1) / reference.flatten(1).norm(dim=1).clamp(min=1e-30)
                entry["error_vs_fp32"] = err.tolist()
            row["groups"][_stack_label(plan, g)] = entry
        trace["steps"].append(row)
        if step in at:
            saved = {_stack_label(plan, g): x[:keep].detach().float().cpu() for g, x in enumerate(stacks)}
            torch.save({"step": step, "inputs": {k: v.clone() for k, v in saved.items()}, "settings": repr(self.muon)},
                       os.path.join(out_dir, f"ns_inputs_it{step}.pt"))
        return outputs

    OwnerMuonAdamW._check_outputs = recording
    return trace


def record(args, job_argv) -> None:
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    trace = install_recorder(args.out, set(args.at), args.keep, args.exact_every)
    pretrain_gpt = main_job_module()

    timing = os.path.join(args.out, "timing.json")
    try:
        pretrain_gpt.main([*job_argv, "--timing-json", timing])
    finally:
        with open(os.path.join(args.out, "trace.json"), "w") as f:
            json.dump(trace, f)
    worst = max(((max(e["sigma_max"]), r["step"], k) for r in trace["steps"] for k, e in r["groups"].items()),
                default=None)
    print(json.dumps({"steps": len(trace["steps"]), "largest_sigma_max": worst}))


def ns_paths(shape):
    """(label, callable) of every NS path the optimizer offers, for a [B, m, n] stack."""
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.algorithms.newton_schulz import newton_schulz
    from megatron_dmuon.algorithms.schedules import schedule_for_shape

    adaptive = schedule_for_shape(shape[-2], shape[-1])
    paths = [
        ("standard bf16, you (default)", lambda x: newton_schulz(x, "you", 5, compute_dtype=torch.bfloat16)),
        ("standard fp32, you (exact)", lambda x: newton_schulz(x, "you", 5, compute_dtype=torch.float32)),
        ("gram fp16, you, restart 2", lambda x: gram_newton_schulz(x, "you", 5, compute_dtype=torch.float16)),
        ("gram bf16, you, restart 2", lambda x: gram_newton_schulz(x, "you", 5, compute_dtype=torch.bfloat16)),
        ("gram bf16, adaptive, no restart", lambda x: gram_newton_schulz(
            x, compute_dtype=torch.bfloat16, restart_after=(), **adaptive)),
        ("standard bf16, adaptive", lambda x: newton_schulz(x, compute_dtype=torch.bfloat16, **adaptive)),
        ("gram fp16, adaptive, no restart", lambda x: gram_newton_schulz(
            x, compute_dtype=torch.float16, restart_after=(), **adaptive)),
        ("gram fp16, adaptive, restart 2", lambda x: gram_newton_schulz(
            x, compute_dtype=torch.float16, restart_after=(2,), **adaptive)),
    ]
    try:
        from megatron_dmuon.kernels import orthogonalize_batched

        if torch.cuda.is_available():
            paths += [
                ("kernels gram fp16, adaptive, no restart", lambda x: orthogonalize_batched(
                    x, method="gram", compute_dtype=torch.float16, restart_after=(), **adaptive)),
                ("kernels gram fp16, adaptive, default restarts", lambda x: orthogonalize_batched(
                    x, method="gram", compute_dtype=torch.float16, **adaptive)),
                ("kernels standard bf16, adaptive", lambda x: orthogonalize_batched(
                    x, method="standard", compute_dtype=torch.bfloat16, **adaptive)),
                ("kernels auto, adaptive", lambda x: orthogonalize_batched(x, method="auto", **adaptive)),
            ]
    except ImportError:
        pass
    return paths


def _recorded_inputs(parser, path: str) -> dict:
    """A file ``record`` wrote (``{"inputs": {label: tensor}}``); a usage error naming it otherwise."""
    kind = "a file momentum_spectra.py record wrote (--out)"
    try:
        check_regular_file(path, "evaluate:", limit=1 << 36)
        doc = torch.load(path, map_location="cpu", weights_only=True)  # data only, whoever wrote it
    except ValueError as e:
        parser.error(f"{without_fix(str(e))}; give {kind}")
    except Exception as e:  # noqa: BLE001 - not a torch file, or one holding more than tensors
        why = "it is no torch file, or holds objects other than tensors (never unpickled here)" \
            if isinstance(e, pickle.UnpicklingError) else f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        parser.error(f"evaluate: {path} does not load as a torch file of tensors ({why}); give {kind}")
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(inputs, dict) or not inputs or not all(
            isinstance(x, torch.Tensor) and x.dim() >= 2 for x in inputs.values()):
        parser.error(f"evaluate: {path} holds no 'inputs' of matrices; give {kind}")
    return doc


def evaluate(args) -> None:
    from megatron_dmuon.algorithms.newton_schulz import msgn_svd

    rows = []
    for path, doc in zip(args.files, args.docs):  # (read and checked by main)
        for label, x in doc["inputs"].items():
            x = x.to(args.device)
            polar = msgn_svd(x)
            for name, fn in ns_paths(tuple(x.shape)):
                o = fn(x).double()
                err = ((o - polar).flatten(1).norm(dim=1) / polar.flatten(1).norm(dim=1)).max()
                finite = bool(torch.isfinite(o).all())
                sigma = torch.linalg.matrix_norm(o, ord=2).max() if finite else torch.tensor(float("inf"))
                rows.append({"file": os.path.basename(path), "shape": label, "path": name,
                             "error_vs_polar": float(err), "sigma_max": float(sigma)})
    print(json.dumps(rows, indent=1))
    print("\n| input | shape | NS path | max error vs polar | max sigma_max |\n|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['file']} | {r['shape']} | {r['path']} | {r['error_vs_polar']:.4f} | {r['sigma_max']:.3f} |")


def main():
    argv = sys.argv[1:]
    job_argv = []
    if "--" in argv:
        argv, job_argv = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", required=True)
    r.add_argument("--at", type=int, nargs="+", default=[50, 200])
    r.add_argument("--keep", type=int, default=2, help="matrices saved per shape group")
    r.add_argument("--exact-every", type=int, default=10)
    e = sub.add_parser("evaluate")
    e.add_argument("files", nargs="+")
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.command == "evaluate":
        check_device(p, args.device)
        args.docs = [_recorded_inputs(p, path) for path in args.files]
    record(args, job_argv) if args.command == "record" else evaluate(args)


if __name__ == "__main__":
    main()
