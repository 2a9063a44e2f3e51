"""DMuon optimizer checkpoints on real megatron-core (gloo, CPU): save, build a fresh (perturbed)
model and optimizer, load, train on, and compare parameters AND optimizer state (fp32 masters,
momentum, AdamW moments and step) with the uninterrupted run."""
import json
import os

import pytest

from megatron_dmuon.testing.compare import full_optimizer_state, full_params, rel_diffs, state_diffs
from megatron_dmuon.testing.multiproc import run_distributed
from tests import DATA

RESUME = "megatron_dmuon.testing.checkpoint_workers:dmuon_resume"
FP64 = dict(shape_kw=dict(fp64=True), ns_dtype="float64")


def _diffs(uninterrupted, resumed):
    params = rel_diffs(full_params(resumed), full_params(uninterrupted))
    state = state_diffs(full_optimizer_state(resumed), full_optimizer_state(uninterrupted))
    assert {k.rsplit(":", 1)[1] for k in state} == {"param", "momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    return max(params.values()), max(state.values())


def _bit_identical(world, **kw):
    out = run_distributed(RESUME, world, kwargs=dict(resume_at=3, steps=6, grad_accum=2, **kw))
    uninterrupted, resumed = [r["uninterrupted"] for r in out], [r["resumed"] for r in out]
    assert _diffs(uninterrupted, resumed) == (0.0, 0.0)
    assert resumed[0]["losses"] == uninterrupted[0]["losses"][3:]
    return uninterrupted, resumed


@pytest.mark.parametrize("world,kw", [
    (1, dict(freeze="final_layernorm")),  # frozen params: not in the optimizer, not in its state
    (2, dict(optimizer_only=True)),  # masters only: the publish must bring every replica the weights
], ids=["dp1_frozen", "dp2_optimizer_only"])
def test_resume_is_bit_identical(world, kw):
    _bit_identical(world, **kw)


def test_verify_resume_through_state_dict_cli(capsys):
    # the torch format: optimizer.state_dict() + save_parameter_state() (Megatron-LM --ckpt-format torch);
    # the CLI's main in this process, its ranks forked from the tests' fork server
    from megatron_dmuon.testing.verify_cli import main

    code = main(["--dp", "2", "--steps", "5", "--resume-at", "2", "--resume-format", "torch", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] and report["max_param_diff"] == 0.0 and report["max_state_diff"] == 0.0
    assert report["tolerance"] == 0.0 and report["format"] == "torch"


def test_dp4_overlap_resume_is_bit_identical_and_reshards_to_dp2(tmp_path):
    # DP=4 with overlapped grad reduce / param gather and several buckets: save, resume in place
    # (bit-identical); the same checkpoint then resumes at DP=2 (another owner plan: resharded)
    common = dict(resume_at=3, steps=5, grad_accum=2, **FP64)
    saved = run_distributed(RESUME, 4, kwargs=dict(common, save_dir=str(tmp_path), overlap=True, bucket_size=6000))
    uninterrupted = [r["uninterrupted"] for r in saved]
    assert _diffs(uninterrupted, [r["resumed"] for r in saved]) == (0.0, 0.0)
    resumed = run_distributed(RESUME, 2, kwargs=dict(common, load_dir=str(tmp_path), data_dp=4))
    worst_params, worst_state = _diffs(uninterrupted, [r["resumed"] for r in resumed])
    assert worst_params <= 1e-10 and worst_state <= 1e-10, (worst_params, worst_state)  # acceptance: 1e-6
    assert uninterrupted[0]["layouts"] != resumed[0]["resumed"]["layouts"]  # really another plan


def test_a_checkpoint_written_before_the_plan_object_loads(tmp_path):
    # tests/data/ckpt_before_plan_dp2_fp64: written at step 3 of 5 by the code before DMuonPlan (commit
    # 3156eae: the record holds the owner layouts, no 'dmuon_plans'; owners planned by another cost)
    import shutil

    fixture = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "ckpt_before_plan_dp2_fp64"), fixture)
    common = dict(resume_at=3, steps=5, grad_accum=2, ns_dtype="float64",
                  shape_kw=dict(fp64=True, num_layers=1, hidden_size=32, ffn_hidden_size=64))
    now = run_distributed(RESUME, 2, kwargs=dict(common, resume_here=False))
    resumed = run_distributed(RESUME, 2, kwargs=dict(common, load_dir=str(fixture)))
    worst_params, worst_state = _diffs([r["uninterrupted"] for r in now], [r["resumed"] for r in resumed])
    assert worst_params <= 1e-10 and worst_state <= 1e-10, (worst_params, worst_state)


