"""DMuon optimizer checkpoints in Megatron-LM's torch format (``--ckpt-format torch``):
``save_parameter_state(file)`` gathers every per-parameter tensor to DP rank 0, keyed by the same
parameter ids as the torch_dist format (optimizer_state.py), so it reshards over DP too."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .trusted_read import trusted_torch_load
from .optimizer_state import ROW_KEY, model_chunks_of, agree_or_raise, check_pieces, check_record, gather_record, load_pieces, local_pieces, model_sharded_metadata, model_state, param_id, publish


def _dp_root(parts):
    """The DP group and its rank 0 (global) shared by every part; torch format needs one."""
    roots = {torch.distributed.get_global_rank(p.data_parallel_group, 0) for p in parts}
    if len(roots) != 1 or len({p.data_parallel_group.size() for p in parts}) != 1:
        raise NotImplementedError(
            "DMuon: the torch checkpoint format gathers to DP rank 0, which differs between the dense and "
            "expert optimizers here (expert parallelism); use --ckpt-format torch_dist")
    return parts[0].data_parallel_group, roots.pop()


def param_state_dp_zero(parts) -> Optional[dict]:
    """Torch format: {'dmuon': record over the DP group, 'params': {param id: {key: full flattened
    TP-local tensor}}} on DP rank 0 (None elsewhere), gathered like Megatron's dp_zero format."""
    group, root = _dp_root(parts)
    meta = model_sharded_metadata(model_state(model_chunks_of(parts)))
    record = gather_record(parts, meta, group=group)
    mine = [(param_id(meta[p.model_param]), p.start, p.end, p.model_param.numel(),
             {k: t.detach().cpu().clone() for k, t in p.tensors.items()}) for opt in parts for p in local_pieces(opt)]
    gathered = [None] * group.size() if group.rank() == 0 else None
    torch.distributed.gather_object(mine, gathered, dst=root, group=group)
    if group.rank() != 0:
        return None
    full: Dict[str, Dict[str, torch.Tensor]] = {}
    for rank_pieces in gathered:
        for pid, start, end, numel, tensors in rank_pieces:
            slot = full.setdefault(pid, {k: torch.zeros(t.numel() if k == ROW_KEY else numel, dtype=t.dtype)
                                         for k, t in tensors.items()})
            for k, t in tensors.items():
                if k == ROW_KEY:  # whole on the matrix's owner
                    slot[k].copy_(t)
                else:
                    slot[k][start:end] = t
    return {"dmuon": record, "params": full}


def save_param_state_file(parts, filename: str) -> None:
    """DP rank 0 of the first distributed-optimizer instance writes (every instance holds the same state)."""
    state = param_state_dp_zero(parts)
    if state is not None and all(getattr(p, "distributed_optimizer_instance_id", 0) == 0 for p in parts):
        torch.save(state, filename)


def load_param_state_dp_zero(parts, state) -> None:
    """DP rank 0's ``param_state_dp_zero`` dict -> every DP rank's pieces (reshards over DP), then
    the publish. Checks first, on every rank of the DP group."""
    group, root = _dp_root(parts)
    box = [state]
    torch.distributed.broadcast_object_list(box, src=root, group=group)
    state = box[0]
    meta = model_sharded_metadata(model_state(model_chunks_of(parts)))
    current = gather_record(parts, meta, group=group)
    ids = {p: param_id(sh) for p, sh in meta.items()}
    error = check_record(state.get("dmuon") if isinstance(state, dict) else None, current)
    params = state.get("params", {}) if isinstance(state, dict) else {}
    lookup = lambda pid, key, piece: (None if key not in params.get(pid, {})  # noqa: E731
                                      else params[pid][key] if key == ROW_KEY else params[pid][key][piece.start:piece.end])
    agree_or_raise(error or next((e for e in (check_pieces(o, lookup, ids) for o in parts) if e), None), group)
    for opt in parts:
        load_pieces(opt, lookup, ids)
        publish(opt)


def load_param_state_file(parts, filename: str) -> None:
    """DP rank 0 reads ``filename`` as data only (trusted_read.trusted_torch_load); a file it refuses
    raises on every rank of the DP group before anything is loaded."""
    group, _ = _dp_root(parts)
    state, refusal = None, None
    if group.rank() == 0:
        try:
            state = trusted_torch_load(filename, "DMuon's torch-format optimizer state")
        except ValueError as e:  # UntrustedCheckpointError, or a missing / special file
            refusal = str(e)
    agree_or_raise(refusal, group)
    load_param_state_dp_zero(parts, state)
