"""DMuon optimizer checkpoints: one per-parameter format, written by the owners, reshardable.

Megatron's DistributedOptimizer formats and what they key on (megatron-core 0.19):

* ``dp_reshardable``: one ShardedTensor per *bucket* of the flat DP buffer. It reshards over DP
  only because Megatron's bucket contents do not depend on DP; DMuon's owner-aligned buckets do
  (matrices move to their owners' shards), so for DMuon it could only reload at the same layout.
* ``fully_reshardable``: one ShardedTensor per *parameter* (the model param's key, TP/PP global
  offsets), but every DP rank first all-gathers the whole DP buffer and DP rank 0 writes it.
* ``fully_sharded_model_space``: per parameter with ``flattened_range``, which 0.19's
  ShardedTensor rejects.

DMuon writes one format for every requested sharding type: per parameter, like
``fully_reshardable`` (keys ``optimizer.state.{param,momentum_buffer,exp_avg,exp_avg_sq}.<model
key>``, the model param's global shape and TP/PP/EP offsets), but each rank writes exactly the
elements it owns and nothing is gathered: a Muon matrix lies whole on its DP owner (one
ShardedTensor, the model param's own regular sharding); an element-wise (AdamW) param's 1-D slice
of the flattened TP shard is cut into at most 2·ndim-1 hyper-rectangles (irregular ShardedTensors,
``flat_blocks``). A load at any DP/TP/PP layout asks for its own owners' pieces: DP=4 -> DP=2 and
TP=2 -> TP=1 reshard. A TP-replicated matrix's momentum is written by its TP owner (the other TP
ranks hold a zero replica with a non-zero replica_id), so every rank holds the same state keys.

The common part (``state_dict()``) carries the param groups, the AdamW step (one count for the
whole model) and a record: format, parallel sizes, the owner plans, and every parameter's global
shape and kind (Muon/AdamW). A load checks the record on every rank before any state is touched
and fails on all ranks at once if the model differs; a different layout is resharded (logged).
After a load the masters are copied to the model params and all-gathered, so every DP replica
holds the loaded model (Megatron PR #6920's bug was a resume that skipped this publish).

Torch format (Megatron-LM ``--ckpt-format torch``): ``state_dict()`` plus
``save_parameter_state(file)``, which, like Megatron's, gathers per-parameter tensors to DP rank 0
(keyed by the same parameter ids, so it reshards over DP too).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

FORMAT = "dmuon-per-param-v1"
SHARDING_TYPE = "dmuon_per_param"
# Megatron's sharding types (metadata['distrib_optim_sharding_type']) DMuon serves with its own format.
SERVED_SHARDING_TYPES = (None, "dp_reshardable", "fully_reshardable", "fully_sharded_model_space", SHARDING_TYPE)
MUON_KEYS = ("param", "momentum_buffer")
ADAM_KEYS = ("param", "exp_avg", "exp_avg_sq")


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit this model (raised on every rank, before any state changes)."""


def flat_blocks(shape: Sequence[int], start: int, end: int) -> List[Tuple[tuple, tuple, int, int]]:
    """Cover the flat range [start, end) of a C-contiguous tensor of ``shape`` by hyper-rectangles,
    in order: ``[(offset, block_shape, flat_start, flat_end)]`` (at most 2·ndim-1 blocks; each
    block is a contiguous run of the flat range)."""
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (end - start,) if shape else (), start, end)]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    out = []

    def row(r, a, b):  # part [a, b) of row r
        return [((r,) + off, (1,) + sh, r * inner + x, r * inner + y) for off, sh, x, y in flat_blocks(shape[1:], a, b)]

    if c0:
        stop = min(end, (r0 + 1) * inner)
        out += row(r0, c0, stop - r0 * inner)
        if stop == end:
            return out
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:], r0 * inner, r1 * inner))
    if c1:
        out += row(r1, 0, c1)
    return out


