"""MuonClip (`--qk-clip`) under `--optimizer dmuon`: Megatron's own `clip_qk` on DMuon's masters.

After each optimizer step Megatron-LM calls `megatron.core.optimizer.qk_clip.clip_qk(model)`: the
per-head max attention logits are all-reduced (MAX) over the data-parallel group and each
attention's `clip_qk()` rescales the Q and K rows of `linear_qkv.weight` in `weight.data` and,
where the attribute exists, in `weight.main_param`, which it treats as the whole 2-D fp32 master.
(Multi-latent attention, whose clip_qk rescales other weights, and TP > 1, where Megatron's
rescale fails for every optimizer, are refused at start-up: megatron/config_checks.py.)

Under DMuon a bf16/fp16 weight's `main_param` is what Megatron's DistributedOptimizer makes it,
this rank's flat 1-D shard of the master: the whole matrix on its DP owner, whose owner-aligned
shard holds it whole, and None on every other rank. Megatron's rescale then fails
(`copy_` of the 2-D result into the flat master; `None.data` elsewhere). `clip_qk` here calls
Megatron's with, for the call only, the owner's `main_param` a 2-D view of its master (the
rescale lands in the master DMuon steps next) and no `main_param` on the other ranks (they
rescale `weight.data` alone, the copy their next forward reads, as the owner does too).
fp32 weights have no `main_param`: the optimizer steps a view of the weight itself.
"""
from __future__ import annotations

import contextlib
import types

QKV_WEIGHT = "self_attention.linear_qkv.weight"  # what Megatron's SelfAttention.clip_qk rescales


def _megatron_clip_qk():
    from megatron.core.optimizer.qk_clip import clip_qk

    return clip_qk


def check_qk_clip_plan(model_config, plan) -> None:
    """Start-up check of `--qk-clip` under DMuon: every linear_qkv weight must be a Muon matrix, which
    the owner-aligned layout puts whole on one DP rank; an AdamW param may be split over ranks,
    and Megatron's rescale of a whole matrix could not reach the pieces of its master."""
    if not getattr(model_config, "qk_clip", False):
        return
    split = [r.name for r in plan.records if r.name.endswith(QKV_WEIGHT) and not r.use_muon]
    if split:
        raise ValueError(
            f"--qk-clip with --optimizer dmuon needs the linear_qkv weights to be Muon matrices (each whole on one "
            f"rank); these step by AdamW ({', '.join(split[:3])}: {plan.record(split[0]).reason}) and their "
            "masters may be split over ranks: drop --qk-clip, or let Muon take them")


def _is_dmuon_chunk(chunk) -> bool:
    return getattr(chunk, "dmuon_plan", None) is not None  # a DMuonDDP (ddp.py imports this module)


def _with_layers_at_megatrons_path(chunk):
    """Megatron's clip_qk finds the layers at `chunk.module.module.decoder` (DDP, Float16Module,
    model); an fp32 chunk has no Float16Module, and gets that path through this view."""
    if hasattr(chunk.module, "module"):
        return chunk
    return types.SimpleNamespace(module=types.SimpleNamespace(module=chunk.module))


def _qkv_weights(chunk):
    for layer in chunk.module.module.decoder.layers:
        qkv = getattr(layer.self_attention, "linear_qkv", None)
        if qkv is not None:
            yield qkv.weight


@contextlib.contextmanager
def _masters_as_matrices(chunks):
    """For the block only: each QKV weight's `main_param` a 2-D view of the whole master on its
    owner, and no `main_param` on the ranks that hold none of it (the originals come back after)."""
    saved = []
    try:
        for chunk in chunks:
            for weight in _qkv_weights(chunk):
                if not hasattr(weight, "main_param"):
                    continue  # fp32: the optimizer steps a view of the weight
                master = weight.main_param
                if master is not None and master.numel() != weight.numel():
                    raise RuntimeError(
                        f"--qk-clip: this rank's master of a linear_qkv weight {tuple(weight.shape)} holds {master.numel()} "
                        f"of its {weight.numel()} elements (not an owner-aligned Muon matrix); drop --qk-clip")
                saved.append((weight, master))
                if master is None:
                    del weight.main_param
                else:
                    weight.main_param = master.view(weight.shape)
        yield
    finally:
        for weight, master in saved:
            weight.main_param = master


def clip_qk(model, log_max_only: bool = False) -> float:
    """Megatron's `clip_qk(model, log_max_only)` (returns the max attention logit), made to
    rescale DMuon's masters; model chunks that are not DMuon's go to Megatron's unchanged."""
    megatron_clip_qk = _megatron_clip_qk()
    if not any(_is_dmuon_chunk(chunk) for chunk in model):
        return megatron_clip_qk(model, log_max_only=log_max_only)
    chunks = [_with_layers_at_megatrons_path(chunk) for chunk in model]
    if log_max_only:  # nothing is rescaled
        return megatron_clip_qk(chunks, log_max_only=True)
    with _masters_as_matrices(chunks):
        return megatron_clip_qk(chunks, log_max_only=False)
