"""DMuon's checkpoints: one per-parameter optimizer format, written by the owners and reshardable
over DP, TP, PP and virtual stages, in Megatron's torch_dist and torch formats (docs/checkpoints.md).

    optimizer_api.py    OwnerCheckpoints: the optimizer's entry points (sharded_state_dict,
                        load_state_dict, save/load_parameter_state), mixed into the owner part and
                        the chain; everything below is reached through them or through job.py
    optimizer_state.py  the format itself: per-parameter ShardedTensors of masters, momenta and
                        AdamW moments, the record a load is checked against (CheckpointMismatchError)
    torch_format.py     the same tensors gathered to DP rank 0 (--ckpt-format torch)
    switch.py           a checkpoint of Megatron's own Muon loaded into DMuon, and back
    job.py              whole-job checkpoints in Megatron-LM's layout (iter_NNNNNNN, the tracker
                        file) for the main job, the tests and megatron-core loops

What the rest of the package uses is imported from here.
"""
from __future__ import annotations

from .job import (TRACKER, checkpoint_dir, checkpoint_problem, complete_iterations, latest_iteration,  # noqa: F401
                  load_checkpoint, resume_iteration, save_checkpoint)
from .optimizer_api import OwnerCheckpoints  # noqa: F401
from .optimizer_state import CheckpointMismatchError, local_pieces, model_state, unwrap  # noqa: F401
from .switch import dmuon_record_of, megatron_source, route_checkpoint_loads  # noqa: F401