@dataclasses.dataclass
class Piece:
    """The part of one parameter this rank holds in its optimizer: elements [start, end) of the
    flattened (TP-local) param, and a 1-D tensor of that length per state key (live views)."""

    model_param: torch.nn.Parameter
    start: int
    end: int
    tensors: Dict[str, torch.Tensor]
    muon: bool
    holds_momentum: bool = True


def local_pieces(opt) -> List[Piece]:
    """Every parameter piece of a DMuonDistributedOptimizer, in buffer order."""
    inner = opt.dmuon_inner
    main_of = {}
    for model_groups, main_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                      (opt.model_fp32_groups, opt.shard_fp32_groups)):
        for mg, sg in zip(model_groups, main_groups):
            main_of.update(zip(mg, sg))
    pieces = []
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket_map in per_bucket:
                for model_param, ranges in bucket_map["param_map"].items():
                    main = main_of[model_param]
                    state = inner.state[main]
                    info = inner.matrix_info.get(main)
                    keys = MUON_KEYS if info is not None else ADAM_KEYS
                    missing = [k for k in keys[1:] if k not in state]
                    if missing:
                        raise RuntimeError(f"DMuon: optimizer state {missing} missing for a param; "
                                           "OwnerMuonAdamW.init_state() must run before a checkpoint")
                    tensors = {"param": main, **{k: state[k] for k in keys[1:]}}
                    pieces.append(Piece(model_param, ranges["param"].start, ranges["param"].end, tensors,
                                        info is not None, info is None or inner.holds_momentum(info)))
    return pieces


def model_sharded_metadata(model_sharded_state_dict) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {sh.data: sh for sh in nested_values(tensors)}


def _plain(sh):
    """A ShardedTensor describing ``sh`` (a factory's first built tensor: same key, prepended
    offsets and global shape as the whole parameter)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(sh, ShardedTensorFactory):
        built = sh.build_fn(sh.key, sh.data, sh.replica_id, None)
        while isinstance(built, (list, tuple, dict)):
            built = next(iter(built.values())) if isinstance(built, dict) else built[0]
        return built
    return sh


def param_id(sh) -> str:
    """A parameter's identity in the whole model: its sharded key plus the offsets of the
    prepended axes (layer of a stacked decoder, expert): the same on every TP/DP rank."""
    sh = _plain(sh)
    prepend = tuple(sh.global_offset[: sh.prepend_axis_num])
    return sh.key + ("@" + ",".join(map(str, prepend)) if prepend else "")


def _global_shape(sh) -> tuple:
    return tuple(int(s) for s in _plain(sh).global_shape)


def _replica_id(sh, piece: Piece, key: str, tp_rank: int):
    """The model param's replica id with the DP coordinate 0 (each optimizer shard is unique);
    a TP-replicated matrix's momentum is main on its TP owner only."""
    rid = sh.replica_id
    if not isinstance(rid, tuple) or len(rid) != 3:
        raise ValueError(f"DMuon checkpoint: expected a (PP, TP, DP) replica_id for {sh.key}, got {rid!r}")
    tp_coord = rid[1]
    if key == "momentum_buffer":
        tp_coord = 0 if piece.holds_momentum else 1 + tp_rank
    return (rid[0], tp_coord, 0)


