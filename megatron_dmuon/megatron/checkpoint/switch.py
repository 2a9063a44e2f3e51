"""Switching optimizers mid-run: a torch_dist checkpoint of Megatron's own Muon (``--optimizer muon
--use-distributed-optimizer``: its LayerWiseDistributedOptimizer chained with a
DistributedOptimizer for the AdamW params) loads into ``--optimizer dmuon``, keeping the fp32
masters, the Muon momenta, the AdamW moments and step.

What such a checkpoint holds (megatron-core 0.19, bf16; inspected, see docs/checkpoints.md):

* per Muon matrix (the LayerWise part, whole on its DP owner, the model param's own sharding):
  ``optimizer.state.fp32_param.<model key>`` (master) and ``optimizer.state.momentum_buffer.<model
  key>``; its param groups (common state) carry ``momentum`` and no step;
* per AdamW param (the DistributedOptimizer part, ``--dist-ckpt-optim-fully-reshardable`` only):
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` (whole tensors), its param groups
  ``betas``, ``eps`` and the one ``step``; ``param_state_sharding_type`` says the format;
* the common ``optimizer`` entry is the chain ``{0: LayerWise part, 1: DistOpt part}``.

DMuon's own keys are the same but for the matrix master (``param``); its pieces are requested from
the checkpoint under Megatron's names (``megatron_name``), each rank its own owners' pieces,
so the load reshards over DP like DMuon's own format. The momentum means the same in both
(``momentum.lerp_(grad, 1 - beta)``; Nesterov's input ``grad.lerp(momentum, beta)``), so it is
copied as it is. Refused, on every rank before anything is read: another update rule
(``--dmuon-update normuon|dion3``), a Muon momentum / AdamW betas or eps other than the
checkpoint's, Megatron's bucket format (``dp_reshardable``), a checkpoint without Muon momenta
(``--optimizer adam``) and any missing or extra tensor.

The reverse, a DMuon checkpoint into Megatron's own optimizer (``--optimizer muon
--use-distributed-optimizer``): Megatron's request is DMuon's keys already but for the Muon
masters (``fp32_param``, which ``megatron_request_for_dmuon`` points at DMuon's ``param``); the
common part DMuon wrote is not Megatron's chain, so ``megatron_state_from_dmuon`` builds the
state Megatron's ``load_state_dict`` takes from its own request (this run's param groups) and the
tensors read, with the AdamW step of DMuon's record. Checked first, on every rank: the update
rule (Muon only), Muon momentum, AdamW betas/eps, and every requested tensor present in the
checkpoint at the model's global shape.

In Megatron-LM's own loop neither optimizer is given the checkpoint's path: the hook notes the
common state Megatron-LM reads first (``note_megatron_lm_load``) and each direction takes it from
there (``prepare_noted_load`` for DMuon; for Megatron's optimizer the load wrapper of
``route_checkpoint_loads``, which Megatron-LM's and Megatron-Bridge's loads go through).
"""
from __future__ import annotations

import collections
import contextlib
import math
from typing import Callable, Optional, Tuple

import torch

from ...algorithms.update_rule import UpdateRule
from . import optimizer_state as ckpt
from .trusted_read import check_load_dir_is_data
from .optimizer_state import (global_shape, agree_or_raise, check_pieces, flat, load_pieces,
                         local_pieces, megatron_name, mismatch_message, publish)


def load_optimizer_state(parts, request, state_dict) -> None:
    """``checkpoint.load_optimizer_state``, or, where the load's request (``request``, a
    ``LoadRequest`` or None) asked for a Megatron Muon checkpoint's names (``prepare_load``), its
    tensors into DMuon's pieces (``load_megatron_state``)."""
    param_state = ckpt.dist_param_state(state_dict)
    if request is not None and request.megatron_source is not None and param_state is not None:
        return load_megatron_state(parts, param_state, request.megatron_source, request.param_ids)
    return ckpt.load_optimizer_state(parts, state_dict, request)


