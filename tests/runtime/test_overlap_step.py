"""`--dmuon-overlap-step` on real megatron-core (gloo, CPU): each bucket group's Newton–Schulz
finished in the next forward's param-sync hook ('on') gives bit for bit the updates of the same
per-bucket-group stacks run inside the step ('sync'), under DP with several buckets, PP with
virtual stages, EP, and across a checkpoint saved and resumed mid-run; and it agrees with the
default step ('off', one stack per shape) to rounding."""
import pytest
import torch

from megatron_dmuon.testing.compare import full_params, rel_diffs
from megatron_dmuon.testing.multiproc import run_distributed, run_main_job

WORKER = "megatron_dmuon.testing.overlap_workers:overlap_step_variants"
CHECK = {"ns_check_interval": 2}  # the online NS check on every other step: its host sync and report under 'on' too
VARIANTS = {"off": CHECK, "sync": {"overlap_step": "sync", **CHECK}, "on": {"overlap_step": "on", **CHECK}}
BASE = dict(steps=6, grad_accum=2, overlap=True, bucket_size=2000, clip_grad=1.0, shape_kw=dict(num_layers=4))


def _variants(world, **kw):
    results = run_distributed(WORKER, world, kwargs=dict(variants=VARIANTS, **{**BASE, **kw}))
    return {name: [r[name] for r in results] for name in results[0]}


def _assert_bitwise(a, b):
    pa, pb = full_params(a), full_params(b)
    assert set(pa) == set(pb)
    differ = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not differ, differ[:5]
    assert a[0]["losses"] == b[0]["losses"] and a[0]["grad_norms"] == b[0]["grad_norms"]


def _check(runs, min_groups=2):
    _assert_bitwise(runs["on"], runs["sync"])
    # every group was finished by the forward's param-sync hooks (or the last forced sync), none by the next step
    assert all(r["pending_after"] == 0 and r["groups_left"] == 0 for r in runs["on"])
    assert runs["on"][0]["ns_checked"] == runs["sync"][0]["ns_checked"] > 0  # the checks ran and were reported
    assert all(len(r["needs"]) >= min_groups for r in runs["on"])  # the stacks really were cut per bucket group
    assert all(r["needs"] in ([0], []) for r in runs["off"])
    diffs = rel_diffs(full_params(runs["on"]), full_params(runs["off"]))
    assert max(diffs.values()) < 1e-5, max(diffs.values())  # fp32: only the stack sizes differ
    assert runs["on"][0]["losses"] == pytest.approx(runs["off"][0]["losses"], rel=1e-5)


def test_overlap_step_dp2_several_buckets_and_resume(tmp_path):
    runs = _variants(2, resume=("on", 3, str(tmp_path)))
    _check(runs)
    # resumed mid-run (the checkpoint finished the groups in flight first): the same run, bit for bit
    resumed, whole = full_params(runs["on+resumed"]), full_params(runs["on"])
    assert all(torch.equal(resumed[n], whole[n]) for n in whole)
    assert runs["on+resumed"][0]["losses"] == runs["on"][0]["losses"][3:]


BACKWARD = {"sync": {"overlap_step": "sync", **CHECK}, "backward": {"overlap_step": "backward", **CHECK}}


def test_backward_start_equals_its_sync_twin_skips_and_resumes(tmp_path):
    """--dmuon-overlap-step backward (--clip-grad 0): each bucket group's momentum and NS start in
    the last micro-batch's backward when Megatron launches its grad reduce. Bit for bit the
    same-cut stacks run inside the step ('sync'), at DP=2 with several groups per rank; a NaN
    grad on one rank at step 3 skips that step on both runs with nothing changed (the momenta the
    backward had already overwritten are restored); a checkpoint at step 4 resumes bit for bit."""
    results = run_distributed(WORKER, 2, kwargs=dict(variants=BACKWARD, **{**BASE, "clip_grad": 0.0, "nan_at": (3, 1)},
                                                     resume=("backward", 4, str(tmp_path))))
    runs = {name: [r[name] for r in results] for name in results[0]}
    _assert_bitwise(runs["backward"], runs["sync"])
    assert all(r["skipped_iterations"] == 1 for name in ("backward", "sync") for r in runs[name])
    assert all(r["pending_after"] == 0 and r["groups_left"] == 0 and len(r["needs"]) >= 2 for r in runs["backward"])
    # every group of every step (the skipped one too) started in the backward (iteration 1 as well:
    # Megatron's first reduce starts at the step's finalize, through the same hook), none in the step
    assert all(r["groups_early"] == BASE["steps"] * len(r["needs"]) for r in runs["backward"]), \
        [r["groups_early"] for r in runs["backward"]]
    assert all(r["groups_early"] == 0 for r in runs["sync"])
    resumed, whole = full_params(runs["backward+resumed"]), full_params(runs["backward"])
    assert all(torch.equal(resumed[n], whole[n]) for n in whole)
    assert runs["backward+resumed"][0]["losses"] == runs["backward"][0]["losses"][4:]