def _sharded_entry(sh, piece: Piece, key: str, data: torch.Tensor, rid):
    """ShardedTensor(s) for one state key of one piece (``data`` is 1-D, end - start long)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    numel = math.prod(sh.data.shape)
    if piece.muon:  # whole TP shard on its owner: the model param's own (regular) sharding
        if (piece.start, piece.end) != (0, numel):
            raise RuntimeError(f"DMuon: Muon matrix {sh.key} is split across DP shards; the layout is not owner-aligned")
        kwargs = dict(key=f"optimizer.state.{key}.{sh.key}", data=data.view(sh.data.shape), replica_id=rid)
        if not isinstance(sh, ShardedTensorFactory):
            kwargs["dtype"] = data.dtype
        return replace(sh, **kwargs)
    if isinstance(sh, ShardedTensorFactory):
        raise NotImplementedError(
            f"DMuon checkpoint: element-wise param {sh.key} is saved by a ShardedTensorFactory; only "
            "Muon matrices may use factories (report this model)")
    # Irregular shards go through DCP's chunk API, which ignores prepend_axis_num: the prepended
    # axes (layer, expert) become real leading dims of size 1.
    prepend = sh.prepend_axis_num
    blocks = []
    for offset, shape, a, b in flat_blocks(sh.local_shape, piece.start, piece.end):
        global_offset = tuple(sh.global_offset[:prepend]) + tuple(
            g + o for g, o in zip(sh.global_offset[prepend:], offset))
        local_shape = (1,) * prepend + tuple(shape)
        blocks.append(ShardedTensor(
            f"optimizer.state.{key}.{sh.key}", data[a - piece.start:b - piece.start].view(local_shape), data.dtype,
            local_shape, tuple(sh.global_shape), global_offset, None, rid, 0,
            allow_shape_mismatch=sh.allow_shape_mismatch))
    return blocks


def sharded_param_state(opt, model_sharded_state_dict, is_loading: bool) -> dict:
    """{param id: {state key: ShardedTensor or [ShardedTensor blocks]}} of this rank's pieces."""
    meta = model_sharded_metadata(model_sharded_state_dict)
    tp_rank = opt.dmuon_inner.tp.rank
    out = {}
    for piece in local_pieces(opt):
        sh = meta.get(piece.model_param)
        if sh is None:
            raise ValueError(
                "DMuon checkpoint: a parameter of the optimizer is not in the model's sharded state dict "
                "(build it with the model chunks' sharded_state_dict(), which keeps the param tensors)")
        entry = {}
        for key, t in piece.tensors.items():
            data = torch.empty_like(t.detach()) if is_loading else t.detach()
            entry[key] = _sharded_entry(sh, piece, key, data, _replica_id(sh, piece, key, tp_rank))
        out[param_id(sh)] = entry
    return out


def flat(value) -> torch.Tensor:
    if isinstance(value, (list, tuple)):
        return torch.cat([v.reshape(-1) for v in value])
    return value.reshape(-1)


# ------------------------------------------------------------------------------------------ record
def local_record(opt, model_sharded_state_dict=None) -> dict:
    """This rank's part of the record: params (id -> [global shape, kind]), plans, AdamW steps."""
    from megatron.core import parallel_state as ps

    params = {}
    if model_sharded_state_dict is not None:
        meta = model_sharded_metadata(model_sharded_state_dict)
        for piece in local_pieces(opt):
            sh = meta[piece.model_param]
            params[param_id(sh)] = [list(_global_shape(sh)), "muon" if piece.muon else "adamw"]
    plans = {}
    pp = ps.get_pipeline_model_parallel_rank()
    for i, chunk in enumerate(opt.dmuon_model_chunks):
        for key, plan in (getattr(chunk, "dmuon_owner_plans", None) or {}).items():
            if key.is_expert_parallel == opt.dmuon_is_expert:
                plans[f"pp{pp}/chunk{i}/{'expert' if key.is_expert_parallel else 'dense'}/{key.param_dtype}"] = plan.to_json()
    return {"params": params, "plans": plans, "adam_steps": sorted(opt.dmuon_inner.adam_steps())}


def parallel_sizes() -> dict:
    from megatron.core import parallel_state as ps

    return {"dp": ps.get_data_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "world": torch.distributed.get_world_size()}


def gather_record(opt, model_sharded_state_dict=None, group=None) -> dict:
    """The record of every param of ``group``'s ranks (default: the world, i.e. the whole model),
    identical on each of them."""
    mine = local_record(opt, model_sharded_state_dict)
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, mine, group=group)
    params, plans, steps = {}, {}, set()
    for r in everyone:
        params.update(r["params"])
        plans.update(r["plans"])
        steps.update(r["adam_steps"])
    if len(steps) > 1:
        raise ValueError(
            f"DMuon checkpoint: AdamW step counts differ between params ({sorted(steps)}); every element-wise "
            "param must step together (Megatron's DistributedOptimizer gives each one a gradient every step)")
    return {"format": FORMAT, "parallel": parallel_sizes(), "params": dict(sorted(params.items())),
            "plans": dict(sorted(plans.items())), "adam_step": steps.pop() if steps else None}