def megatron_source(common_optimizer) -> Optional[dict]:
    """The param groups and formats of a Megatron Muon / Adam checkpoint's common ``optimizer``
    entry (None: not one of Megatron's chained or distributed optimizers, e.g. DMuon's own)."""
    if not isinstance(common_optimizer, dict) or "dmuon" in common_optimizer:
        return None
    keys = list(common_optimizer)
    parts = [common_optimizer[k] for k in sorted(keys)] if keys and all(isinstance(k, int) for k in keys) \
        else [common_optimizer]
    muon, adam, formats, common_steps = [], [], [], []
    for part in parts:
        groups = part.get("optimizer", {}).get("param_groups") if isinstance(part, dict) else None
        if not isinstance(groups, list):
            return None
        for group in groups:
            (adam if "betas" in group else muon).append({k: v for k, v in group.items() if k != "params"})
        if "param_state_sharding_type" in part:
            formats.append(part["param_state_sharding_type"])
        elif any("betas" in g for g in groups):  # AdamW inside LayerWise's own Float16Optimizer
            state = part["optimizer"].get("state")
            common_steps.append(state.get("common_step") if isinstance(state, dict) else None)
    return {"muon_groups": muon, "adam_groups": adam, "formats": formats, "common_steps": common_steps,
            # the AdamW masters' name: a DistributedOptimizer part's 'param', a Float16Optimizer's 'fp32_param'
            "adam_master": ckpt.MEGATRON_MASTER if common_steps and not formats else "param"}


def _close(a, b) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)


def check_source(source: dict, parts) -> Optional[str]:
    """Why this run cannot continue from the Megatron checkpoint ``source`` (None: it can)."""
    if not source["muon_groups"]:
        return ("it is not a DMuon optimizer checkpoint but one of Megatron's --optimizer adam, with no Muon "
                "momenta to keep; load the model only (--no-load-optim) to start DMuon's state fresh")
    rules = sorted({p.optimizer.muon.update for p in parts})
    if any(p.optimizer.muon.rule.by_rows for p in parts):
        return (f"it was written by Megatron's Muon; this run has --dmuon-update {','.join(rules)}, whose state "
                "means something else: switch with --dmuon-update muon")
    bad = sorted(set(f for f in source["formats"] if f != "fully_reshardable"))
    if bad:
        return (f"its AdamW part is in Megatron's {bad[0]} format (keyed on Megatron's DP buffer buckets); "
                "save it with --dist-ckpt-optim-fully-reshardable to switch to --optimizer dmuon")
    if not source["formats"] and source["adam_groups"] and not source["common_steps"]:
        return "its AdamW part has no param_state_sharding_type (not a distributed optimizer's torch_dist state)"
    momenta = {float(g.get("momentum", float("nan"))) for g in source["muon_groups"]}
    ours = {float(p.optimizer.muon.momentum) for p in parts}
    if len(momenta) != 1 or len(ours) != 1 or not _close(next(iter(momenta)), next(iter(ours))):
        return (f"its Muon momentum is {sorted(momenta)}, this run's --muon-momentum {sorted(ours)}: resume with "
                "the checkpoint's (the run would not be the one that never switched)")
    for group in source["adam_groups"]:
        for part in parts:
            for mine in (g for g in part.optimizer.param_groups if not g.get("use_muon", False)):
                saved_betas, betas = tuple(map(float, group["betas"])), tuple(map(float, mine["betas"]))
                if not all(_close(a, b) for a, b in zip(saved_betas, betas)) or not _close(group["eps"], mine["eps"]):
                    return (f"its AdamW betas/eps are {saved_betas}/{group['eps']}, this run's {betas}/{mine['eps']}: "
                            "resume with the checkpoint's --adam-beta1/--adam-beta2/--adam-eps")
    steps = {float(g["step"]) for g in source["adam_groups"] if g.get("step") is not None}
    steps |= {float(step) for step in source["common_steps"] if step is not None}
    if len(steps) > 1:
        return f"its AdamW param groups hold different steps ({sorted(steps)})"
    source["adam_step"] = steps.pop() if steps else None
    return None


