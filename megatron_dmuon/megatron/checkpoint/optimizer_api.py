"""The optimizer's checkpoint entry points in DMuon's per-parameter format, once for a single
owner part (``DMuonDistributedOptimizer``) and the chain of them (``DMuonChainedOptimizer``, whose
load may split dense and expert params differently from the save): optimizer_state.py does the
work, switch.py reads a checkpoint of Megatron's own Muon."""
from __future__ import annotations

from typing import Optional

from . import optimizer_state as ckpt
from . import switch, torch_format
from ..overlap_step import finish_parts


class OwnerCheckpoints:
    """Mixed in before a Megatron optimizer class. ``_checkpoint_parts()``: the owner parts to
    save and load together, or None to keep Megatron's own code (the gather_then_compute baseline)."""

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
            switch.prepare_noted_load(parts, model_sharded_state_dict)
        return ckpt.sharded_optimizer_state(parts, model_sharded_state_dict, is_loading, metadata, sharding_type)

    def load_state_dict(self, state_dict):
        parts = self._parts_finished()
        return switch.load_optimizer_state(parts, state_dict) if parts else super().load_state_dict(state_dict)

    def save_parameter_state(self, filename: str):
        parts = self._parts_finished()
        return torch_format.save_param_state_file(parts, filename) if parts else super().save_parameter_state(filename)

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False):
        parts = self._parts_finished()
        if not parts:
            return super().load_parameter_state(filename, update_legacy_format=update_legacy_format)
        return torch_format.load_param_state_file(parts, filename)
