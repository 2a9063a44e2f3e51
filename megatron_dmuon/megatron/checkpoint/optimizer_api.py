"""The optimizer's checkpoint entry points in DMuon's per-parameter format, once for a single
owner part (``DMuonDistributedOptimizer``) and the chain of them (``DMuonChainedOptimizer``, whose
load may split dense and expert params differently from the save): optimizer_state.py does the
work, switch.py reads a checkpoint of Megatron's own Muon. A load's state between its request and
its read is one explicit ``CheckpointLoad``, held by the optimizer the load goes through."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from . import optimizer_state as ckpt
from . import switch, torch_format
from ..overlap_hooks import finish_parts


class LoadRequest(NamedTuple):
    """What a load's request (``sharded_state_dict(is_loading=True)``) was built from, which its
    read checks the checkpoint against: this run's record, each model param's checkpoint id, and
    the Megatron Muon checkpoint whose names it asked for (None: DMuon's own)."""
    record: dict
    param_ids: dict
    megatron_source: Optional[dict]


@dataclasses.dataclass
class CheckpointLoad:
    """One optimizer load in progress: before the read, ``switch.prepare_load`` may find Megatron's
    own Muon checkpoint there (``megatron_source``: the request then asks for Megatron's names); the
    request notes what it was built from (``note_request``); the read takes it (``take_request``),
    which ends the load. Every load goes request -> read through the same optimizer object (job.py,
    Megatron-LM's and Megatron-Bridge's loops), which holds this."""
    megatron_source: Optional[dict] = None
    request: Optional[LoadRequest] = None

    def note_request(self, record: dict, param_ids: dict) -> None:
        self.request = LoadRequest(record, param_ids, self.megatron_source)

    def take_request(self) -> Optional[LoadRequest]:
        """The request of this load, once; the load is over (a next one starts clean)."""
        request = self.request
        self.reset()
        return request

    def reset(self) -> None:
        self.megatron_source = self.request = None


class OwnerCheckpoints:
    """Mixed in before a Megatron optimizer class. ``_checkpoint_parts()``: the owner parts to
    save and load together, or None to keep Megatron's own code (the gather_then_compute baseline).
    ``checkpoint_load``: the load in progress through this optimizer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_load = CheckpointLoad()

    def _checkpoint_parts(self):
        raise NotImplementedError

    def _parts_finished(self):
        """The owner parts, their overlapped steps finished (--dmuon-overlap-step): a checkpoint
        reads and writes the masters and momenta."""
        parts = self._checkpoint_parts()
        if parts:
            finish_parts(parts)
        return parts

    def state_dict(self):
        parts = self._parts_finished()
        return ckpt.optimizer_state_dict(parts) if parts else super().state_dict()

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           sharding_type: Optional[str] = None, metadata: Optional[dict] = None, **kwargs):
        parts = self._parts_finished()
        if not parts:
            return super().sharded_state_dict(model_sharded_state_dict, is_loading, sharding_type=sharding_type,
                                              metadata=metadata, **kwargs)
        if is_loading:  # Megatron-LM's own load: the checkpoint it noted may be Megatron's Muon
            switch.prepare_noted_load(parts, self.checkpoint_load, model_sharded_state_dict)
        return ckpt.sharded_optimizer_state(parts, model_sharded_state_dict, is_loading, metadata, sharding_type,
                                            load=self.checkpoint_load)

    def load_state_dict(self, state_dict):
        parts = self._parts_finished()
        if not parts:
            return super().load_state_dict(state_dict)
        return switch.load_optimizer_state(parts, self.checkpoint_load.take_request(), state_dict)

    def save_parameter_state(self, filename: str):
        parts = self._parts_finished()
        return torch_format.save_param_state_file(parts, filename) if parts else super().save_parameter_state(filename)

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False):
        parts = self._parts_finished()
        if not parts:
            return super().load_parameter_state(filename, update_legacy_format=update_legacy_format)
        return torch_format.load_param_state_file(parts, filename)