def check_tensors(parts, meta: dict, saved: dict, adam_master: str = "param") -> Optional[str]:
    """Every tensor this rank's pieces need is in the checkpoint (``saved``: its tensor metadata,
    key -> ShardedTensor), of the model param's global shape; and the checkpoint holds optimizer
    state for no parameter this model lacks (collective: the keys of every rank)."""

    problems, mine = [], set()
    for opt in parts:
        for piece in local_pieces(opt):
            sh = meta[piece.model_param]
            mine.add(sh.key)
            for key in piece.tensors:
                name = f"optimizer.state.{megatron_name(piece, key, adam_master)}.{sh.key}"
                found = saved.get(name)
                if found is None:
                    other = "momentum_buffer" if not piece.muon else "exp_avg"
                    kind = ("Muon here, AdamW in the checkpoint" if piece.muon else "AdamW here, Muon in the checkpoint")
                    problems.append(f"{name} is missing" + (f" ({sh.key} is {kind})"
                                                            if f"optimizer.state.{other}.{sh.key}" in saved else ""))
                elif tuple(found.global_shape) != global_shape(sh):
                    problems.append(f"{name} has shape {tuple(found.global_shape)}, this model {global_shape(sh)}")
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, sorted(mine))
    model_keys = set().union(*map(set, everyone))
    prefixes = ("optimizer.state.fp32_param.", "optimizer.state.momentum_buffer.", "optimizer.state.param.",
                "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.")
    extra = sorted({k.split(".", 3)[3] for k in saved if k.startswith(prefixes)} - model_keys)
    if extra:
        problems.append(f"the checkpoint has optimizer state of {len(extra)} params this model lacks, e.g. {extra[0]}")
    return mismatch_message("it does not fit this model", problems)


def prepare_load(path: str, parts, load, common_optimizer, meta: dict) -> bool:
    """Before a load of ``path``: if it is a Megatron Muon checkpoint, check it (raising on every
    rank, before anything is read) and note it in ``load`` (the ``CheckpointLoad`` in progress), so
    that its request asks for Megatron's names. False: not one of Megatron's (DMuon's own record
    check applies)."""
    from megatron.core import dist_checkpointing


    source = megatron_source(common_optimizer)
    if source is None:
        return False
    error = check_source(source, parts)
    if error is None:
        error = check_tensors(parts, meta, dist_checkpointing.load_tensors_metadata(path), source["adam_master"])
    agree_or_raise(error and f"{path} was written by Megatron's own optimizer; {error}")
    load.megatron_source = source
    return True


def load_megatron_state(parts, param_state: dict, source: dict, ids: dict) -> None:
    """The loaded tensors into every piece, the AdamW step, then the publish (the scheduler sets
    lr and weight decay on its own load)."""

    lookup = lambda pid, key, piece: flat(param_state[pid][key]) if key in param_state.get(pid, {}) else None  # noqa: E731
    agree_or_raise(next((e for e in (check_pieces(o, lookup, ids) for o in parts) if e), None))
    for opt in parts:
        if source.get("adam_step") is not None:
            opt.optimizer.set_adam_step(source["adam_step"])
            opt.optimizer.ns_check.steps = int(source["adam_step"])
        load_pieces(opt, lookup, ids)
        publish(opt)


# ----------------------------------------------------- Megatron-LM's own loop: the noted checkpoint
_NOTED_LOAD: dict = {}


def note_megatron_lm_load(path: str, common: dict) -> None:
    """The torch_dist checkpoint Megatron-LM's ``load_checkpoint`` is loading: its directory and
    common state (read before the optimizer is asked for its ``sharded_state_dict``)."""
    _NOTED_LOAD.clear()
    _NOTED_LOAD.update(path=path, common=common)


def take_noted_load() -> Optional[Tuple[str, dict]]:
    """The noted load, once (None: none is in progress)."""
    if not _NOTED_LOAD:
        return None
    out = (_NOTED_LOAD["path"], _NOTED_LOAD["common"])
    _NOTED_LOAD.clear()
    return out


def prepare_noted_load(parts, load, model_sharded_state_dict=None) -> None:
    """DMuon's ``sharded_state_dict(is_loading=True)`` inside Megatron-LM's loop: if the noted
    checkpoint is one of Megatron's own Muon, check it and ask for Megatron's names (``prepare_load``
    into ``load``, the ``CheckpointLoad`` in progress; one prepared already, by job.py, stays)."""
    noted = take_noted_load()
    if noted is None or load.megatron_source is not None:
        return
    path, common = noted
    if model_sharded_state_dict is None:
        model_sharded_state_dict = ckpt.model_state(ckpt.model_chunks_of(parts))
    prepare_load(path, parts, load, common.get("optimizer") if isinstance(common, dict) else None,
                 ckpt.model_sharded_metadata(model_sharded_state_dict))


