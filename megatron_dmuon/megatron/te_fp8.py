"""Transformer Engine's FP8 params (`--fp8-format ... --fp8-param-gather`) under DMuon.

With TE, Megatron's DistributedOptimizer quantizes FP8 params itself
(`_copy_main_params_to_model_params` -> `megatron.core.fp8_utils.quantize_param_shard`): each
rank casts its fp32 master shard into the TE tensor with a per-tensor scale whose amax is
all-reduced over the DP group. Under DMuon every Muon matrix lies whole in its owner's shard, so
the other ranks contribute no element and the reduced amax is the owner's: the same rule as
`--dmuon-publish-dtype fp8_*` (megatron/publish.py), run by TE's kernels. DMuonDistributedOptimizer
inherits that code unchanged; the fp32 masters start from TE's high-precision init values, as
Megatron's DistributedOptimizer does (Megatron's own Muon starts them from the FP8 weights).

Tested on the H200 with TE 2.20.2 (tests/gpu/test_te_layers.py, docs/megatron_lm.md §10): after every
step each FP8 param is the quantization of its owner's current master, in delayed and current
scaling, and its bytes live in the uint8 buffer the param all-gather moves. This module decides
whether the combination may start and says what the DDP holds.
"""
from __future__ import annotations

import torch


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def check_fp8_param_gather(model_config) -> None:
    """Start-up check of TE FP8 params under DMuon: refused without TE (naming the alternative) and
    beside DMuon's own FP8 publish; with TE, Megatron's own quantize path runs (``fp8_param_summary``
    then checks the DDP holds FP8 params and logs them)."""
    if not (getattr(model_config, "fp8", None) and getattr(model_config, "fp8_param", False)):
        return
    if not transformer_engine_available():
        raise ValueError(
            "--fp8-param-gather needs Transformer Engine's FP8 params, and transformer_engine does not import "
            "here; drop the flag, or keep bf16 params and publish FP8 with --dmuon-publish-dtype fp8_e4m3")
    if getattr(model_config, "dmuon_publish_dtype", "param") != "param":
        raise ValueError("--fp8-param-gather and --dmuon-publish-dtype fp8_* both quantize the publish: pick one")


def fp8_param_summary(ddp, model_config) -> str | None:
    """Under --fp8-param-gather: what DMuon's DDP holds as TE FP8 params, in words ('N params as TE
    FP8 tensors in M uint8 buffers'), or an error when the flag is on and no param is one (the run
    would silently be the bf16-param run). None without the flag."""
    if not (getattr(model_config, "fp8", None) and getattr(model_config, "fp8_param", False)):
        return None
    from megatron.core.fp8_utils import is_float8tensor

    params = [p for p in ddp.module.parameters() if p.requires_grad]
    fp8 = [p for p in params if is_float8tensor(p)]
    buffers = [b for b in ddp.buffers + ddp.expert_parallel_buffers
               if b.param_data is not None and b.param_data.dtype == torch.uint8]
    if not fp8 or not buffers:
        raise ValueError(
            f"--fp8-param-gather: the model holds {len(fp8)} TE FP8 params and {len(buffers)} FP8 (uint8) param "
            "buffers; the model was not built under TE's fp8_model_init (TransformerConfig.fp8_param): build it "
            "with the config that has fp8_param=True, or drop --fp8-param-gather")
    numel = sum(p.numel() for p in fp8)
    return (f"{len(fp8)} of {len(params)} params held as TE FP8 tensors ({numel:,} elements) in {len(buffers)} "
            "uint8 buffer(s): owners re-quantize them from their fp32 masters, the param all-gather moves FP8 bytes")