def check_record(record, current: dict) -> Optional[str]:
    """Why a checkpoint's record does not fit the current model (None if it fits)."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        return (f"not a DMuon optimizer checkpoint of format {FORMAT} (found {found!r}); load the model only "
                "(--no-load-optim) or save it again with --optimizer dmuon")
    for field in ("params", "plans", "parallel"):
        if not isinstance(record.get(field), dict):
            return f"the checkpoint's DMuon record is corrupt: field {field!r} is missing or not a mapping"
    from ..planning.owner_layout import OwnerLayout

    for name, text in record["plans"].items():
        try:
            OwnerLayout.from_json(text)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the same corruption
            return f"the checkpoint's DMuon owner plan {name!r} is corrupt ({type(exc).__name__}: {exc})"
    saved, now = record["params"], current["params"]
    problems = []
    for pid, (shape, kind) in now.items():
        if pid not in saved:
            problems.append(f"{pid} is not in the checkpoint")
        elif list(saved[pid][0]) != list(shape):
            problems.append(f"{pid} has shape {tuple(shape)}, the checkpoint {tuple(saved[pid][0])}")
        elif saved[pid][1] != kind:
            problems.append(f"{pid} is {kind} now, {saved[pid][1]} in the checkpoint")
    extra = sorted(set(saved) - set(now))
    if extra:
        problems.append(f"the checkpoint has {len(extra)} params this model lacks, e.g. {extra[0]}")
    if problems:
        return ("the checkpoint was saved from a different model: " + "; ".join(problems[:4])
                + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""))
    return None


def agree_or_raise(error: Optional[str], group=None) -> None:
    """Raise the first rank's error on every rank of ``group`` (none continues into a collective alone)."""
    errors = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointMismatchError(f"DMuon: cannot load this optimizer checkpoint: {first}")


# ---------------------------------------------------------------------------------------- loading
def check_pieces(opt, lookup, ids: dict) -> Optional[str]:
    """Why ``lookup(param_id, key, piece) -> 1-D tensor`` cannot fill this rank's pieces (or None)."""
    for piece in local_pieces(opt):
        pid = ids[piece.model_param]
        for key, dst in piece.tensors.items():
            src = lookup(pid, key, piece)
            if src is None or src.numel() != dst.numel():
                return (f"entry {key} of {pid} has {0 if src is None else src.numel()} elements for this "
                        f"rank's piece of {dst.numel()} (elements [{piece.start}, {piece.end}))")
            if not src.is_floating_point():
                return f"entry {key} of {pid} has dtype {src.dtype}, expected a float tensor"
    return None


@torch.no_grad()
def load_pieces(opt, lookup, ids: dict) -> None:
    """Copy ``lookup(param_id, key, piece)`` into every piece (run ``check_pieces`` first)."""
    for piece in local_pieces(opt):
        pid = ids[piece.model_param]
        for key, dst in piece.tensors.items():
            dst.copy_(lookup(pid, key, piece).reshape(dst.shape))


def full_param_state_dp_zero(opt, ids: dict) -> Optional[dict]:
    """Torch format: {param id: {key: full flattened TP-local tensor}} on DP rank 0 (None elsewhere),
    gathered over the optimizer's DP group (as Megatron's dp_zero format does)."""
    mine = [(ids[p.model_param], p.start, p.end, p.model_param.numel(),
             {k: t.detach().cpu().clone() for k, t in p.tensors.items()}) for p in local_pieces(opt)]
    group = opt.data_parallel_group
    gathered = [None] * group.size() if group.rank() == 0 else None
    torch.distributed.gather_object(mine, gathered, dst=torch.distributed.get_global_rank(group, 0), group=group)
    if group.rank() != 0:
        return None
    full: Dict[str, Dict[str, torch.Tensor]] = {}
    for rank_pieces in gathered:
        for pid, start, end, numel, tensors in rank_pieces:
            slot = full.setdefault(pid, {k: torch.zeros(numel, dtype=t.dtype) for k, t in tensors.items()})
            for k, t in tensors.items():
                slot[k][start:end] = t
    return full


