"""Start-up checks of a DMuon configuration: every error names the flag and the fix, and fires
before any buffer or optimizer state exists."""
from __future__ import annotations

from ..planning.overlap_mode import OverlapMode
from .modes import mode_traits


def check_model_parallel_config(model_config, mode: str = "dmuon") -> None:
    """Parallel layouts DMuon runs exactly; everything else fails here, before any state exists.

    Supported: TP (owners over the TP x DP grid), PP (each stage plans its own params) with or
    without the interleaved schedule (each model chunk's DDP plans its own), EP with expert TP
    (expert buffers get expert-DP x expert-TP owners), sequence parallelism."""
    get = lambda name, default=1: getattr(model_config, name, default) or default  # noqa: E731
    if get("context_parallel_size") > 1:
        raise ValueError(
            "--optimizer dmuon does not support --context-parallel-size > 1 yet (its owner plan and "
            "exactness tests cover TP/PP/EP/DP); use --context-parallel-size 1 or --optimizer adam"
        )
    if not mode_traits(mode).model_parallel and (get("tensor_model_parallel_size") > 1
                                                 or get("expert_model_parallel_size") > 1):
        raise ValueError(
            f"--dmuon-mode {mode} is the DP-only baseline (per-shard NS under TP/EP would not "
            "be Muon); use --dmuon-mode dmuon with --tensor-model-parallel-size / --expert-model-parallel-size"
        )
    if get("qk_clip", False):
        check_qk_clip_config(get)
    for name, flag in (("gtp_weight_remat_size", "--gtp-weight-remat-size"),
                       ("expert_gtp_weight_remat_size", "--expert-gtp-weight-remat-size")):
        if get(name) > 1:
            raise ValueError(
                f"--optimizer dmuon does not support GTP weight rematerialization ({flag} {get(name)}): its params "
                f"are re-gathered outside DMuon's owner-aligned buffers; drop {flag} (leave it at 1)")
    from .te_fp8 import check_fp8_param_gather

    check_fp8_param_gather(model_config)


def check_qk_clip_config(get) -> None:
    """`--qk-clip` (MuonClip, megatron/qk_clip.py) where Megatron's own QK-clip can run on DMuon."""
    if get("multi_latent_attention", False):
        raise ValueError(
            "--optimizer dmuon does not support --qk-clip with --multi-latent-attention yet (its QK-clip covers "
            "linear_qkv, not MLA's q/kv projections); drop --qk-clip, or use --optimizer muon")
    if get("tensor_model_parallel_size") > 1:
        raise ValueError(
            f"--qk-clip needs --tensor-model-parallel-size 1 (got {get('tensor_model_parallel_size')}): Megatron's "
            "Attention.clip_qk reshapes the TP-local linear_qkv weight with the whole model's Q/K sizes and fails "
            "after the first step, under every optimizer; drop --qk-clip or use TP 1")


def check_dmuon_config(config, ddp_config, cfg, model_config=None) -> None:
    """Start-up checks of (OptimizerConfig, DistributedDataParallelConfig, DMuonConfig[, model config]):
    what the run needs of the rest (the DMuonConfig itself was checked when it was built)."""
    if model_config is not None:
        check_model_parallel_config(model_config, cfg.mode)
        tp = tensor_parallel_size(model_config)
        if cfg.muon.rule.by_rows and tp > 1:
            raise ValueError(f"--dmuon-update {cfg.muon.update} selects and normalizes whole rows of each matrix, which "
                             "the TP exchange does not deliver yet: use --tensor-model-parallel-size 1 (and "
                             "--expert-tensor-parallel-size 1), or --dmuon-update muon")
    check_overlap_step(ddp_config, cfg, model_config, config)
    if getattr(config, "overlap_param_gather_with_optimizer_step", False):
        raise ValueError("--optimizer dmuon does not support --overlap-param-gather-with-optimizer-step; drop the flag")
    if config.fp16 and not getattr(config, "loss_scale", None):
        raise ValueError(
            "--optimizer dmuon with --fp16 needs a constant --loss-scale (dynamic loss scaling is not "
            "supported); add --loss-scale, or use --bf16"
        )
    optimizer = getattr(config, "optimizer", "adam")
    if optimizer not in ("adam", "dmuon", "muon"):
        raise ValueError(
            f"--optimizer dmuon runs AdamW on the element-wise params; OptimizerConfig.optimizer={optimizer!r} "
            "would be ignored: set optimizer='adam' (or build Megatron's own optimizer)")
    if optimizer == "muon" and getattr(config, "muon_scalar_optimizer", "adam") != "adam":
        raise ValueError(
            f"--optimizer dmuon runs AdamW on the element-wise params; --muon-scalar-optimizer "
            f"{config.muon_scalar_optimizer} is not supported: drop the flag")
    if getattr(config, "optimizer_cuda_graph", False):
        raise ValueError(
            "--optimizer dmuon does not support --optimizer-cuda-graph (Megatron's capture of its own optimizer "
            "step); drop the flag (DMuon's NS can run as a CUDA graph: --dmuon-ns-launch graph)")
    if config.optimizer_cpu_offload:
        raise ValueError("--optimizer dmuon does not support --optimizer-cpu-offload; drop the flag")
    if config.use_precision_aware_optimizer:
        raise ValueError("--optimizer dmuon does not support --use-precision-aware-optimizer; drop the flag")
    if not getattr(config, "decoupled_weight_decay", True):
        raise ValueError("--optimizer dmuon applies decoupled weight decay only; drop decoupled_weight_decay=False")
    traits = mode_traits(cfg.mode)
    if traits.distributed_optimizer:
        if not (config.use_distributed_optimizer and ddp_config.use_distributed_optimizer):
            raise ValueError(
                "--optimizer dmuon needs --use-distributed-optimizer (OptimizerConfig and "
                "DistributedDataParallelConfig use_distributed_optimizer=True); or pick "
                "--dmuon-mode gather_then_compute"
            )
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    if instances != 1 and not traits.owner_step:
        raise ValueError(f"--num-distributed-optimizer-instances {instances} shards DMuon's owner step; --dmuon-mode "
                         f"{cfg.mode} has none: drop the flag, or pass --dmuon-mode dmuon")
    if traits.all_reduces and ddp_config.use_distributed_optimizer:
        raise ValueError(f"--dmuon-mode {cfg.mode} all-reduces grads: drop --use-distributed-optimizer")


