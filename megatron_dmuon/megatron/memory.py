"""Optimizer-state memory per rank, counted from the state tensors themselves.

DMuon's owners keep an fp32 master and a momentum only for what they own (the owner-aligned
shard), plus AdamW's two moments for their shard of the element-wise params. Megatron's AdamW
DistributedOptimizer keeps, per element of the model, an fp32 master (bf16/fp16 models; an fp32
param is its own master) and two fp32 moments, divided over DP: the figure printed next to ours.
"""
from __future__ import annotations

from typing import Dict, List

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _parts(optimizer) -> List:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_state_bytes(optimizer) -> Dict[str, int]:
    """This rank's optimizer state in bytes: separate fp32 masters, Muon momentum, AdamW states
    (moments and step counters), total. Counted from the tensors the optimizer holds."""
    masters = momentum = adamw = 0
    for part in _parts(optimizer):
        groups = getattr(part, "shard_fp32_from_float16_groups", None)
        if groups is None:  # Megatron's Float16OptimizerWithFloat16Params (the all-reduce baseline)
            groups = getattr(part, "fp32_from_float16_groups", [])
        masters += sum(_nbytes(p) for g in groups for p in g)
        inner = part.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                for key, t in inner.state.get(p, {}).items():
                    if not isinstance(t, torch.Tensor):
                        continue
                    if key == "momentum_buffer":
                        momentum += _nbytes(t)
                    else:
                        adamw += _nbytes(t)
    return {"masters": masters, "momentum": momentum, "adamw": adamw, "total": masters + momentum + adamw}


def megatron_adamw_state_bytes(model_chunks, dp_size: int) -> float:
    """Megatron's AdamW DistributedOptimizer on the same model, per rank: (fp32 master where the
    param is narrower + 2 fp32 moments) per trainable element / the ranks that shard it (DP, divided
    by --num-distributed-optimizer-instances: each instance holds a whole copy)."""
    total = 0
    instances = 1
    for chunk in model_chunks:
        instances = getattr(getattr(chunk, "ddp_config", None), "num_distributed_optimizer_instances", 1) or 1
        for p in chunk.parameters():
            if p.requires_grad:
                master = 4 if p.element_size() < 4 else 0
                total += p.numel() * (master + 8)
    return total / (dp_size // instances)
