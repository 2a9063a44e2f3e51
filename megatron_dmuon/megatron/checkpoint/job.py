"""Job-level checkpoints in Megatron-LM's torch_dist layout: ``ROOT/iter_NNNNNNN`` (model, optimizer,
scheduler, iteration) and ``ROOT/latest_checkpointed_iteration.txt``, for the main job, the tests
and any megatron-core loop (Megatron-LM itself saves through its own code and DMuon's
``sharded_state_dict``). DMuon's optimizer state format is optimizer_state.py's; Megatron's own
optimizers (the AdamW baseline) load through Megatron's code.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import List, Optional

import torch

from .optimizer_state import (
    CheckpointMismatchError, model_chunks_of, content_metadata, agree_or_raise, check_record, gather_record,
    model_sharded_metadata, model_state, unwrap,
)
from .switch import megatron_torch_adam_load
from .trusted_read import UntrustedCheckpointError, check_checkpoint_is_data, trusted_dcp_metadata

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    import os

    return os.path.join(root, f"iter_{iteration:07d}")


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, extra: Optional[dict] = None,
                    sharding_type: str = "fully_reshardable") -> str:
    """Megatron-LM's torch_dist layout: ``root/iter_NNNNNNN`` holds the model, the optimizer and
    ``extra`` (common: iteration, scheduler...); ``root/latest_checkpointed_iteration.txt`` is
    written only once every rank finished, so a crash mid-save leaves the previous one current."""
    import os
    import shutil

    from megatron.core import dist_checkpointing

    from ..child_processes import install as children_die_with_this_rank

    children_die_with_this_rank()  # the writer's Manager process must not outlive a SIGKILLed rank
    path = checkpoint_dir(root, iteration)
    # a link where the save writes (made after the start-up check) is never followed into another directory:
    # every rank raises together, before anything is written
    link = [next((own for own in (path, os.path.join(root, TRACKER), os.path.join(root, TRACKER + ".tmp"))
                  if os.path.islink(own)), None) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(link, src=0)
    if link[0]:
        raise CheckpointMismatchError(f"{link[0]} is a symbolic link where this run writes its checkpoint: remove it, "
                                      "or save elsewhere")
    if torch.distributed.get_rank() == 0:
        if os.path.isdir(path):  # an incomplete save of a killed attempt
            shutil.rmtree(path)
        os.makedirs(path)
    torch.distributed.barrier()
    metadata = content_metadata(sharding_type)
    for chunk in model_chunks:  # --overlap-param-gather: the last publish may still wait in a forward
        if chunk.ddp_config.overlap_param_gather:  # hook (Megatron-LM disables the hooks around a save: the same sync)
            with torch.no_grad():
                chunk.start_param_sync(force_sync=True)
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
    if not os.path.exists(tracker):
        return None
    if not os.path.isfile(tracker):
        raise CheckpointMismatchError(f"{tracker} is not a file (it should hold the latest iteration): remove it")
    text = open(tracker).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointMismatchError(f"{tracker} is corrupt: {text[:40]!r} is not an iteration number") from None


def complete_iterations(root: str) -> List[int]:
    """The iterations under ``root`` whose checkpoint directory is complete (has metadata.json)."""
    import os
    import re

    if not os.path.isdir(root):
        return []
    found = [int(m.group(1)) for name in os.listdir(root) if (m := re.fullmatch(r"iter_(\d{7})", name))]
    return sorted(i for i in found if os.path.isfile(os.path.join(checkpoint_dir(root, i), "metadata.json")))


def resume_iteration(root: str) -> Optional[int]:
    """``latest_iteration(root)``, checked: the tracker must name a complete checkpoint. Else a
    ``CheckpointMismatchError`` names the last complete one and how to resume from it."""
    import os

    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return iteration
    complete = complete_iterations(root)
    state = "is missing" if not os.path.isdir(path) else "is incomplete (no metadata.json)"
    tracker = os.path.join(root, TRACKER)
    hint = (f"the last complete checkpoint there is iteration {complete[-1]}: write {complete[-1]} into {tracker} "
            f"to resume from it" if complete else "no complete checkpoint is there: remove the tracker to start fresh")
    raise CheckpointMismatchError(f"{tracker} names iteration {iteration}, but {path} {state}; {hint}")


def checkpoint_problem(path: str) -> Optional[str]:
    """Why the checkpoint directory ``path`` cannot load, in words (None: it reads): an unreadable
    metadata.json, torch DCP's .metadata, or a data file shorter than the metadata says. Reads no
    tensor and needs no process group, so the start-up checks can run it. A .metadata that holds
    anything but checkpoint metadata raises ``UntrustedCheckpointError`` (trusted_read.py), unread."""
    import json
    import os

    from ...files import read_bounded_text

    try:
        json.loads(read_bounded_text(os.path.join(path, "metadata.json"), "checkpoint metadata", 1 << 20))
    except ValueError as e:
        return f"its metadata.json does not read ({e})"
    try:
        storage = trusted_dcp_metadata(path).storage_data
    except UntrustedCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises whatever unpickling met
        return f"torch DCP's .metadata does not read ({type(e).__name__}: {e})"
    need = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            return f"its data file {name} " + ("is missing" if have is None else f"holds {have} bytes of {size}")
    return None


def _fresh_data(state) -> None:
    """Point every model ShardedTensor / factory at an empty tensor of its shape (in place)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def visit(d):
        items = d.items() if isinstance(d, dict) else enumerate(d)
        for k, v in list(items):
            if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and v.data is not None:
                d[k] = replace(v, data=torch.empty_like(v.data))
            elif isinstance(v, (dict, list)):
                visit(v)

    for key, value in state.items():
        if key.startswith("model"):
            visit(value)