# ------------------------------------------------------ the reverse: DMuon -> Megatron's own optimizer
def dmuon_record_of(common_optimizer) -> Optional[dict]:
    """The record of a DMuon checkpoint's common ``optimizer`` entry (None: not a DMuon checkpoint)."""
    record = common_optimizer.get("dmuon") if isinstance(common_optimizer, dict) else None
    return record if isinstance(record, dict) and record.get("format") == ckpt.FORMAT else None


def _sharded_leaves(tree):
    """The request's ShardedTensors and ShardedTensorFactories (e.g. the SwiGLU fc1 halves), keyed."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return (v for v in nested_values(tree) if isinstance(v, (ShardedTensor, ShardedTensorFactory)))


def _optimizer_parts(tree):
    """Every optimizer part of a (sharded) optimizer state dict: the dicts holding
    ``optimizer.param_groups`` (a chain's parts, LayerWise's inner Float16Optimizers)."""
    if isinstance(tree, dict):
        inner = tree.get("optimizer")
        if isinstance(inner, dict) and isinstance(inner.get("param_groups"), list):
            yield tree
            return
        for value in tree.values():
            yield from _optimizer_parts(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _optimizer_parts(value)


def _param_groups(tree):
    """Every param group of a (sharded) optimizer state dict, and whether it is an AdamW one."""
    for part in _optimizer_parts(tree):
        for group in part["optimizer"]["param_groups"]:
            if isinstance(group, dict):
                yield group, "betas" in group


def _check_dmuon_source(record: dict, common_optimizer: dict, request) -> Optional[str]:
    if record.get("update") not in ("", UpdateRule().name):  # (its parts' rules, comma-joined; '': before records had them)
        return (f"it was written with --dmuon-update {record.get('update')}, whose state Megatron's Muon does not "
                "have: load the model only (--no-load-optim)")
    saved = [g for g in common_optimizer.get("optimizer", {}).get("param_groups", []) if isinstance(g, dict)]
    ours = list(_param_groups(request))
    saved_momenta = set(map(float, record.get("muon_momentum", [])))  # (not recorded before 2026-12-02)
    our_momenta = {float(g["momentum"]) for g, adam in ours if not adam and "momentum" in g}
    if saved_momenta and not all(_close(a, b) for a in saved_momenta for b in our_momenta):
        return (f"its Muon momentum is {sorted(saved_momenta)}, this run's --muon-momentum {sorted(our_momenta)}: "
                "resume with the checkpoint's")
    for mine, adam in ours:
        if not adam or "betas" not in mine:
            continue
        for group in (g for g in saved if not g.get("use_muon") and "betas" in g):
            a, b = tuple(map(float, group["betas"])), tuple(map(float, mine["betas"]))
            if not all(_close(x, y) for x, y in zip(a, b)) or not _close(group["eps"], mine["eps"]):
                return (f"its AdamW betas/eps are {a}/{group['eps']}, this run's {b}/{mine['eps']}: resume with the "
                        "checkpoint's --adam-beta1/--adam-beta2/--adam-eps")
    return None


def megatron_request_for_dmuon(path: str, common: dict, request) -> Optional[dict]:
    """Before Megatron's own optimizer loads ``path``: if it is a DMuon checkpoint, check it against
    this run (every rank raises together, before anything is read), point the request's Muon
    masters at DMuon's key and return the request's skeleton for ``megatron_state_from_dmuon``.
    None: not a DMuon checkpoint (Megatron's load goes on unchanged)."""
    from megatron.core import dist_checkpointing

    common_optimizer = common.get("optimizer") if isinstance(common, dict) else None
    record = dmuon_record_of(common_optimizer)
    if record is None:
        return None
    skeleton = _skeleton(request)
    error = _check_dmuon_source(record, common_optimizer, request)
    saved = dist_checkpointing.load_tensors_metadata(path) if error is None else {}
    problems = []
    master = f"optimizer.state.{ckpt.MEGATRON_MASTER}."
    for sh in (_sharded_leaves(request) if error is None else ()):
        if sh.key.startswith(master):
            sh.key = "optimizer.state.param." + sh.key[len(master):]
        found = saved.get(sh.key)
        if found is None:
            name = sh.key.split(".", 3)[3] if sh.key.count(".") >= 3 else sh.key
            # the other kind's state key: present in the checkpoint, the param is of that kind there
            other = {"momentum_buffer": "exp_avg", "exp_avg": "momentum_buffer", "exp_avg_sq": "momentum_buffer"}
            kind = other.get(sh.key.split(".")[2]) if sh.key.count(".") >= 3 else None
            hint = (f" ({name} is {'Muon' if kind == 'momentum_buffer' else 'AdamW'} in the checkpoint)"
                    if kind and f"optimizer.state.{kind}.{name}" in saved else "")
            problems.append(f"{sh.key} is missing{hint}")
        elif hasattr(sh, "global_shape") and tuple(found.global_shape) != tuple(sh.global_shape):
            problems.append(f"{sh.key} has shape {tuple(found.global_shape)}, this model {tuple(sh.global_shape)}")
    error = error or mismatch_message("it does not fit this model", problems)
    agree_or_raise(error and f"{path} was written by --optimizer dmuon; {error}")
    return {"skeleton": skeleton, "adam_step": record.get("adam_step")}


def _skeleton(tree):
    """The request's containers copied (a load may change them), its leaves by reference."""
    if isinstance(tree, dict):
        return {k: _skeleton(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_skeleton(v) for v in tree]
    return tree


def _fill(skeleton, loaded):
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(skeleton, dict):
        return {k: _fill(v, loaded.get(k) if isinstance(loaded, dict) else None) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(v, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None)
                for i, v in enumerate(skeleton)]
    if isinstance(skeleton, ShardedBase):
        if loaded is None:
            raise RuntimeError(f"DMuon -> Megatron switch: {getattr(skeleton, 'key', skeleton)} was not read")
        return loaded
    if isinstance(skeleton, LocalNonpersistentObject):
        return skeleton.unwrap()
    return skeleton


def megatron_state_from_dmuon(prepared: dict, loaded_optimizer) -> dict:
    """The optimizer state for Megatron's ``load_state_dict``: its own request's structure and
    values (this run's param groups), the tensors read from DMuon's checkpoint in place of the
    requested ones, and DMuon's AdamW step in the AdamW part's param groups."""
    state = _fill(prepared["skeleton"], loaded_optimizer)
    step = prepared["adam_step"]
    for part in _optimizer_parts(state) if step is not None else ():
        groups = part["optimizer"]["param_groups"]
        if not any(isinstance(g, dict) and "betas" in g for g in groups):
            continue
        if "param_state_sharding_type" in part:  # a DistributedOptimizer: the step is in its groups
            for group in groups:
                group["step"] = int(step) if isinstance(group.get("step"), int) else float(step)
        elif isinstance(part["optimizer"].get("state"), dict):  # a Float16Optimizer: one common step
            part["optimizer"]["state"]["common_step"] = torch.tensor(float(step))
    return state


# ------------------------------------------------ the switch inside a training loop's own load
_ROUTED: set = set()  # the base reads route_checkpoint_loads put in place (a module routed twice keeps one)


def route_checkpoint_loads(outer_owner, outer_name: str, optimizer_at: int, base_owner, settings_of: Callable) -> None:
    """The optimizer switch inside a training loop's own checkpoint load. ``outer_owner.<outer_name>``
    is the load that is given the optimizer (positional argument ``optimizer_at``);
    ``base_owner._load_base_checkpoint`` the read it makes, first of the common state (``rank0=True``),
    then of the sharded state. ``settings_of(args, kwargs)`` of a read: an object with the run's
    ``optimizer`` name and ``no_load_optim``. Megatron-LM's ``load_checkpoint`` and Megatron-Bridge's
    ``_load_checkpoint_from_path`` (megatron/bridge/adapter.py) are routed so. Idempotent per module."""
    if base_owner._load_base_checkpoint in _ROUTED:
        return
    base, outer = base_owner._load_base_checkpoint, getattr(outer_owner, outer_name)
    loading: dict = {}  # the optimizer of the load in progress, and the switch prepared for it

    def load(*args, **kwargs):
        loading.clear()
        loading["optimizer"] = args[optimizer_at] if len(args) > optimizer_at else kwargs.get("optimizer")
        try:
            with contextlib.ExitStack() as stack:
                loading["stack"] = stack
                return outer(*args, **kwargs)
        finally:
            loading.clear()
            take_noted_load()

    def _load_base_checkpoint(load_dir, args, rank0=False, sharded_state_dict=None, *rest, **kwargs):
        check_load_dir_is_data(load_dir, getattr(args, "ckpt_step", None))  # before the reader unpickles
        prepared = None
        if not rank0 and loading.get("switch") and isinstance(sharded_state_dict, dict) \
                and "optimizer" in sharded_state_dict:
            noted = take_noted_load()
            if noted is not None:  # Megatron's optimizer, a DMuon checkpoint: DMuon's keys are asked for
                prepared = megatron_request_for_dmuon(*noted, sharded_state_dict["optimizer"])
        out = base(load_dir, args, rank0, sharded_state_dict, *rest, **kwargs)
        if rank0 and "optimizer" in loading and torch.distributed.is_initialized():
            state_dict, name, _, kind = out
            if isinstance(state_dict, dict) and getattr(kind, "name", None) == "GLOBAL":  # torch_dist
                note_megatron_lm_load(name, state_dict)
                _prepare_megatron_optimizer_for_dmuon(settings_of(args, kwargs), state_dict, loading)
        if prepared is not None:
            out[0]["optimizer"] = megatron_state_from_dmuon(prepared, out[0]["optimizer"])
        return out

    load.__name__ = load.__qualname__ = outer_name
    _ROUTED.add(_load_base_checkpoint)
    base_owner._load_base_checkpoint = _load_base_checkpoint
    setattr(outer_owner, outer_name, load)


def _prepare_megatron_optimizer_for_dmuon(args, common: dict, loading: dict) -> None:
    """A DMuon checkpoint noted for Megatron's own optimizer (``--optimizer muon``/``adam``): its
    tensors are per parameter, what Megatron's ``fully_reshardable`` format asks for, so the
    content metadata Megatron-LM reads next says so; megatron-core 0.19's torch-AdamW load
    workaround (megatron_torch_adam_load) holds for the rest of the load."""
    if getattr(args, "optimizer", None) == "dmuon" or getattr(args, "no_load_optim", False):
        return
    if dmuon_record_of(common.get("optimizer")) is None:
        return
    content = common.get("content_metadata")
    if isinstance(content, dict):
        content["distrib_optim_sharding_type"] = "fully_reshardable"
    optimizer = loading["optimizer"]
    loading["switch"] = True
    loading["stack"].enter_context(megatron_torch_adam_load(getattr(optimizer, "chained_optimizers", [optimizer])))


@contextlib.contextmanager
def megatron_torch_adam_load(parts):
    """Work around megatron-core 0.19's DistributedOptimizer without Apex/TE (torch's AdamW) for
    one load (a no-op elsewhere; DMuon's own optimizer never takes this path). Three bugs:
    ``state_dict()``, which the load calls first, reads every param's ``step`` before any step has
    created the state (so: the state is created as the optimizer's own ``init_state_fn`` does, plus
    step 0; the load overwrites all of it); ``load_state_dict`` copies each state tensor from the
    checkpoint's per-param tensors, which hold no ``step`` (it travels in the param groups), a
    KeyError (so: a missing entry is skipped, as its code already skips non-tensor entries); and it
    gives every param one shared ``step`` tensor, which torch's AdamW then increments once per param
    per step (so: every param gets its own copy)."""
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        yield
        return
    # only the DistributedOptimizer parts (torch AdamW): a chained LayerWise Muon part creates its
    # momenta itself on an empty state, which a step entry would stop
    parts = [p for p in parts if isinstance(p, distrib_optimizer.DistributedOptimizer)]
    inners = [p.optimizer for p in parts if getattr(p, "optimizer", None) is not None]
    for part in parts:
        if getattr(part, "init_state_fn", None) is not None and getattr(part, "optimizer", None) is not None:
            part.init_state_fn(part.optimizer, getattr(part, "config", None))
    for inner in inners:
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))
    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    def tolerant(self, model_param, tensors):
        return original(self, model_param, collections.defaultdict(lambda: None, tensors))

    cls._set_main_param_and_optimizer_states = tolerant
    try:
        yield
    finally:
        cls._set_main_param_and_optimizer_states = original
    for inner in inners:
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