def tensor_parallel_size(config) -> int:
    """The largest TP size of a run (dense or expert), from parsed flags or a model config."""
    return max(getattr(config, "tensor_model_parallel_size", 1) or 1,
               getattr(config, "expert_tensor_parallel_size", 1) or 1)


def _one_hardware_queue() -> bool:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 on a CUDA machine (Megatron-LM's launch scripts set it for TP's
    communication overlap): every stream's work then enters the GPU through one queue, in launch order."""
    import os

    import torch

    return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and torch.cuda.is_available()


def check_overlap_step(ddp_config, cfg, model_config=None, config=None) -> None:
    """Start-up checks of --dmuon-overlap-step (megatron/overlap_hooks.py), before any state exists
    (``config``: the OptimizerConfig, where known)."""
    overlap = OverlapMode(cfg.muon.overlap_step)
    if not overlap.cuts_per_need_group:
        return
    flag = f"--dmuon-overlap-step {overlap.name}"
    if overlap.starts_in_backward:
        _check_backward_start(flag, ddp_config, cfg, config)
    if not mode_traits(cfg.mode).owner_step:
        raise ValueError(f"{flag} applies to --dmuon-mode dmuon (got {cfg.mode}): drop the flag")
    if overlap.overlaps and not getattr(ddp_config, "overlap_param_gather", False):
        raise ValueError(
            f"{flag} finishes each bucket group's Newton-Schulz in the next forward's param-gather hooks, which "
            "exist only with --overlap-param-gather: add --overlap-param-gather (and --overlap-grad-reduce)")
    if getattr(ddp_config, "fp8_param_gather", False):
        raise ValueError(f"{flag} is not implemented with --fp8-param-gather (Megatron quantizes every master in "
                         "one call after the step): drop one of the two flags")
    tp = tensor_parallel_size(model_config) if model_config is not None else 1
    if tp > 1:
        raise ValueError(f"{flag} is not implemented with tensor parallelism (--tensor-model-parallel-size / "
                         f"--expert-tensor-parallel-size {tp}): drop --dmuon-overlap-step")
    if getattr(model_config, "qk_clip", False):
        raise ValueError(f"{flag} cannot run with --qk-clip: the clip rescales weights right after the step, "
                         "before the overlapped step has applied them; drop one of the two flags")
    if overlap.overlaps and _one_hardware_queue():
        raise ValueError(
            f"{flag} needs CUDA_DEVICE_MAX_CONNECTIONS > 1 (or unset): with one hardware queue the GPU runs the "
            "side stream's Newton-Schulz in launch order, so the next forward waits for all of it and nothing is "
            "hidden (measured slower than off). Without tensor or context parallelism Megatron needs no single "
            "queue: unset CUDA_DEVICE_MAX_CONNECTIONS (or set 8), or use --dmuon-overlap-step off")
    if overlap.overlaps and getattr(ddp_config, "log_params_norm", False):  # Megatron-LM's args
        raise ValueError(f"{flag} with --log-params-norm would log the norm of the params before the step's Muon "
                         "update (it is applied in the next forward): drop one of the two flags")


def _check_backward_start(flag, ddp_config, cfg, config) -> None:
    """--dmuon-overlap-step backward starts a group's momentum and NS in the backward hook that
    launches its grad reduce: its grads must be final there and not rescaled by a loss scaler
    (clipping is speculated: a step whose clipping fires redoes the groups)."""
    if not getattr(ddp_config, "overlap_grad_reduce", False):
        raise ValueError(f"{flag} starts each bucket group when Megatron launches its grad reduce during the "
                         "backward, which happens only with --overlap-grad-reduce: add it")
    if getattr(ddp_config, "reduce_scatter_with_fp32_accumulation", False):
        raise ValueError(f"{flag} reads the reduced grads in the grad buffer when the reduce is launched; "
                         "reduce_scatter_with_fp32_accumulation copies them elsewhere only at the step: drop it")
    if config is not None and config.fp16:
        raise ValueError(f"{flag} starts the Muon update before the step knows whether the loss scaler skips it "
                         "or rescales: it cannot run with --fp16; use --bf16, or --dmuon-overlap-step on")
    if cfg.layout.ranks_per_node or getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1:
        raise ValueError(f"{flag} is not implemented with the two-level reduce (--dmuon-ranks-per-node) or "
                         "several optimizer instances: drop those, or use --dmuon-overlap-step on")