def load_checkpoint(path: str, model_chunks, optimizer, load_optimizer: bool = True) -> dict:
    """Load a ``save_checkpoint`` directory into built model chunks and optimizer; returns the
    loaded common entries (iteration, ``extra``). The optimizer record is checked on every rank
    before anything is read (a checkpoint of another model or optimizer fails here, loudly)."""
    import os

    from megatron.core import dist_checkpointing

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path} is not a complete dist checkpoint (no metadata.json)")
    check_checkpoint_is_data(path)  # before any reader unpickles it
    metadata = dist_checkpointing.load_content_metadata(path) or content_metadata("fully_reshardable")
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    dmuon = all(hasattr(getattr(p, "model_chunks", [None])[0], "dmuon_plan") for p in parts)  # else one of Megatron's own
    if load_optimizer and dmuon:
        common = dist_checkpointing.load_common_state_dict(path)
        saved = common.get("optimizer") if isinstance(common, dict) else None
        meta = model_sharded_metadata(model_state(model_chunks_of(parts)))
        from .switch import prepare_load

        if not prepare_load(path, parts, optimizer.checkpoint_load, saved, meta):  # Megatron's own Muon: checked there
            agree_or_raise(check_record(saved.get("dmuon") if isinstance(saved, dict) else None,
                                        gather_record(parts, meta)))
    switch = False
    if load_optimizer and not dmuon:  # Megatron's own optimizer: a DMuon checkpoint switches back
        from .switch import dmuon_record_of

        common = dist_checkpointing.load_common_state_dict(path)
        switch = dmuon_record_of(common.get("optimizer") if isinstance(common, dict) else None) is not None
        if switch:  # DMuon's per-parameter tensors are what Megatron's fully_reshardable format asks for
            metadata = dict(metadata, distrib_optim_sharding_type="fully_reshardable")
    try:
        with contextlib.nullcontext() if dmuon or not load_optimizer else megatron_torch_adam_load(parts):
            return _load(path, model_chunks, optimizer, load_optimizer, metadata, switch)
    finally:
        if dmuon:  # (a failed read must not leave Megatron's names for the next load)
            optimizer.checkpoint_load.reset()


def _load(path, model_chunks, optimizer, load_optimizer, metadata, switch=False) -> dict:
    from megatron.core import dist_checkpointing

    from .switch import megatron_request_for_dmuon, megatron_state_from_dmuon

    state = model_state(model_chunks, metadata)
    prepared = None
    if load_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
        if switch:
            prepared = megatron_request_for_dmuon(path, dist_checkpointing.load_common_state_dict(path),
                                                  state["optimizer"])
    # read into fresh tensors: a load that fails midway (truncated or missing files) leaves the
    # model as it was (the optimizer part is fresh already); copied in once everything is read
    _fresh_data(state)
    try:
        loaded = dist_checkpointing.load(state, path)
    except Exception:
        raise
    except BaseException as e:  # torch DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise RuntimeError(f"reading the checkpoint {path} failed (nothing was loaded): {e}") from e
    for i, chunk in enumerate(model_chunks):
        unwrap(chunk).load_state_dict(loaded["model" if len(model_chunks) == 1 else f"model{i}"])
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"] if prepared is None
                                  else megatron_state_from_dmuon(prepared, loaded["optimizer"]))
    else:
        optimizer.reload_model_params()
    return {k: v for k, v in loaded.items() if k != "optimizer" and not k.startswith("model")}