def test_backward_start_under_clipping_is_kept_or_redone():
    """With --clip-grad on, the backward starts every group unclipped, speculatively: a step whose
    clipping does not fire keeps it, one whose clipping fires restores the momenta and redoes the
    groups clipped in the step. Bit for bit 'sync' either way (threshold 1.35: these grad norms run
    1.07-1.46, so both happen)."""
    results = run_distributed(WORKER, 2, kwargs=dict(variants=BACKWARD, **{**BASE, "clip_grad": 1.35}))
    runs = {name: [r[name] for r in results] for name in results[0]}
    _assert_bitwise(runs["backward"], runs["sync"])
    norms = runs["sync"][0]["grad_norms"]
    clipped = sum(n > 1.35 for n in norms)
    assert 0 < clipped < len(norms), norms
    assert all(r["redos"] == clipped * len(r["needs"]) for r in runs["backward"]), [r["redos"] for r in runs["backward"]]


@pytest.mark.parametrize("layout", [dict(pp=2, vpp=2, align_param_gather=True),
                                    dict(ep=2, shape_kw=dict(num_layers=4, num_experts=4))], ids=["pp2_vpp2", "ep2_moe"])
def test_backward_start_under_pp_vpp_and_ep(layout):
    """The backward start where the pipeline schedule (virtual stages) or the expert buffers launch
    the grad reduces: bit for bit its 'sync' twin, every group started in a backward."""
    results = run_distributed(WORKER, 2, kwargs=dict(variants=BACKWARD, **{**BASE, "clip_grad": 0.0, **layout}))
    runs = {name: [r[name] for r in results] for name in results[0]}
    _assert_bitwise(runs["backward"], runs["sync"])
    assert all(r["groups_early"] == BASE["steps"] * len(r["needs"]) > 0 for r in runs["backward"])


def test_overlap_step_pp2_virtual_stages():
    _check(_variants(2, pp=2, vpp=2, align_param_gather=True))


def test_overlap_step_ep2_moe():
    _check(_variants(2, ep=2, shape_kw=dict(num_layers=4, num_experts=4)))


@pytest.mark.parametrize("mode", ["on", "backward"])
def test_overlap_step_matches_the_single_process_reference_in_float64(mode):
    """The overlapped step (and its start in the backward) against the TP=PP=EP=1 single-process
    reference on real megatron-core (float64, as tests/runtime/test_tp_exchange.py: only the reduce
    order differs, ~1e-13)."""
    from megatron_dmuon.testing.compare import run_dmuon, run_reference

    kw = dict(steps=6, grad_accum=2, overlap=True, bucket_size=2000, ns_dtype="float64",
              shape_kw=dict(num_layers=4, fp64=True), muon_kw={"overlap_step": mode})
    results = run_dmuon(2, **kw)
    ref = run_reference(2, layouts=results[0]["layouts"], **kw)
    diffs = rel_diffs(full_params(results), ref["params"])
    assert max(diffs.values()) <= 1e-10, sorted(diffs.items(), key=lambda x: -x[1])[:3]
    assert results[0]["losses"] == pytest.approx(ref["losses"], rel=1e-10)


@pytest.mark.parametrize("extra", [dict(publish_dtype="fp8_e4m3", shape_kw=dict(num_layers=4, bf16=True)),
                                   dict(ranks_per_node=1)], ids=["fp8_publish", "two_level"])
def test_overlap_step_composes_with_the_other_bucket_group_extensions(extra):
    """The FP8 publish and the two-level groups also extend Megatron's bucket groups: the group is
    finished before their pack / two-level all-gather, bit for bit as its sync twin."""
    runs = _variants(2, **extra)
    _assert_bitwise(runs["on"], runs["sync"])
    assert all(r["pending_after"] == 0 and r["groups_left"] == 0 and len(r["needs"]) >= 2 for r in runs["on"])


def _main_job(tmp_path, mode, *extra):
    import json

    out = tmp_path / f"{mode}.json"
    proc = run_main_job(["--train-iters", "6", "--log-interval", "1", "--seq-length", "64", "--dmuon-overlap-step", mode,
                         "--overlap-param-gather", "--timing-json", str(out), *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_main_job_overlap_on_equals_sync_and_profiles_whole_iterations(tmp_path):
    """The README's main job (CPU, DP=2) under 'on' and 'sync': the same loss lines to the last digit;
    --profile-iterations 2 profiles iterations 3 and 4 whole, so the NS launched by step 3 and the
    finishing of its groups in iteration 4's forward are both in the table and the trace."""
    trace = tmp_path / "iterations.json"
    on, on_summary = _main_job(tmp_path, "on", "--profile-optimizer-at", "3", "--profile-iterations", "2",
                               "--profile-out", str(trace))
    sync, _ = _main_job(tmp_path, "sync")

    def losses(stdout):
        return [line.split("lm loss:")[1].split("|")[0] for line in stdout.splitlines() if "lm loss:" in line]

    assert len(losses(on)) == 6 and losses(on) == losses(sync)
    table = on.split("> profile of iterations 3..4", 1)[1]
    assert "> profile of the optimizer step" not in on  # the whole iterations, not the step alone
    assert all(f" {phase} " in table for phase in ("dmuon.ns_launch", "dmuon.finish_group", "dmuon.momentum"))
    events = {e.get("name") for e in __import__("json").loads(trace.read_text())["traceEvents"]}
    assert {"dmuon.ns_launch", "dmuon.finish_group"} <= events
    assert on_summary["summary"]["last_loss"] < on_summary["summary"]["first_loss"]
