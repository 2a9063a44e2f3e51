"""Switching optimizers mid-run (real megatron-core, gloo, CPU): Megatron's own LayerWise Muon
(``--optimizer muon --use-distributed-optimizer``, built as Megatron-LM wires it) trains, saves a
torch_dist checkpoint, and ``--optimizer dmuon`` loads it and trains on. Right after the load
DMuon's fp32 masters, Muon momenta, AdamW moments and step are bit-equal to LayerWise's at the
save; one step later the loss is bit-equal and the fp32 state within 1e-6 of the run that never
switched. Megatron's LayerWise runs only in
bf16 in megatron-core 0.19 (fp32 leaves its torch optimizer unwrapped), so the models are bf16;
the optimizer state compared is fp32."""
import os

import pytest

from megatron_dmuon.testing.compare import rel_diffs, state_diffs
from megatron_dmuon.testing.multiproc import run_distributed

WORKERS = "megatron_dmuon.testing.switch_workers"
# One step after the switch: the two NS implementations round apart by ~5e-8, which can move a bf16
# param by one ulp; from then on the bf16 forward/backward rounds differently and the runs part by
# ~1e-3 (chaotic bf16 arithmetic, not a rule difference), so later steps compare nothing exact.
COMMON = dict(resume_at=3, steps=4, shape_kw=dict(bf16=True), ns_dtype="float32")
BF16_PARAM_TOL = 2 ** -7


def _layerwise_or_skip():
    try:
        import emerging_optimizers  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):  # launch/setup_env.sh installs it: CI must run these tests
            raise
        pytest.skip(f"Megatron's Muon needs emerging_optimizers ({e}); launch/setup_env.sh installs it")


def _worst(d):
    return max(d.values())


def test_layerwise_checkpoint_continues_in_dmuon_at_dp2_and_dp1(tmp_path):
    _layerwise_or_skip()
    out = run_distributed(f"{WORKERS}:layerwise_to_dmuon", 2, kwargs=dict(COMMON, root=str(tmp_path)))[0]
    after = state_diffs(out["dmuon_after_load"], out["layerwise_at_save"])
    assert {k.rsplit(":", 1)[1] for k in after} == {"param", "momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    assert _worst(after) == 0.0, {k: v for k, v in after.items() if v}  # bit-equal right after the load
    never_switched = out["layerwise"]
    assert out["dmuon"]["losses"] == never_switched["losses"][3:]  # the loaded model, bit-equal
    params = rel_diffs(out["dmuon"]["params"], never_switched["params"])
    state = state_diffs(out["dmuon"]["state"], never_switched["state"])
    assert _worst(params) <= BF16_PARAM_TOL and _worst(state) <= 1e-6, (_worst(params), _worst(state))
    # the same checkpoint at DP=1 (the global batch of the DP=2 run); first a run whose Muon
    # momentum differs from the checkpoint's is refused, untouched
    one = run_distributed(f"{WORKERS}:dmuon_loads_layerwise", 1, kwargs=dict(
        COMMON, root=str(tmp_path), data_dp=2, refuse_kw=dict(muon_kw=dict(momentum=0.9))))[0]
    message, untouched = one["refused"]
    assert "CheckpointMismatchError" in message and "Muon momentum is [0.95]" in message, message
    assert "written by Megatron's own optimizer" in message and untouched
    assert _worst(state_diffs(one["dmuon_after_load"], out["layerwise_at_save"])) == 0.0
    assert one["dmuon"]["losses"] == pytest.approx(never_switched["losses"][3:], rel=1e-6)
    params = rel_diffs(one["dmuon"]["params"], never_switched["params"])
    state = state_diffs(one["dmuon"]["state"], never_switched["state"])
    assert _worst(params) <= BF16_PARAM_TOL and _worst(state) <= 1e-6, (_worst(params), _worst(state))


def test_dmuon_checkpoint_continues_in_megatrons_layerwise_muon(tmp_path):
    """The reverse: DMuon at DP=2 saves, Megatron's LayerWise Muon loads it (its own request, the
    Muon masters read from DMuon's key) and trains on; first a LayerWise run whose Muon momentum
    differs is refused, its params and masters untouched. One step after the switch: the fp32
    state within 1e-6 of the run that never switched (the two NS implementations round apart by
    ~5e-8, which can move a bf16 param by one ulp: params are compared within 2^-7)."""
    _layerwise_or_skip()
    out = run_distributed(f"{WORKERS}:dmuon_to_layerwise", 2, kwargs=dict(
        COMMON, root=str(tmp_path), refuse_kw=dict(muon_kw=dict(momentum=0.9))))[0]
    message, untouched = out["refused"]
    assert "CheckpointMismatchError" in message and "written by --optimizer dmuon" in message, message
    assert "Muon momentum is [0.95]" in message and untouched, message
    message, untouched = out["refused_adam"]  # Megatron's --optimizer adam: the matrices' kind differs
    assert "CheckpointMismatchError" in message and "is Muon in the checkpoint" in message and untouched, message
    after = state_diffs(out["layerwise_after_load"], out["dmuon_at_save"])
    assert {k.rsplit(":", 1)[1] for k in after} == {"param", "momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    assert _worst(after) == 0.0, {k: v for k, v in after.items() if v}  # bit-equal right after the load
    never_switched = out["dmuon"]
    assert out["layerwise"]["losses"] == never_switched["losses"][3:]  # the loaded model, bit-equal
    state = state_diffs(out["layerwise"]["state"], never_switched["state"])
    params = rel_diffs(out["layerwise"]["params"], never_switched["params"])
    assert _worst(state) <= 1e-6 and _worst(params) <= BF16_PARAM_TOL, (_worst(state), _worst(params))