def test_tp2_to_tp1_reshards(tmp_path):
    common = dict(resume_at=3, steps=5, grad_accum=2, **FP64)
    saved = run_distributed(RESUME, 2, kwargs=dict(common, tp=2, save_dir=str(tmp_path), resume_here=False))
    resumed = run_distributed(RESUME, 1, kwargs=dict(common, load_dir=str(tmp_path)))
    worst_params, worst_state = _diffs([r["uninterrupted"] for r in saved], [r["resumed"] for r in resumed])
    assert worst_params <= 1e-10 and worst_state <= 1e-10, (worst_params, worst_state)


def test_interleaved_pipeline_resumes_bit_identically_and_reshards_to_one_virtual_stage(tmp_path):
    # PP=2 x VPP=2 x DP=2, fp32, overlap flags (param all-gathers aligned to the schedule, as
    # Megatron-LM runs the interleaved schedule): save ('model0'/'model1' chunks), resume in place
    # bit-identically; the same checkpoint resumes at VPP=1 (every layer on another chunk, owners
    # re-planned). Bit-identical too: the math does not change, and two DP ranks' sums are order-free
    common = dict(resume_at=3, steps=6, grad_accum=2, pp=2, shape_kw=dict(num_layers=4))
    saved = run_distributed(RESUME, 4, kwargs=dict(common, vpp=2, save_dir=str(tmp_path), overlap=True,
                                                   bucket_size=6000, align_param_gather=True))
    uninterrupted = [r["uninterrupted"] for r in saved]
    assert _diffs(uninterrupted, [r["resumed"] for r in saved]) == (0.0, 0.0)
    resumed = run_distributed(RESUME, 4, kwargs=dict(common, vpp=1, load_dir=str(tmp_path)))
    assert _diffs(uninterrupted, [r["resumed"] for r in resumed]) == (0.0, 0.0)
    assert len(uninterrupted[0]["owners"]) == 2 and len(resumed[0]["resumed"]["owners"]) == 1  # chunks: 2 -> 1


def test_bad_loads_fail_loudly_and_touch_nothing(tmp_path):
    out = run_distributed("megatron_dmuon.testing.checkpoint_workers:checkpoint_bad_loads", 2, kwargs=dict(root=str(tmp_path)))
    for rank_result in out:  # every rank raises (none is left waiting in a collective)
        other, adam, truncated = rank_result["other_model"], rank_result["adam_checkpoint"], rank_result["truncated_file"]
        assert "CheckpointMismatchError" in other[0] and "different model" in other[0], other[0]
        assert "decoder.layers" in other[0] and "not in the checkpoint" in other[0]
        assert "not a DMuon optimizer checkpoint" in adam[0], adam[0]
        assert truncated[0] is not None and "corrupt/iter_0000002" in truncated[0], truncated[0]  # names it
        rule = rank_result["other_update"]
        assert "CheckpointMismatchError" in rule[0] and "saved with --dmuon-update muon" in rule[0], rule[0]
        assert other[1] and adam[1] and truncated[1] and rule[1]  # params and optimizer state untouched
    assert os.path.isdir(tmp_path / "dmuon")


def test_checkpoint_tracker_and_directory_errors(tmp_path):
    from megatron_dmuon.megatron.checkpoint import job as checkpoint_io
    from megatron_dmuon.megatron.checkpoint.optimizer_state import CheckpointMismatchError

    assert checkpoint_io.latest_iteration(str(tmp_path)) is None  # no checkpoint: a fresh start
    (tmp_path / checkpoint_io.TRACKER).write_text("5\n")
    assert checkpoint_io.latest_iteration(str(tmp_path)) == 5
    (tmp_path / checkpoint_io.TRACKER).write_text("\x00garbage")
    with pytest.raises(CheckpointMismatchError, match="is corrupt"):
        checkpoint_io.latest_iteration(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a complete dist checkpoint"):
        checkpoint_io.load_checkpoint(str(tmp_path / "iter_0000005"), [], None)
