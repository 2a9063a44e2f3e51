"""`--qk-clip` without Transformer Engine, for tests and benchmarks only: the max attention logits
recorded by megatron-core's local `DotProductAttention`.

Megatron's MuonClip reads each attention's per-head max logit from
`core_attention.current_max_attn_logits`, which only Transformer Engine's attention (TE >= 2.9,
`return_max_logit`) writes; Megatron-LM's `validate_args` asserts TE >= 2.9 for `--qk-clip` and
`--log-max-attention-logit`. The project's machines have no Transformer Engine, so neither
`--optimizer muon` nor `--optimizer dmuon` can run MuonClip there. `install()` fills that one gap
and nothing else, the same way for every optimizer:

* each local `DotProductAttention` built with `config.qk_clip` or `config.log_max_attention_logit`
  records, per forward, the max over batch and positions of each head's logits as its softmax
  sees them (the scaled scores, the causal or given mask excluded), as TE records them, and keeps
  the running max over micro-batches in `current_max_attn_logits` (Megatron's clip resets it);
* Megatron-LM's argument check answers TE >= 2.9 for those two flags only;
* (counted, not changed) each `SelfAttention.clip_qk` call's max logit, for a run's summary line.

Megatron's own `clip_qk`, its all-reduce and its rescale run unchanged. The recorded max comes from
bf16 scores under a bf16 run (TE's from its fp32 accumulator): the same source for both
optimizers, which is what a comparison of them needs.

    python -m megatron_dmuon.testing.local_max_logits pretrain_gpt.py ARGS...   (under torchrun)
"""
from __future__ import annotations

import json
import os
import sys

import torch

_INSTALLED = {}
CLIPS = []  # (layer number, its max logit after the DP all-reduce, clipped?) per SelfAttention.clip_qk call


def per_head_max_logits(scores: torch.Tensor, mask, causal: bool, scale=None) -> torch.Tensor:
    """[np] max of ``scores`` [b, np, sq, sk] over b, sq, sk where not masked (``mask`` True = masked,
    broadcastable; None with ``causal``: the upper triangle), in fp32."""
    scores = scores.float()
    if scale is not None:
        scores = scores * scale
    sq, sk = scores.shape[-2:]
    if mask is None and causal and sq > 1:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1)
    if mask is not None:
        scores = scores.masked_fill(mask.to(torch.bool), float("-inf"))
    return scores.amax(dim=(0, 2, 3))


def _record_in(attention) -> None:
    """Wrap this attention's softmax so each forward folds its per-head max logit into
    ``attention.current_max_attn_logits``."""
    from megatron.core.transformer.enums import AttnMaskType

    softmax = attention.scale_mask_softmax
    if getattr(softmax, "window_size", None) is not None:
        raise NotImplementedError("local_max_logits: sliding-window attention's mask is not recorded")
    forward = softmax.forward

    def recording_forward(scores, mask, *rest, **kw):
        with torch.no_grad():
            causal = getattr(softmax, "attn_mask_type", None) == AttnMaskType.causal
            batch_max = per_head_max_logits(scores.detach(), mask, causal, getattr(softmax, "scale", None))
            previous = attention.current_max_attn_logits
            attention.current_max_attn_logits = batch_max if previous is None else torch.maximum(previous, batch_max)
        return forward(scores, mask, *rest, **kw)

    softmax.forward = recording_forward
    attention.current_max_attn_logits = None


def install() -> None:
    """Idempotent; call before Megatron-LM parses its arguments and builds the model."""
    if _INSTALLED:
        return
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    init = DotProductAttention.__init__

    def __init__(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            _record_in(self)

    DotProductAttention.__init__ = __init__
    _INSTALLED["attention_init"] = init
    _count_clips()
    try:
        from megatron.training import arguments
    except ImportError:  # megatron-core alone: no argument check to answer
        return
    te_min_version = arguments.is_te_min_version

    def is_te_min_version(version, *a, **kw):  # what validate_args asks for --qk-clip / --log-max-attention-logit
        return True if version == "2.9.0" else te_min_version(version, *a, **kw)

    arguments.is_te_min_version = is_te_min_version
    _INSTALLED["is_te_min_version"] = te_min_version


def _count_clips() -> None:
    """Note what each SelfAttention.clip_qk call saw, for the run's summary (`main`)."""
    from megatron.core.transformer.attention import SelfAttention

    clip = SelfAttention.clip_qk

    def clip_qk(self):
        logits = self.core_attention.current_max_attn_logits
        top = float(logits.max())
        CLIPS.append((self.layer_number, top, top > self.config.qk_clip_threshold))
        return clip(self)

    SelfAttention.clip_qk = clip_qk
    _INSTALLED["clip_qk"] = clip


def summary() -> dict:
    """The clip_qk calls of this process: how many, how many found a logit above the threshold,
    the max logit of the first and last calls' step."""
    layers = len({layer for layer, _, _ in CLIPS}) or 1
    steps = [max(top for _, top, _ in CLIPS[i:i + layers]) for i in range(0, len(CLIPS), layers)]
    return {"clip_qk_calls": len(CLIPS), "clipped_calls": sum(c for _, _, c in CLIPS), "steps": len(steps),
            "first_step_max_logit": steps[0] if steps else None, "last_step_max_logit": steps[-1] if steps else None,
            "max_logit": max(steps) if steps else None}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m megatron_dmuon.testing.local_max_logits pretrain_gpt.py ARGS...")
    install()
    from megatron_dmuon.megatron.run import main as run_megatron_lm  # the DMuon hook, on an unmodified script too

    run_megatron_lm(argv)
    if CLIPS and int(os.environ.get("RANK", "0")) == 0:
        print("local_max_logits summary: " + json.dumps(summary()), flush=True)


if __name__ == "__main__":
    main()
