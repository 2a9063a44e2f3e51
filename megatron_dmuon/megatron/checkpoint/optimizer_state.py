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
(keyed by the same parameter ids, so it reshards over DP too): megatron/checkpoint/torch_format.py.
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
# NorMuon/Dion3 (--dmuon-update normuon|dion3) also keep one second moment per matrix row
ROW_KEY = "row_variance"


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
    inner = opt.optimizer
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
                    keys = ADAM_KEYS if info is None else MUON_KEYS + ((ROW_KEY,) if inner.muon.rule.by_rows else ())
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


def global_shape(sh) -> tuple:
    return tuple(int(s) for s in _plain(sh).global_shape)


def _replica_id(sh, piece: Piece, key: str, tp_rank: int, instance: int = 0):
    """The model param's replica id with the DP coordinate the distributed-optimizer instance (each
    optimizer shard is unique inside an instance; under --num-distributed-optimizer-instances every
    instance holds the same shards and instance 0's are written); a TP-replicated matrix's momentum
    is main on its TP owner only."""
    rid = sh.replica_id
    if not isinstance(rid, tuple) or len(rid) != 3:
        raise ValueError(f"DMuon checkpoint: expected a (PP, TP, DP) replica_id for {sh.key}, got {rid!r}")
    tp_coord = rid[1]
    if key == "momentum_buffer":
        tp_coord = 0 if piece.holds_momentum else 1 + tp_rank
    return (rid[0], tp_coord, instance)


def _regular_parts(sh) -> list:
    """[(ShardedTensor, lo, hi)]: the regular ShardedTensor(s) the model saves a param as, each with
    the flat range [lo, hi) of the (TP-local) param it covers: the param's own, or the tensors its
    factory builds (SwiGLU's fc1: the gate and the up halves, each its own part of the global tensor)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if not isinstance(sh, ShardedTensorFactory):
        return [(sh, 0, math.prod(sh.data.shape))]
    built = sh.build_fn(sh.key, torch.empty(sh.data.shape, device="meta"), sh.replica_id, None)
    tensors = []

    def visit(x):
        if isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)
        else:
            tensors.append(x)

    visit(built)
    parts = []
    for t in tensors:
        if not t.data.is_contiguous():
            raise NotImplementedError(f"DMuon checkpoint: {sh.key}'s factory builds a non-contiguous part; a matrix the "
                                      "split layout cuts cannot be saved from it (use --dmuon-dp-layout whole)")
        lo = t.data.storage_offset()
        parts.append((t, lo, lo + t.data.numel()))
    return sorted(parts, key=lambda p: p[1])


def _irregular_blocks(part, lo: int, start: int, end: int, data: torch.Tensor, key: str, rid) -> list:
    """ShardedTensor blocks of the flat range [start, end) of the param (``data`` holds it) inside the
    regular ``part`` that covers the param's flat range from ``lo``. Irregular shards go through DCP's
    chunk API, which ignores prepend_axis_num: the prepended axes (layer, expert) become real leading
    dims of size 1."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    prepend = part.prepend_axis_num
    blocks = []
    for offset, shape, a, b in flat_blocks(part.local_shape, start - lo, end - lo):
        global_offset = tuple(part.global_offset[:prepend]) + tuple(
            g + o for g, o in zip(part.global_offset[prepend:], offset))
        local_shape = (1,) * prepend + tuple(shape)
        blocks.append(ShardedTensor(
            key, data[a + lo - start:b + lo - start].view(local_shape), data.dtype, local_shape,
            tuple(part.global_shape), global_offset, None, rid, 0, allow_shape_mismatch=part.allow_shape_mismatch))
    return blocks


