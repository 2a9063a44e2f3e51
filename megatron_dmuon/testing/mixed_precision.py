"""Workers of the mixed-precision tests (bf16 masters, bf16 momentum, FP8 publish; gloo ranks).

`train_text` trains the tiny megatron-core GPT on byte-level text (the Python standard library's
source, so the loss has something to learn) and records, besides the usual report, the weights
the forward really used at every step (a forward pre-hook on one Muon matrix's module), the FP8
scales every rank decoded, and the publish bytes counted on the wire.
"""
from __future__ import annotations

import glob
import os
import sysconfig

import torch

WATCHED = "decoder.layers.0.mlp.linear_fc1"  # a Muon matrix whose forward weights are recorded


def _text_tokens() -> torch.Tensor:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]
    data = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def text_batches(tokens, step, dp_rank, grad_accum, mbs, seq):
    """This DP rank's micro-batches of a step: random (seq+1)-byte windows, fixed per (step, rank)."""
    g = torch.Generator().manual_seed(step * 104729 + dp_rank * 1299709)
    out = []
    for _ in range(grad_accum):
        starts = torch.randint(0, tokens.numel() - seq - 1, (mbs,), generator=g)
        out.append(torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()]))
    return out


def train_text(rank, world_size, steps=20, count_bytes=True, **kw):
    """Train ``steps`` on text (``kw`` as workers._build: shape_kw, publish_dtype, overlap, muon_kw,
    ns_dtype, grad_reduce_in_fp32, mode='adam' for Megatron's AdamW); report losses, the forward's
    weights of ``WATCHED`` per step, decoded scales, optimizer state and counted publish bytes."""
    from megatron.core import parallel_state as ps

    from megatron_dmuon.megatron.gpt import train_step
    from megatron_dmuon.testing.workers import _build, _finish_overlap, _report, init_parallel

    init_parallel()
    run = _build(**kw)
    tokens = _text_tokens()
    module = dict(run.ddp.module.named_modules())[WATCHED]
    seen = []

    def record(mod, _inputs):
        if len(seen) < len(losses) + 1:  # the first micro-batch's forward of each step
            seen.append(mod.weight.detach().clone())

    losses, counted = [], {}
    handle = module.register_forward_pre_hook(record)  # after DDP's own hooks: sees the decoded weights
    dp_rank = ps.get_data_parallel_rank()
    for step in range(steps):
        micro = text_batches(tokens, step, dp_rank, run.o["grad_accum"], run.o["mbs"], run.shape.seq_length)
        if count_bytes and step == steps - 1:
            from megatron_dmuon.testing.comm_counter import count_bucket_bytes

            with count_bucket_bytes([run.ddp]) as counts:
                loss, _, _, ok = train_step([run.ddp], run.opt, micro, run.shape.seq_length, run.o["mbs"])
            counted = dict(counts)
        else:
            loss, _, _, ok = train_step([run.ddp], run.opt, micro, run.shape.seq_length, run.o["mbs"])
        assert ok
        run.sched.step(increment=1)
        losses.append(loss)
    handle.remove()
    _finish_overlap(run)
    out = _report(run, rank, {"losses": losses, "grad_norms": [], "updated": [], "counted_bytes": counted}, [],
                  return_params=True)
    out["forward_weights"] = seen
    out["scales"] = {name: float(s) for g in run.ddp.bucket_groups for name, s in (g.owner_fp8.last_scales if hasattr(g, "owner_fp8") else {}).items()}
    out["publish"] = [dict(fp8=l.fp8_elements, raw=l.raw_elements, scales=l.scales, recv_bytes=l.recv_bytes,
                           bucket_numel=b.param_data.numel(), param_bytes=b.param_data.element_size())
                      for g in run.ddp.bucket_groups for b, l in zip(g.buckets, g.owner_fp8.layouts if hasattr(g, "owner_fp8") else ())]
    return out


def fp8_start_up_errors(rank, world_size):
    """The start-up errors of an FP8 publish: an fp32 model; a DDP and an optimizer that disagree."""
    from megatron_dmuon.testing.workers import _build, init_parallel

    init_parallel()
    out = {}
    for case, kw in (("fp32_model", dict(publish_dtype="fp8_e4m3")),
                     ("mismatch", dict(publish_dtype="fp8_e4m3", shape_kw=dict(bf16=True), optimizer_publish="param"))):
        try:
            _build(**kw)
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    return out
