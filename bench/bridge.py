"""DMuon against Megatron-Bridge's own Muon inside Bridge's own train loop (``pretrain``, mock data).

    torchrun --nproc-per-node 1 bench/bridge.py run --optimizer dmuon --model small --iters 30 --out run.json
    python bench/bridge.py compare --out-dir /tmp/bridge        # the H200 driver: every stage below

``run``: one Bridge run. The model is a GPTModelProvider (TE layers where Transformer Engine imports).
The optimizer is chosen as a Bridge user chooses it:
- ``muon``: Bridge's ``distributed_muon_with_cosine_annealing``, its LayerWise Muon, with DDP settings
  as its Kimi-K2 recipe sets them;
- ``dmuon``: the same call with DMuon's ``dmuon_with_cosine_annealing`` and ``use_dmuon``;
- ``adam``: Bridge's ``distributed_fused_adam_with_cosine_annealing``.

A callback records every iteration's loss (full precision), grad norm and ms (between device
syncs), and at the end a SHA-256 of the model's params. ``--save/--load`` use Bridge's own
checkpointing (torch_dist).

``compare`` stages (one H200):
- ``sanity``: 3 DMuon iterations;
- ``timing``: Qwen2.5-7B-shaped 4 layers, one run at a time, muon / dmuon / adam;
- ``band``: small dense and small MoE over 3 seeds, several runs at once;
- ``resume``: a DMuon run saved at iteration 10 and resumed to 20 against the same run unbroken,
  bit for bit.

It writes ``bridge.json`` and ``bridge.md``. Every run goes through bench/harness.py (torchrun, one rank; a
transient failure such as out of memory among the band's concurrent runs is tried once more).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import ROOT, Job, in_parallel  # noqa: E402  (bench/harness.py, the one runner; it puts ROOT on the path)
import harness  # noqa: E402
from cli_inputs import OneLineParser  # noqa: E402  (one-line usage errors, exit 2)

if os.environ.get("BRIDGE_LITE"):  # an image without diffusers: megatron.bridge registered without its
    # __init__ (which imports every HF/diffusion model bridge); the training path imports as usual
    from megatron_dmuon.testing.bridge_imports import without_model_bridges  # noqa: E402

    without_model_bridges()
MODELS = {
    # Qwen2.5-7B-shaped layers (the Megatron-LM comparisons' shape), GBS 4
    "qwen4l": dict(num_layers=4, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
                   seq_length=4096, vocab_size=32000, micro_batch_size=1, global_batch_size=4),
    "small": dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16, num_query_groups=4,
                  seq_length=1024, vocab_size=32000, micro_batch_size=4, global_batch_size=16),
    # the small model with 8 experts (top-2, grouped GEMM) in every layer: a DeepSeek/Kimi-like MoE cut down
    "small_moe": dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16, num_query_groups=4,
                      seq_length=1024, vocab_size=32000, micro_batch_size=4, global_batch_size=16,
                      num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=704),
}


def build_config(args):
    """The ConfigContainer of one run, as a Bridge user writes it."""
    import torch
    import torch.nn.functional as F
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.recipes.utils.optimizer_utils import (distributed_fused_adam_with_cosine_annealing,
                                                               distributed_muon_with_cosine_annealing)
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedDataParallelConfig,
                                                 DistributedInitConfig, GPTDatasetConfig, LoggerConfig, RNGConfig,
                                                 TokenizerConfig, TrainingConfig, ValidationConfig)

    shape = dict(MODELS[args.model])
    mbs, gbs = shape.pop("micro_batch_size"), shape.pop("global_batch_size")
    moe = {}
    if "num_moe_experts" in shape:
        moe = dict(num_moe_experts=shape.pop("num_moe_experts"), moe_router_topk=shape.pop("moe_router_topk"),
                   moe_ffn_hidden_size=shape.pop("moe_ffn_hidden_size"), moe_grouped_gemm=True,
                   moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                   moe_aux_loss_coeff=1e-2)
    model = GPTModelProvider(**shape, **moe, make_vocab_size_divisible_by=128, normalization="RMSNorm",
                             gated_linear_unit=True, activation_func=F.silu, position_embedding_type="rope",
                             add_bias_linear=False, share_embeddings_and_output_weights=False, hidden_dropout=0.0,
                             attention_dropout=0.0, init_method_std=0.02, bf16=True, params_dtype=torch.bfloat16)
    schedule = dict(precision="bf16-mixed", lr_warmup_iters=max(1, args.iters // 10), lr_decay_iters=args.iters,
                    max_lr=args.lr, min_lr=args.lr / 10)
    muon = dict(muon_momentum=0.95, muon_use_nesterov=True, muon_scale_mode="spectral", muon_extra_scale_factor=0.2,
                muon_tp_mode="duplicated")
    if args.optimizer == "adam":
        opt, sched = distributed_fused_adam_with_cosine_annealing(**schedule)
    else:
        opt, sched = distributed_muon_with_cosine_annealing(**schedule, **muon)
    muon_layerwise = args.optimizer == "muon"  # Bridge's Kimi-K2 recipe: no distributed optimizer under its Muon
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=args.iters, global_batch_size=gbs, micro_batch_size=mbs),
        validation=ValidationConfig(eval_interval=10 ** 6, eval_iters=0),
        optimizer=opt, scheduler=sched,
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=not muon_layerwise, overlap_grad_reduce=True,
                                          overlap_param_gather=not muon_layerwise, grad_reduce_in_fp32=True),
        dataset=GPTDatasetConfig(random_seed=args.seed, seq_length=model.seq_length, blend=None, blend_per_split=None,
                                 split="9999,8,2", dataloader_type="single", reset_position_ids=False,
                                 reset_attention_mask=False, eod_mask_loss=False, num_workers=1),
        logger=LoggerConfig(log_interval=args.log_interval),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=model.vocab_size),
        checkpoint=CheckpointConfig(save=args.save, save_interval=args.save_interval, load=args.load,
                                    ckpt_step=args.ckpt_step, ckpt_format="torch_dist"),
        rng=RNGConfig(seed=args.seed),
        dist=DistributedInitConfig(),
        mixed_precision="bf16_mixed",
    )
    if args.optimizer == "dmuon":
        from megatron_dmuon.bridge import use_dmuon

        use_dmuon(cfg, **dict(o.split("=", 1) for o in args.dmuon_option))
    return cfg


def recorder(out_path: str):
    """A Bridge callback: per-iteration loss/grad norm/ms, then the params' SHA-256, into ``out_path``."""
    import torch
    from megatron.bridge.training.callbacks import Callback

    class Record(Callback):
        def __init__(self):
            self.rows, self.t0 = [], None

        def on_train_step_start(self, context):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_step_end(self, context):
            torch.cuda.synchronize()
            ms = (time.perf_counter() - self.t0) * 1e3
            losses = {k: (v.double().tolist() if torch.is_tensor(v) else v) for k, v in (context.loss_dict or {}).items()}
            self.rows.append({"iteration": context.state.train_state.step, "ms": ms, "loss": losses,
                              "grad_norm": None if context.grad_norm is None else float(context.grad_norm),
                              "skipped": bool(context.skipped_iter)})

        def on_train_end(self, context):
            for chunk in context.model:  # the last step's params, published (overlapped param gather)
                ddp = getattr(chunk, "ddp_config", None)
                if ddp is not None and (ddp.use_distributed_optimizer or ddp.overlap_param_gather):
                    chunk.start_param_sync(force_sync=True)
            torch.cuda.synchronize()
            digest = hashlib.sha256()
            for chunk in context.model:
                for name, p in sorted(chunk.named_parameters()):
                    digest.update(name.encode())
                    digest.update(p.detach().float().cpu().numpy().tobytes())
            if torch.distributed.get_rank() == 0:
                with open(out_path, "w") as f:
                    json.dump({"rows": self.rows, "params_sha256": digest.hexdigest(),
                               "optimizer": type(context.optimizer).__name__}, f)

    return Record()