def _sharded_entry(sh, piece: Piece, key: str, data: torch.Tensor, rid, stored: Optional[str] = None):
    """ShardedTensor(s) for one state key of one piece (``data`` is 1-D, end - start long; a row
    rule's ``row_variance``: one value per row of the whole matrix). ``stored``: the key's name in
    the checkpoint (default ``key``; Megatron's Muon calls a matrix's master ``fp32_param``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if key == ROW_KEY:  # not the param's shape: its own 1-D tensor, keyed by the param's global id
        rows = (data.numel(),)
        return ShardedTensor(f"optimizer.state.{key}.{param_id(sh)}", data, data.dtype, rows, rows, (0,), None, rid, 0)
    numel = math.prod(sh.data.shape)
    name = f"optimizer.state.{stored or key}.{sh.key}"
    if piece.muon and (piece.start, piece.end) == (0, numel):  # a whole TP shard: the param's own sharding
        kwargs = dict(key=name, data=data.view(sh.data.shape), replica_id=rid)
        if not isinstance(sh, ShardedTensorFactory):
            kwargs["dtype"] = data.dtype
        return replace(sh, **kwargs)
    if isinstance(sh, ShardedTensorFactory) and not piece.muon:
        raise NotImplementedError(
            f"DMuon checkpoint: element-wise param {sh.key} is saved by a ShardedTensorFactory; only "
            "Muon matrices may use factories (report this model)")
    # an AdamW param's DP slice, or a Muon matrix's piece under the split layout: blocks in flat order
    blocks = []
    for part, lo, hi in _regular_parts(sh):
        start, end = max(piece.start, lo), min(piece.end, hi)
        if end > start:
            blocks += _irregular_blocks(part, lo, start, end, data[start - piece.start:end - piece.start], name, rid)
    return blocks


def _sharded_param_state(opt, meta: dict, is_loading: bool, stored=None) -> dict:
    """{param id: {state key: ShardedTensor or [ShardedTensor blocks]}} of one part's pieces.
    ``stored(piece, key)``: the key's name in the checkpoint (a load of another optimizer's)."""
    tp_rank = opt.optimizer.tp.rank
    instance = getattr(opt, "distributed_optimizer_instance_id", 0)
    out = {}
    for piece in local_pieces(opt):
        sh = meta.get(piece.model_param)
        if sh is None:
            raise ValueError(
                "DMuon checkpoint: a parameter of the optimizer is not in the model's sharded state dict "
                "(build it with the unwrapped model chunks' sharded_state_dict(), which keeps the param tensors)")
        entry = {}
        for key, t in piece.tensors.items():
            data = torch.empty_like(t.detach()) if is_loading else t.detach()
            entry[key] = _sharded_entry(sh, piece, key, data, _replica_id(sh, piece, key, tp_rank, instance),
                                        stored(piece, key) if stored else None)
        out[param_id(sh)] = entry
    return out


def flat(value) -> torch.Tensor:
    """A loaded entry (one tensor, or the blocks of an element-wise param's slice) as 1-D."""
    if isinstance(value, (list, tuple)):
        return torch.cat([v.reshape(-1) for v in value])
    return value.reshape(-1)


# ------------------------------------------------------------------------------------------ record
def _local_record(parts, meta: Optional[dict]) -> dict:
    """This rank's part of the record: params (id -> [global shape, kind]), plans, AdamW steps."""
    from megatron.core import parallel_state as ps

    params, plans, dmuon_plans, steps = {}, {}, {}, set()
    pp = ps.get_pipeline_model_parallel_rank()
    rules = sorted({opt.optimizer.muon.update for opt in parts})
    momenta = sorted({float(opt.optimizer.muon.momentum) for opt in parts})
    for opt in parts:
        if meta is not None:
            for piece in local_pieces(opt):
                sh = meta[piece.model_param]
                params[param_id(sh)] = [list(global_shape(sh)), "muon" if piece.muon else "adamw"]
        for i, chunk in enumerate(opt.model_chunks):
            plan = chunk.dmuon_plan
            for buffer, layout in plan.layouts.items():  # 'dense|expert/param dtype': as written before the plan
                plans[f"pp{pp}/chunk{i}/{'/'.join(buffer.split('/')[:2])}"] = layout.to_json()
            dmuon_plans[f"pp{pp}/chunk{i}"] = plan.to_json()
        steps |= opt.optimizer.adam_steps()
    return {"params": params, "plans": plans, "dmuon_plans": dmuon_plans, "adam_steps": sorted(steps),
            "updates": rules, "momenta": momenta}


def parallel_sizes() -> dict:
    from megatron.core import parallel_state as ps

    return {"dp": ps.get_data_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "world": torch.distributed.get_world_size()}


def gather_record(parts, meta: Optional[dict], group=None) -> dict:
    """The record of every param of ``group``'s ranks (default: the world, i.e. the whole model),
    identical on each of them."""
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, _local_record(parts, meta), group=group)
    params, plans, dmuon_plans, steps, rules, momenta = {}, {}, {}, set(), set(), set()
    for r in everyone:
        params.update(r["params"])
        plans.update(r["plans"])
        dmuon_plans.update(r["dmuon_plans"])
        steps.update(r["adam_steps"])
        rules.update(r["updates"])
        momenta.update(r["momenta"])
    if len(steps) > 1:
        raise ValueError(
            f"DMuon checkpoint: AdamW step counts differ between params ({sorted(steps)}); every element-wise "
            "param must step together (Megatron's DistributedOptimizer gives each one a gradient every step)")
    return {"format": FORMAT, "parallel": parallel_sizes(), "params": dict(sorted(params.items())),
            "plans": dict(sorted(plans.items())), "dmuon_plans": dict(sorted(dmuon_plans.items())),
            "adam_step": steps.pop() if steps else None,
            "update": ",".join(sorted(rules)),
            # Muon momentum (from 2026-12-02 on): a switch to Megatron's Muon checks it
            "muon_momentum": sorted(momenta)}