# ------------------------------------------------------------------- job-level save / load (torch_dist)
TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    import os

    return os.path.join(root, f"iter_{iteration:07d}")


def _content_metadata(sharding_type: str) -> dict:
    # what Megatron-LM's _build_sharded_state_dict_metadata passes (minus the process group)
    return {"distrib_optim_sharding_type": sharding_type, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}


def unwrap(chunk):
    """The model inside DDP / Float16Module wrappers (Megatron-LM checkpoints the unwrapped model)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def model_state(model_chunks, metadata=None) -> dict:
    """The model part of a checkpoint as Megatron-LM builds it ('model' or 'model0', 'model1'...)."""
    if len(model_chunks) == 1:
        return {"model": unwrap(model_chunks[0]).sharded_state_dict(metadata=metadata)}
    return {f"model{i}": unwrap(c).sharded_state_dict(metadata=metadata) for i, c in enumerate(model_chunks)}


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, extra: Optional[dict] = None,
                    sharding_type: str = "fully_reshardable") -> str:
    """Megatron-LM's torch_dist layout: ``root/iter_NNNNNNN`` holds the model, the optimizer and
    ``extra`` (common: iteration, scheduler...); ``root/latest_checkpointed_iteration.txt`` is
    written only once every rank finished, so a crash mid-save leaves the previous one current."""
    import os
    import shutil

    from megatron.core import dist_checkpointing

    path = checkpoint_dir(root, iteration)
    if torch.distributed.get_rank() == 0:
        if os.path.isdir(path):  # an incomplete save of a killed attempt
            shutil.rmtree(path)
        os.makedirs(path)
    torch.distributed.barrier()
    metadata = _content_metadata(sharding_type)
    state = model_state(model_chunks, metadata)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state.update(extra or {})
    state["iteration"] = iteration
    dist_checkpointing.save(state, path, content_metadata=metadata)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    torch.distributed.barrier()
    return path


def latest_iteration(root: str) -> Optional[int]:
    """The iteration of the last complete checkpoint under ``root`` (None: no checkpoint)."""
    import os

    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointMismatchError(f"{tracker} is corrupt: {text[:40]!r} is not an iteration number") from None


def _optimizer_records(common) -> list:
    opt = common.get("optimizer") if isinstance(common, dict) else None
    if isinstance(opt, dict) and "dmuon" in opt:
        return [opt["dmuon"]]
    if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt):
        return [opt[k].get("dmuon") if isinstance(opt[k], dict) else None for k in sorted(opt)]
    return [None]


def load_checkpoint(path: str, model_chunks, optimizer, load_optimizer: bool = True) -> dict:
    """Load a ``save_checkpoint`` directory into built model chunks and optimizer; returns the
    loaded common entries (iteration, ``extra``). The optimizer record is checked on every rank
    before anything is read (a checkpoint of another model or optimizer fails here, loudly)."""
    import os

    from megatron.core import dist_checkpointing

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path} is not a complete dist checkpoint (no metadata.json)")
    metadata = dist_checkpointing.load_content_metadata(path) or _content_metadata("fully_reshardable")
    common = dist_checkpointing.load_common_state_dict(path)
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if load_optimizer:
        records = _optimizer_records(common)
        if len(records) != len(parts):
            records = [None] * len(parts)
        errors = None
        for part, record in zip(parts, records):
            errors = errors or check_record(record, gather_record(part, model_state(part.dmuon_model_chunks, metadata)))
        agree_or_raise(errors)
    state = model_state(model_chunks, metadata)
    if load_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load(state, path)
    for i, chunk in enumerate(model_chunks):
        unwrap(chunk).load_state_dict(loaded["model" if len(model_chunks) == 1 else f"model{i}"])
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
    else:
        optimizer.reload_model_params()
    return {k: v for k, v in loaded.items() if k != "optimizer" and not k.startswith("model")}
