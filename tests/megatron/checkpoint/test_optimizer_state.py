"""The DMuon optimizer checkpoint's record and pieces (megatron/checkpoint/optimizer_state.py): what it
refuses by name before anything loads (docs/bad_input.md rows 5, 9, 13, 15) and how it cuts a state into
Megatron's sharded tensors. Multi-process saves and loads: test_job.py."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_dmuon.megatron.checkpoint import optimizer_state as ckpt
from megatron_dmuon.runtime.owner_step import OwnerMuonAdamW


def _record(**params):
    return {"format": ckpt.FORMAT, "parallel": {"dp": 2}, "plans": {}, "adam_step": 3.0,
            "params": {k: list(v) for k, v in params.items()}}


def test_checkpoint_record_mismatches_are_named():
    now = {"params": {"w@0": [[8, 8], "muon"], "b": [[8], "adamw"]}}
    assert ckpt.check_record(_record(**{"w@0": ([8, 8], "muon"), "b": ([8], "adamw")}), now) is None
    cases = {
        "different shape": (_record(**{"w@0": ([8, 16], "muon"), "b": ([8], "adamw")}), "w@0 has shape (8, 8), the checkpoint (8, 16)"),
        "other kind": (_record(**{"w@0": ([8, 8], "adamw"), "b": ([8], "adamw")}), "w@0 is muon now, adamw in the checkpoint"),
        "missing param": (_record(b=([8], "adamw")), "w@0 is not in the checkpoint"),
        "extra param": (_record(**{"w@0": ([8, 8], "muon"), "b": ([8], "adamw"), "w@1": ([8, 8], "muon")}),
                        "1 params this model lacks, e.g. w@1"),
        "not dmuon": (None, "not a DMuon optimizer checkpoint"),
        "other format": ({"format": "megatron"}, "found 'megatron'"),
    }
    for name, (record, message) in cases.items():
        error = ckpt.check_record(record, now)
        assert error is not None and message in error, (name, error)


def test_corrupt_owner_plan_in_a_checkpoint_is_named():
    record = _record(b=([8], "adamw"))
    record["plans"] = {"pp0/chunk0/dense/torch.float32": '{"world_size": 2, "param_ranges": '}
    error = ckpt.check_record(record, {"params": {"b": [[8], "adamw"]}})
    assert "owner plan 'pp0/chunk0/dense/torch.float32' is corrupt" in error
    record["plans"] = ["not", "a", "mapping"]
    assert "field 'plans'" in ckpt.check_record(record, {"params": {}})


@pytest.mark.parametrize("kind", ["fsdp_dtensor", "dp_zero_gather_scatter"])
def test_unsupported_optimizer_sharding_type(kind):
    with pytest.raises(ValueError, match=f"sharding type '{kind}' is not supported"):
        ckpt._check_sharding_type({"distrib_optim_sharding_type": kind})
    for served in ckpt.SERVED_SHARDING_TYPES:
        ckpt._check_sharding_type({"distrib_optim_sharding_type": served})


def test_a_state_with_diverged_adamw_steps_is_not_checkpointed():
    v, w = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    inner = OwnerMuonAdamW([{"params": [v, w], "use_muon": False}], lr=0.1, weight_decay=0.0)
    inner.init_state()
    v.grad = torch.ones(4)  # w had no grad: torch AdamW does not step it
    inner.step()
    part = SimpleNamespace(optimizer=inner, grad_scaler=None)
    with pytest.raises(ValueError, match=r"AdamW step counts differ between params \(\[0.0, 1.0\]\)"):
        ckpt.optimizer_state_dict([part])


@pytest.mark.parametrize("shape,start,end", [((7,), 2, 5), ((5, 6), 3, 27), ((5, 6), 6, 18), ((5, 6), 7, 9),
                                             ((3, 4, 5), 7, 53), ((3, 4, 5), 0, 60), ((2, 3), 0, 0)])
def test_flat_blocks_cover_a_flat_slice_exactly(shape, start, end):
    # an element-wise param's DP slice becomes a few hyper-rectangles (irregular ShardedTensors)
    full = torch.arange(int(np.prod(shape))).view(shape)
    covered = []
    for offset, block, a, b in ckpt.flat_blocks(shape, start, end):
        index = tuple(slice(o, o + s) for o, s in zip(offset, block))
        assert torch.equal(full[index].reshape(-1), torch.arange(a, b))
        covered.append((a, b))
    assert covered == sorted(covered) and sum(b - a for a, b in covered) == end - start
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(covered, covered[1:]))
    assert len(covered) <= 2 * len(shape) - 1


def test_tp_replicated_momentum_is_written_by_its_tp_owner_only():
    sh = SimpleNamespace(key="router.weight", replica_id=(0, 1, 3))  # TP rank 1's replica of the model param
    owner = ckpt.Piece(None, 0, 16, {}, muon=True, holds_momentum=True)
    other = ckpt.Piece(None, 0, 16, {}, muon=True, holds_momentum=False)
    assert ckpt._replica_id(sh, owner, "momentum_buffer", tp_rank=1) == (0, 0, 0)  # main replica
    assert ckpt._replica_id(sh, other, "momentum_buffer", tp_rank=0) == (0, 1, 0)  # a replica, not written
    assert ckpt._replica_id(sh, owner, "param", tp_rank=1) == (0, 1, 0)  # masters: the model's TP replica id