def check_record(record, current: dict) -> Optional[str]:
    """Why a checkpoint's record does not fit the current model (None if it fits)."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        return (f"not a DMuon optimizer checkpoint of format {FORMAT} (found {found!r}); load the model only "
                "(--no-load-optim) or save it again with --optimizer dmuon")
    for field in ("params", "plans", "parallel"):
        if not isinstance(record.get(field), dict):
            return f"the checkpoint's DMuon record is corrupt: field {field!r} is missing or not a mapping"
    from ...planning.owner_layout import OwnerLayout

    for name, text in record["plans"].items():
        try:
            OwnerLayout.from_json(text)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the same corruption
            return f"the checkpoint's DMuon owner plan {name!r} is corrupt ({type(exc).__name__}: {exc})"
    from ...planning.plan import DMuonPlan

    saved_plans = record.get("dmuon_plans", {})  # (checkpoints written before the plan object have none)
    if not isinstance(saved_plans, dict):
        return "the checkpoint's DMuon record is corrupt: field 'dmuon_plans' is not a mapping"
    for name, text in saved_plans.items():
        try:
            DMuonPlan.from_json(text)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the same corruption
            return f"the checkpoint's DMuon plan {name!r} is corrupt ({type(exc).__name__}: {exc})"
    saved_rule, rule = record.get("update", "muon"), current.get("update", "muon")
    if saved_rule != rule:  # the momenta mean different things (an average vs an accumulation)
        return (f"it was saved with --dmuon-update {saved_rule}, this run has --dmuon-update {rule}: resume with "
                f"--dmuon-update {saved_rule}, or load the model only (--no-load-optim)")
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
    return mismatch_message("the checkpoint was saved from a different model", problems)


def mismatch_message(lead: str, problems: list) -> Optional[str]:
    """``lead: problem; problem; ...`` (the first four, and how many more), or None for none."""
    if not problems:
        return None
    more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
    return f"{lead}: " + "; ".join(problems[:4]) + more


def agree_or_raise(error: Optional[str], group=None) -> None:
    """Raise the first rank's error on every rank of ``group`` (none continues into a collective alone)."""
    errors = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointMismatchError(f"DMuon: cannot load this optimizer checkpoint: {first}")


