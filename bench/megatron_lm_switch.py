"""Switching optimizers in Megatron-LM's own loop (`pretrain_gpt.py`, one node): a run of one
optimizer saves at iteration `--switch-at` (torch_dist, `--dist-ckpt-optim-fully-reshardable`), a
second run of the other optimizer `--load`s it and trains on; compared with the first run, which
never switched. Both directions: `--optimizer muon` (Megatron's LayerWise Muon) -> `dmuon`, and
`dmuon` -> `muon`. The same flags as bench/megatron_lm_compare.py (its RUNS['muon'] and
RUNS['dmuon'] with `--dmuon-ns-method standard`, fp32 NS on both so the two differ by rounding).

Megatron-LM's own log after a `--load` reports, as the second iteration's loss, the mean of the
first two (its log accounting); that value is unfolded before the comparison.

A third run per direction loads and trains nothing (`--train-iters` = the loaded iteration: Megatron
saves again at the end), so the state right after the load is compared with the state saved, tensor
by tensor (masters, Muon momenta, AdamW moments; DMuon's Muon master is `param`, Megatron's
`fp32_param`).

    python bench/megatron_lm_switch.py --megatron-lm .mlm --model small --iters 20 --switch-at 10 --out "$OUT"

Prints (and writes under --out) JSON and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_lm_compare import MODELS, ROOT, run  # noqa: E402
from cli_inputs import OneLineParser, patch_megatron_lm_tree  # noqa: E402  (one-line usage errors, exit 2)

SWITCH_FLAGS = ["--dist-ckpt-optim-fully-reshardable", "--ckpt-format", "torch_dist", "--muon-fp32-matmul-prec", "high"]
NAMES = {"muon": "muon", "dmuon": "dmuon_standard"}  # megatron_lm_compare.RUNS keys


def compare_saved(a: str, b: str) -> dict:
    """Max |difference| per optimizer state kind between two torch_dist checkpoints (same model
    keys; DMuon's and Megatron's master names mapped onto one), and how many tensors matched."""
    import torch
    from megatron.core.dist_checkpointing import load_plain_tensors

    if not torch.distributed.is_initialized():  # the reader wants a (one-process) group
        store = torch.distributed.FileStore(tempfile.mktemp(prefix="dmuon_store_"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)

    def state(path):
        out = {}
        for key, t in load_plain_tensors(path).items():
            if not key.startswith("optimizer.state.") or not isinstance(t, torch.Tensor):
                continue
            kind, name = key[len("optimizer.state."):].split(".", 1)
            out[("param" if kind == "fp32_param" else kind, name)] = t.float()
        return out

    sa, sb = state(a), state(b)
    worst, count = {}, {}
    for key in sorted(set(sa) & set(sb)):
        count[key[0]] = count.get(key[0], 0) + 1
        worst[key[0]] = max(worst.get(key[0], 0.0), float((sa[key] - sb[key]).abs().max()))
    return {"max_abs_by_kind": worst, "tensors_compared": count,
            "only_in_first": len(set(sa) - set(sb)), "only_in_second": len(set(sb) - set(sa))}


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-lm", default=os.path.join(ROOT, ".mlm"))
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--switch-at", type=int, default=10)
    p.add_argument("--directions", nargs="+", default=["muon:dmuon", "dmuon:muon"])
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--state-only", action="store_true",
                   help="only the state check: train to --switch-at, save, load with the other optimizer, save again")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    for direction in args.directions:
        if direction.count(":") != 1 or not all(name in NAMES for name in direction.split(":")):
            p.error(f"--directions {direction}: give FIRST:THEN, each one of {', '.join(sorted(NAMES))}")
    megatron_lm = os.path.abspath(args.megatron_lm)
    patch_megatron_lm_tree(p, "--megatron-lm", megatron_lm, subprocess.run)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="dmuon_switch_")
    base = SimpleNamespace(nproc=1, iters=args.iters, model=args.model, timeout=args.timeout,
                           extra=SWITCH_FLAGS + args.extra, start=0)
    results = {}
    for direction in args.directions:
        first, then = direction.split(":")
        saved, loaded = os.path.join(work, f"{first}_saved"), os.path.join(work, f"{then}_reloaded")
        first_run = SimpleNamespace(**{**vars(base), "iters": args.switch_at}) if args.state_only else base
        never = run(NAMES[first], first_run, megatron_lm, args.out, label=f"{first}_never_switched",
                    more=["--save", saved, "--save-interval", str(args.switch_at)])
        # the run saved at switch-at and at the end: point Megatron's tracker at the switch
        if os.path.isdir(saved):
            with open(os.path.join(saved, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(args.switch_at))
        resumed = None if args.state_only else run(
            NAMES[then], SimpleNamespace(**{**vars(base), "start": args.switch_at}), megatron_lm, args.out,
            label=f"{first}_to_{then}", more=["--load", saved])
        # trains nothing: --train-iters is the loaded iteration; Megatron saves at the end (not a multiple of 7)
        run(NAMES[then], SimpleNamespace(**{**vars(base), "iters": args.switch_at, "start": args.switch_at}),
            megatron_lm, args.out, label=f"{first}_to_{then}_load_only",
            more=["--load", saved, "--save", loaded, "--save-interval", "7",
                  "--override-opt_param-scheduler"])  # (its --train-iters differs; it trains nothing)
        row = {"never_switched_error": "error" in never}
        if resumed is not None:
            row["switched_error"] = "error" in resumed
        if resumed is not None and "error" not in never and "error" not in resumed:
            ref = {r["iteration"]: r["loss"] for r in never["iterations"]}
            logged = {r["iteration"]: r["loss"] for r in resumed["iterations"]}
            # Megatron-LM's first log interval after a --load also averages the iteration before it
            # (at --log-interval 1 the second logged loss is the mean of the first two): compared as such
            second = args.switch_at + 2
            if second in logged and second - 1 in logged:
                logged[second] = 2 * logged[second] - logged[second - 1]
            gaps = [abs(v - ref[i]) for i, v in sorted(logged.items()) if i in ref]
            row.update(first_loss_after_switch=resumed["iterations"][0]["loss"],
                       never_switched_same_iteration=ref.get(resumed["iterations"][0]["iteration"]),
                       max_abs_loss_gap=max(gaps), last_abs_loss_gap=gaps[-1], iterations_compared=len(gaps),
                       ms_never_switched=never["median_ms"], ms_switched=resumed["median_ms"])
        it = f"iter_{args.switch_at:07d}"
        if os.path.isdir(os.path.join(loaded, it)):
            try:
                row["state_after_load_vs_saved"] = compare_saved(os.path.join(saved, it), os.path.join(loaded, it))
            except Exception as e:  # noqa: BLE001 - reported, the loss comparison stands on its own
                row["state_after_load_vs_saved"] = {"error": f"{type(e).__name__}: {e}"}
        results[direction] = row
    print(json.dumps(results, indent=1))
    table = ["| switch | first loss after (never switched) | max abs loss gap | last gap | iterations | "
             "state after load vs saved (max abs: param / momentum / exp_avg / exp_avg_sq) |",
             "|---|---|---:|---:|---:|---|"]
    for direction, row in results.items():
        st = row.get("state_after_load_vs_saved", {}).get("max_abs_by_kind", {})
        kinds = " / ".join(f"{st[k]:.1e}" if k in st else "-" for k in ("param", "momentum_buffer", "exp_avg", "exp_avg_sq"))
        if "max_abs_loss_gap" not in row:
            what = "(state check only)" if args.state_only else "failed"
            table.append(f"| {direction} | {what} | | | | {kinds} |")
            continue
        table.append(f"| {direction} | {row['first_loss_after_switch']:.6f} ({row['never_switched_same_iteration']:.6f}) | "
                     f"{row['max_abs_loss_gap']:.5f} | {row['last_abs_loss_gap']:.5f} | {row['iterations_compared']} | {kinds} |")
    text = "\n".join(table)
    print("\n" + text, flush=True)
    if args.out:
        with open(os.path.join(args.out, "megatron_lm_switch.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "megatron_lm_switch.md"), "w") as f:
            f.write(text + "\n")
    ok = all(("max_abs_by_kind" in r.get("state_after_load_vs_saved", {})) if args.state_only else ("max_abs_loss_gap" in r)
             for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