def run(args) -> None:
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    cfg = build_config(args)
    if args.dry:
        print(f"> config built: optimizer {type(cfg.optimizer).__name__}({cfg.optimizer.optimizer}), "
              f"ddp.use_distributed_optimizer={cfg.ddp.use_distributed_optimizer}", flush=True)
        return
    pretrain(cfg, forward_step, callbacks=[recorder(args.out)])


# ---------------------------------------------------------------- the driver (compare)

def one(out_dir: str, name: str, extra: list, timeout: int = 900) -> dict:
    """One ``run`` under torchrun (bench/harness.py's ``run``): its JSON, or the error (the log's tail)."""
    out = os.path.join(out_dir, f"{name}.json")
    log = os.path.join(out_dir, f"{name}.log")
    job = Job(["run", "--out", out, *extra], program=[os.path.abspath(__file__)], nproc=1, timeout=timeout, log=log,
              env={"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    r = harness.run(job)
    if not r["ok"] or not os.path.exists(out):
        tail = r["output"][-2500:]
        print(f"[{name}] failed (rc {r['returncode']}):\n{tail}", flush=True)
        return {"name": name, "error": tail}
    with open(out) as f:
        doc = json.load(f)
    doc.update(name=name, wall_s=r["wall_s"])
    return doc


def lm_loss(row) -> float:
    v = row["loss"].get("lm loss")
    return v[0] / v[1] if isinstance(v, list) and len(v) == 2 else (v[0] if isinstance(v, list) else v)


def steady_ms(doc) -> float:
    rows = doc["rows"]
    return statistics.median(r["ms"] for r in rows[len(rows) // 2:])


def compare(args) -> None:
    """The stages in the order given; each writes bridge.json/bridge.md as it ends (a deadline keeps
    what finished). A failed sanity stage stops the rest."""
    os.makedirs(args.out_dir, exist_ok=True)
    results, lines = {}, []

    def log(text):
        print(text, flush=True)
        lines.append(text)

    for stage in args.stages:
        ok = STAGES[stage](args, results, log)
        _write(args, results, lines)
        if not ok:
            break


def stage_sanity(args, results, log) -> bool:
    r = results["sanity"] = one(args.out_dir, "sanity_dmuon", ["--optimizer", "dmuon", "--model", "small", "--iters", "3"])
    if "error" in r:
        log("sanity failed: stopping")
        return False
    log(f"sanity: {r['optimizer']}, losses {[round(lm_loss(x), 4) for x in r['rows']]}")
    return True


def stage_timing(args, results, log) -> bool:
    rows = results["timing"] = {opt: one(args.out_dir, f"timing_{opt}", [
        "--optimizer", opt, "--model", "qwen4l", "--iters", str(args.timing_iters), "--lr", "3e-4"])
        for opt in args.timing_optimizers}
    base = steady_ms(rows["adam"]) if "error" not in rows.get("adam", {"error": 1}) else None
    log("\n| optimizer (Bridge, qwen4l, TE) | ms/iteration | vs AdamW | last loss |\n|---|---:|---:|---:|")
    for opt, r in rows.items():
        if "error" in r:
            log(f"| {opt} | failed | | |")
        else:
            ms = steady_ms(r)
            log(f"| {opt} ({r['optimizer']}) | {ms:.1f} | {ms / base if base else float('nan'):.3f} | "
                f"{lm_loss(r['rows'][-1]):.4f} |")
    return True


def stage_band(args, results, log) -> bool:
    jobs = [(model, opt, seed) for model in args.band_models for opt in ("muon", "dmuon") for seed in (1, 2, 3)]
    band = dict(zip(jobs, in_parallel(lambda j: one(args.out_dir, f"band_{j[0]}_{j[1]}_s{j[2]}", [
        "--optimizer", j[1], "--model", j[0], "--iters", str(args.band_iters), "--seed", str(j[2]),
        "--lr", "2e-3"]), jobs, jobs=args.jobs)))
    results["band"] = {f"{m}/{o}/{s}": r for (m, o, s), r in band.items()}
    log("\n| model | optimizer | final loss, seeds 1 / 2 / 3 (mean of the last 5 iterations) | mean |\n|---|---|---|---:|")
    for model in args.band_models:
        for opt in ("muon", "dmuon"):
            finals = [None if "error" in band[(model, opt, seed)] else
                      statistics.mean(lm_loss(x) for x in band[(model, opt, seed)]["rows"][-5:]) for seed in (1, 2, 3)]
            ok = [f for f in finals if f is not None]
            log(f"| {model} | {opt} | {' / '.join('failed' if f is None else f'{f:.4f}' for f in finals)} | "
                f"{statistics.mean(ok) if ok else float('nan'):.4f} |")
    return True


def stage_resume(args, results, log) -> bool:
    ck = os.path.join(args.out_dir, "ckpt")
    base = ["--optimizer", "dmuon", "--model", "small", "--iters", "20", "--seed", "7", "--lr", "2e-3"]
    whole = one(args.out_dir, "resume_whole", [*base, "--save", ck, "--save-interval", "10"])
    resumed = one(args.out_dir, "resume_from10", [*base, "--load", ck, "--ckpt-step", "10"])
    results["resume"] = {"whole": whole, "resumed": resumed}
    if "error" in whole or "error" in resumed:
        log("resume: a run failed")
        return True
    a = {r["iteration"]: r["loss"] for r in whole["rows"]}
    b = {r["iteration"]: r["loss"] for r in resumed["rows"]}
    log(f"\nresume (DMuon, Bridge's torch_dist checkpoint at 10, resumed to 20): iterations {min(b)}..{max(b)}; "
        f"losses identical: {all(a.get(i) == b[i] for i in b)}; params SHA-256 identical: "
        f"{whole['params_sha256'] == resumed['params_sha256']}")
    return True


STAGES = {"sanity": stage_sanity, "timing": stage_timing, "band": stage_band, "resume": stage_resume}


def _write(args, results, lines) -> None:
    with open(os.path.join(args.out_dir, "bridge.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out_dir, "bridge.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--optimizer", choices=("muon", "dmuon", "adam"), required=True)
    r.add_argument("--model", choices=sorted(MODELS), default="small")
    r.add_argument("--iters", type=int, default=30)
    r.add_argument("--seed", type=int, default=1234)
    r.add_argument("--lr", type=float, default=2e-3)
    r.add_argument("--log-interval", type=int, default=1)
    r.add_argument("--save", default=None)
    r.add_argument("--save-interval", type=int, default=None)
    r.add_argument("--load", default=None)
    r.add_argument("--ckpt-step", type=int, default=None, help="load this iteration's checkpoint (not the latest)")
    r.add_argument("--dmuon-option", action="append", default=[], metavar="NAME=VALUE",
                   help="a DMuon option (dmuon_options), e.g. ns_launch=graph")
    r.add_argument("--out", default="bridge_run.json")
    r.add_argument("--dry", action="store_true", help="build the ConfigContainer and stop")
    c = sub.add_parser("compare")
    c.add_argument("--out-dir", default="/tmp/bridge")
    c.add_argument("--stages", nargs="+", default=["sanity", "resume", "timing", "band"], choices=sorted(STAGES))
    c.add_argument("--timing-iters", type=int, default=20)
    c.add_argument("--timing-optimizers", nargs="+", default=["adam", "muon", "dmuon"])
    c.add_argument("--band-iters", type=int, default=40)
    c.add_argument("--band-models", nargs="+", default=["small", "small_moe"], choices=("small", "small_moe"))
    c.add_argument("--jobs", type=int, default=6)
    args = p.parse_args(argv)
    (run if args.command == "run" else compare)(args)


if __name__ == "__main__":
    main()