# ------------------------------------------------------------- the optimizer's entry points (parts)
def _check_sharding_type(metadata, sharding_type=None) -> None:
    requested = sharding_type or (metadata or {}).get("distrib_optim_sharding_type")
    if requested not in SERVED_SHARDING_TYPES:
        raise ValueError(
            f"--optimizer dmuon writes its own per-parameter optimizer format; sharding type {requested!r} "
            "is not supported (use --ckpt-format torch_dist, with or without --dist-ckpt-optim-fully-reshardable, "
            "or --ckpt-format torch)")


def model_chunks_of(parts) -> list:
    return parts[0].model_chunks


def optimizer_state_dict(parts) -> dict:
    """Megatron's non-parameter optimizer state (param groups of every part, grad scaler) plus the
    DMuon format tag and this rank's AdamW step. Not collective (Megatron-LM's torch format calls
    it on some ranks only)."""
    steps = set().union(*(p.optimizer.adam_steps() for p in parts))
    if len(steps) > 1:
        raise ValueError(f"DMuon: AdamW step counts differ between params ({sorted(steps)}); cannot checkpoint one step")
    groups = [{k: v for k, v in g.items() if k != "params"} for p in parts for g in p.optimizer.param_groups]
    state = {"optimizer": {"param_groups": groups},
             "dmuon": {"format": FORMAT, "adam_step": steps.pop() if steps else None}}
    scaler = parts[0].grad_scaler
    if scaler:
        state["grad_scaler"] = scaler.state_dict()
    return state


def sharded_optimizer_state(parts, model_sharded_state_dict=None, is_loading=False, metadata=None,
                            sharding_type=None, load=None) -> dict:
    """dist_checkpointing state of the whole optimizer (collective): one structure whatever the
    number of chained parts (dense/expert), so a load may split the params differently. ``load``
    (``is_loading``): the ``CheckpointLoad`` in progress, which notes what the request was built from."""
    source = load.megatron_source if is_loading else None
    if source is None:  # (a load of Megatron's own Muon checkpoint asks for its sharding type)
        _check_sharding_type(metadata, sharding_type)
    if model_sharded_state_dict is None:
        model_sharded_state_dict = model_state(model_chunks_of(parts))
    meta = model_sharded_metadata(model_sharded_state_dict)
    record = gather_record(parts, meta)  # first: its checks fail on every rank at once
    state = optimizer_state_dict(parts)
    state["dmuon"] = record
    state["param_state"] = {}
    stored = None
    if source is not None:  # checkpoint_switch: Megatron's names
        stored = lambda piece, key: megatron_name(piece, key, source.get("adam_master", "param"))  # noqa: E731
    for opt in parts:
        state["param_state"].update(_sharded_param_state(opt, meta, is_loading, stored))
    state["param_state_sharding_type"] = SHARDING_TYPE
    if is_loading:  # the loaded dict carries the checkpoint's record: keep the current one
        load.note_request(state["dmuon"], {p: param_id(sh) for p, sh in meta.items()})
    return state


MEGATRON_MASTER = "fp32_param"  # Megatron's Float16Optimizer: a matrix's fp32 master


def megatron_name(piece, key: str, adam_master: str = "param") -> str:
    """A DMuon state key's name in Megatron's Muon checkpoint (megatron/checkpoint/switch.py): a
    matrix's master is ``fp32_param``; an AdamW param's is ``param`` in a DistributedOptimizer part,
    ``fp32_param`` (``adam_master``) where LayerWise keeps the AdamW params in its own
    Float16Optimizer (Megatron-LM's pretrain_gpt path)."""
    if key != "param":
        return key
    return MEGATRON_MASTER if piece.muon else adam_master


def dist_param_state(state_dict) -> Optional[dict]:
    """The per-param tensors of a dist_checkpointing load ({} on a rank whose shards hold none: the
    reader drops an empty ``param_state``, but the format key comes to every rank), or None for the
    torch format. Every rank must take the dist branch alike: it runs collectives."""
    if not isinstance(state_dict, dict):
        return None
    if "param_state" in state_dict or "param_state_sharding_type" in state_dict:
        return state_dict.get("param_state") or {}
    return None


