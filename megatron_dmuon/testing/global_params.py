"""Name every parameter of a (TP/PP/EP-parallel) megatron-core GPT by its place in the whole model,
so distributed runs and the TP=PP=EP=1 reference can start from the same weights and be compared.

* Pipeline stages number their layers locally; ``layer_number`` holds the global (1-based) index.
* Expert parallel ranks number their local experts from 0; global expert = ep_rank * local + j.
* TP shards are cut from one full matrix per name (``algorithms.tp_shards``), so a TP=t model
  and the TP=1 reference hold the same full weights.
"""
from __future__ import annotations

import re
import zlib
from typing import Dict, List

import torch

from ..algorithms.tp_shards import merge_tp_shards, split_tp_shards, tp_full_shape

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*?local_experts\.)(\d+)(\..*)$")


def global_names(model) -> Dict[str, str]:
    """{local name: global name} for every parameter of this rank's model."""
    from megatron.core import parallel_state as ps

    layers = getattr(getattr(model, "decoder", None), "layers", [])
    layer_global = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    ep_rank = ps.get_expert_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    out = {}
    for name, _ in model.named_parameters():
        g = name
        m = _LAYER.match(g)
        if m:
            g = f"{m.group(1)}{layer_global[int(m.group(2))]}{m.group(3)}"
        m = _EXPERT.match(g)
        if m:
            local = model.config.num_moe_experts // max(1, model.config.expert_model_parallel_size)
            g = f"{m.group(1)}{ep_rank * local + int(m.group(2))}{m.group(3)}"
        out[name] = g
    return out


def _tp_of(param):
    """(tp size, tp rank) of the group this param is sharded over (expert TP for experts)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return 1, 0
    if not getattr(param, "allreduce", True):
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def init_params_by_name(model, std: float = 0.02) -> None:
    """Every matrix <- this rank's shard of a full N(0, std^2) matrix seeded by its global name
    (vectors keep Megatron's init, e.g. norm weights = 1, which is the same at any TP/PP)."""
    names = global_names(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue
            tp_size, tp_rank = _tp_of(p)
            dim = getattr(p, "partition_dim", 0)
            full_shape = tp_full_shape(p.shape, dim, tp_size) if tp_size > 1 else tuple(p.shape)
            g = torch.Generator().manual_seed(zlib.crc32(names[name].encode()))
            full = torch.randn(full_shape, generator=g) * std
            shard = split_tp_shards(full, tp_size, dim, getattr(p, "partition_stride", 1))[tp_rank] if tp_size > 1 else full
            p.copy_(shard.to(p.dtype))
            # TE FP8 params keep their high-precision init value, which Megatron's DistributedOptimizer
            # makes the fp32 master from: it must be the new value too
            keep = getattr(p, "get_high_precision_init_val", None)
            kept = keep() if callable(keep) else None
            if isinstance(kept, torch.Tensor):
                kept.copy_(shard.to(kept.dtype))


def local_shards(model) -> Dict[str, dict]:
    """{global name: {'tensor', 'partition_dim', 'stride', 'tp_rank', 'tp_size'}} of this rank."""
    names = global_names(model)
    out = {}
    for name, p in model.named_parameters():
        tp_size, tp_rank = _tp_of(p)
        out[names[name]] = {"tensor": p.detach().float().cpu().clone(), "tp_rank": tp_rank, "tp_size": tp_size,
                            "partition_dim": getattr(p, "partition_dim", 0), "stride": getattr(p, "partition_stride", 1)}
    return out


def merge_ranks(per_rank: List[Dict[str, dict]]) -> Dict[str, torch.Tensor]:
    """Full parameters from every rank's ``local_shards``; raises if two replicas of one shard differ
    (every DP replica must hold the published parameters)."""
    shards: Dict[str, Dict[int, dict]] = {}
    for rank_shards in per_rank:
        for name, s in rank_shards.items():
            seen = shards.setdefault(name, {})
            prev = seen.get(s["tp_rank"])
            if prev is not None and not torch.equal(prev["tensor"], s["tensor"]):
                raise AssertionError(f"replicas of {name} (TP rank {s['tp_rank']}) differ across ranks")
            seen[s["tp_rank"]] = s
    full = {}
    for name, by_rank in shards.items():
        first = by_rank[min(by_rank)]
        if first["tp_size"] == 1:
            full[name] = first["tensor"]
            continue
        if sorted(by_rank) != list(range(first["tp_size"])):
            raise AssertionError(f"{name}: TP shards {sorted(by_rank)} of {first['tp_size']} collected")
        full[name] = merge_tp_shards([by_rank[r]["tensor"] for r in range(first["tp_size"])],
                                     first["partition_dim"], first["stride"])
    return full