def load_optimizer_state(parts, state_dict, request=None) -> None:
    """Load what ``optimizer_state_dict`` (torch format: then ``load_param_state_file``) or
    ``sharded_optimizer_state`` (dist) saved; ``request``: the ``LoadRequest`` it was read by (None:
    this run's record is gathered now). Every check runs on every rank before any state changes; a
    dist load ends with the publish."""
    info = state_dict.get("dmuon") if isinstance(state_dict, dict) else None
    param_state = dist_param_state(state_dict)
    if param_state is not None:  # dist_checkpointing: every rank is here
        if request is None:
            meta = model_sharded_metadata(model_state(model_chunks_of(parts)))
            current, ids = gather_record(parts, meta), {p: param_id(sh) for p, sh in meta.items()}
        else:
            current, ids = request.record, request.param_ids
        error = check_record(info, current)
        if error is None and state_dict.get("param_state_sharding_type") != SHARDING_TYPE:
            error = f"optimizer state of sharding type {state_dict.get('param_state_sharding_type')!r}"
        lookup = lambda pid, key, piece: flat(param_state[pid][key]) if key in param_state.get(pid, {}) else None  # noqa: E731
        agree_or_raise(error or next((e for e in (check_pieces(o, lookup, ids) for o in parts) if e), None))
        _log_reshard(info["parallel"])
    elif not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointMismatchError(
            "DMuon: the optimizer state dict was not written by --optimizer dmuon (no DMuon format tag); "
            "load the model only (--no-load-optim) or save it again with --optimizer dmuon")
    for opt in parts:
        _restore_param_groups(opt, state_dict["optimizer"]["param_groups"])
        if info.get("adam_step") is not None:
            opt.optimizer.set_adam_step(info["adam_step"])
            # the online NS check counts the same steps (its cadence and probes continue exactly)
            opt.optimizer.ns_check.steps = int(info["adam_step"])
        if opt.grad_scaler and "grad_scaler" in state_dict:
            opt.grad_scaler.load_state_dict(state_dict["grad_scaler"])
    if param_state is not None:
        for opt in parts:
            load_pieces(opt, lookup, ids)
            publish(opt)


def _restore_param_groups(opt, saved_groups) -> None:
    """Hyperparameters of each saved group onto the current group with the same identity
    (Megatron's identifier keys and use_muon); the scheduler sets lr/wd again on its load."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    ident = lambda g: tuple(repr(g.get(k)) for k in (*param_group_identifier_keys, "use_muon"))  # noqa: E731
    saved = {ident(g): g for g in saved_groups}
    for group in opt.optimizer.param_groups:
        match = saved.get(ident(group))
        if match is not None:
            group.update({k: v for k, v in match.items() if k not in ("params", "step")})


def _log_reshard(saved: dict) -> None:
    now = parallel_sizes()
    if saved != now and torch.distributed.get_rank() == 0:
        logger.warning("DMuon: resharding the optimizer checkpoint saved at %s to %s", saved, now)


@torch.no_grad()
def publish(opt) -> None:
    """Masters -> model params -> all-gather of this part's buckets: every DP replica then holds the
    loaded model, whatever the overlap flags (without --overlap-param-gather the next forward
    would not gather; Megatron PR #6920's resume skipped exactly this)."""
    opt._copy_main_params_to_model_params()
    mine = {id(b) for buffer in opt.buffers for b in buffer.buckets}
    for chunk in opt.model_chunks:
        for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if any(id(b) in mine for b in bucket_group.buckets):
                chunk._start_bucket_group_param_sync(bucket_group, force_sync=True)


# ---------------------------------------------------------------------------------------- loading
def check_pieces(opt, lookup, ids: dict) -> Optional[str]:
    """Why ``lookup(param_id, key, piece) -> 1-D tensor`` cannot fill this part's pieces (or None)."""
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


# ----------------------------------------------------- the model part (used here and by job.py)
def content_metadata(sharding_type: str) -> dict:
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
