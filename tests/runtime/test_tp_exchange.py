"""DMuon under tensor, pipeline and expert parallelism on real megatron-core (gloo, CPU) against
the TP=PP=EP=1 single-process reference.

These runs are float64 (Megatron's fp32 code path carrying float64; see testing/cpu_shim): a TP
or EP forward sums in another order than TP=1, and in fp32 Newton-Schulz amplifies that noise to
~1e-4 within 10 steps (measured: 8e-5 at TP=2; Megatron's own AdamW differs by 1.3e-6 after one
step), which would hide real bugs of that size. In float64 the runs agree to ~1e-13."""
import pytest

from megatron_dmuon.testing.compare import full_params, rel_diffs, run_dmuon, run_reference

FP64 = dict(ns_dtype="float64")
TOL = 1e-10
MOE = dict(num_experts=4)
GQA = dict(hidden_size=64, num_attention_heads=8, num_query_groups=2)  # TP = num_query_groups = 2

LAYOUTS = {  # name: (world size, run kwargs)
    "dp2_tp2": (4, dict(tp=2)),
    "dp1_tp2": (2, dict(tp=2)),
    "dp2_pp2": (4, dict(pp=2)),
    "dp2_ep2": (2, dict(ep=2, shape=MOE)),
    "gqa_tp2_split_qkv": (2, dict(tp=2, shape=GQA, split="qkv")),
}


def _kw(spec, overlap=False, **extra):
    spec = dict(spec)
    shape = dict(spec.pop("shape", {}), fp64=True)
    kw = {**dict(steps=10, grad_accum=2, shape_kw=shape, overlap=overlap, **FP64), **spec, **extra}
    if overlap:
        kw["bucket_size"] = 6000  # several owner-aligned buckets
    return kw


_REFERENCES: dict = {}  # one reference run per (DP size, what the reference reads): the layouts and overlap modes share it


def _reference(dp, kw):
    import json

    from megatron_dmuon.testing.workers import RUN_ONLY

    key = json.dumps([dp, {k: v for k, v in kw.items() if k not in RUN_ONLY}], sort_keys=True, default=str)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_reference(dp, **kw)
    return _REFERENCES[key]


def _check(results, kw, world, tol=TOL):
    dp = world // (kw.get("tp", 1) * kw.get("pp", 1))
    ref = _reference(dp, kw)
    diffs = rel_diffs(full_params(results), ref["params"])
    assert max(diffs.values()) <= tol, sorted(diffs.items(), key=lambda x: -x[1])[:3]
    assert results[0]["losses"] == pytest.approx(ref["losses"], rel=max(tol, 1e-10))
    # every logical matrix orthogonalized exactly once per step across the whole world
    assert results[0]["ns_counts"] == [ref["num_matrices"]] * kw["steps"]
    # Muon momentum only where the plan puts it (DP owner: every TP shard; replicated: TP owner)
    assert [r["muon_states"] for r in results] == [r["owned"] for r in results]
    return ref, diffs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_single_process_reference(layout, overlap):
    world, spec = LAYOUTS[layout]
    kw = _kw(spec, overlap)
    results = run_dmuon(world, **kw)
    _check(results, kw, world)
    if kw.get("tp", 1) > 1:
        assert all(r["tp_bytes"] > 0 for r in results)  # shards really travelled to their TP owners


def test_per_shard_orthogonalization_is_not_muon_but_dmuon_is():
    # Megatron's 'blockwise' TP mode orthogonalizes each TP shard: the result depends on TP
    kw = _kw(dict(tp=2), steps=4)
    blockwise = run_dmuon(2, blockwise=True, **kw)
    dmuon = run_dmuon(2, **kw)
    ref = run_reference(1, **kw)
    worst_blockwise = max(rel_diffs(full_params(blockwise), ref["params"]).values())
    worst_dmuon = max(rel_diffs(full_params(dmuon), ref["params"]).values())
    assert worst_blockwise > 1e-3, worst_blockwise
    assert worst_dmuon <= TOL, worst_dmuon


def test_tp2_dp2_equals_torch_optim_muon_and_adamw():
    # independent of the project's math: torch.optim.Muon (bf16 Keller NS, 'original' lr scale,
    # Nesterov, momentum 0.95) on the matrices + torch.optim.AdamW on the rest, unwrapped model
    kw = _kw(dict(tp=2), ns_dtype="bfloat16", muon_kw=dict(momentum=0.95, nesterov=True))
    results = run_dmuon(4, **kw)
    ref = run_reference(2, rules="torch_optim", **kw)
    diffs = rel_diffs(full_params(results), ref["params"])
    assert max(diffs.values()) <= 1e-5, sorted(diffs.items(), key=lambda x: -x[1])[:3]


@pytest.mark.parametrize("tp_method,coefficients", [("gather", "keller"), ("distributed_gram", "keller"),
                                                    ("distributed_gram", "adaptive")])
def test_tp_methods_both_exact(tp_method, coefficients):
    # distributed Gram NS across the TP group (only m x m Gram matrices travel) and gather-to-owner
    # give the reference's Gram-NS result; distributed Gram moves fewer bytes on these shapes.
    # 'adaptive': the quartic rescale runs on the TP owner that holds the summed R (gram_to_q)
    kw = _kw(dict(tp=2), steps=4, coefficients=coefficients, muon_kw=dict(ns_method="gram", tp_method=tp_method))
    results = run_dmuon(2, **kw)
    _check(results, kw, 2)
    if tp_method == "distributed_gram" and coefficients == "keller":
        results_gather = run_dmuon(2, **_kw(dict(tp=2), steps=1, muon_kw=dict(ns_method="gram", tp_method="gather")))
        assert results[0]["tp_bytes"] < results_gather[0]["tp_bytes"] / 4


@pytest.mark.parametrize("split", ["glu", "heads"])
def test_split_rules_on_merged_tp_shards(split):
    # GLU fc1 (stride-2 shards [gate_i; up_i]) and per-head QKV pieces are cut from the merged
    # canonical matrix on the TP owner, whatever the TP size
    kw = _kw(dict(tp=2, split=split), steps=6)
    _check(run_dmuon(2, **kw), kw, 2)


def test_pipeline_grad_norm_and_clipping_span_all_stages():
    # Megatron's grad norm sums over every stage; clipping then scales both stages alike. Megatron
    # reduces the norm in fp32 even here (its multi-tensor l2norm), so the clip coefficient carries
    # fp32 rounding (~1e-7) into the float64 run: parameters agree to that, not to 1e-10
    kw = _kw(dict(pp=2), steps=4, clip_grad=0.5)
    results = run_dmuon(2, **kw)
    ref, _ = _check(results, kw, 2, tol=1e-7)
    assert results[0]["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-6)
    assert max(ref["grad_norms"]) > 0.5  # clipping really happened


def test_clipping_in_the_tp_owner_step_is_megatrons_bit_for_bit():
    # under TP the owner step scales the grads before the exchange (one foreach pass) instead of
    # Megatron's clip; the same bits either way
    import torch

    kw = _kw(dict(tp=2), steps=3, clip_grad=0.5)
    folded, megatron = run_dmuon(2, **kw), run_dmuon(2, fold_clipping=False, **kw)
    assert min(folded[0]["grad_norms"]) > 0.5
    a, b = full_params(folded), full_params(megatron)
    assert all(torch.equal(a[n], b[n]) for n in b)


# ------------------------------------------------------------------ interleaved pipeline (VPP)
# PP=2 x VPP=2 x DP=2: every rank holds two model chunks (layers v x 2 + p), each in its own
# DMuonDDP with its own plan; Megatron's interleaved 1F1B schedule. These run in fp32: pipeline
# stages pass on the fp32 values one process computes and two DP ranks' sum is order-free, so the
# acceptance bound of 1e-6 is meaningful (measured: 0, bit-identical).
VPP = dict(pp=2, vpp=2, steps=10, grad_accum=2, shape_kw=dict(num_layers=4))
VPP_OVERLAP = {"sync": {}, "overlap_prehooks": dict(overlap=True, bucket_size=6000),
               "overlap_aligned": dict(overlap=True, bucket_size=6000, align_param_gather=True)}


@pytest.fixture(scope="module")
def vpp_reference():
    return run_reference(2, **VPP)


@pytest.mark.parametrize("flags", list(VPP_OVERLAP))
def test_interleaved_pipeline_matches_the_reference_in_fp32(flags, vpp_reference):
    # without overlap; with --overlap-grad-reduce/--overlap-param-gather through each chunk's
    # forward pre-hooks; and with the param all-gathers started by the schedule per chunk
    # (config.param_sync_func, Megatron-LM's align_param_gather under the interleaved schedule)
    from megatron_dmuon.testing.compare import orthogonalized_once

    results = run_dmuon(4, **VPP, **VPP_OVERLAP[flags])
    diffs = rel_diffs(full_params(results), vpp_reference["params"])
    assert max(diffs.values()) <= 1e-6, sorted(diffs.items(), key=lambda x: -x[1])[:3]
    assert orthogonalized_once(results, vpp_reference["num_matrices"], VPP["steps"])
    assert vpp_reference["num_matrices"] == 16  # 4 layers x 4 matrices, over 2 chunks x 2 stages
    assert [r["muon_states"] for r in results] == [r["owned"] for r in results]
    assert all(len(r["owners"]) == 2 for r in results)  # one plan per chunk (a dense buffer each)


def test_interleaved_pipeline_equals_torch_optim_with_clipping_over_every_chunk():
    # independent of the project's math (torch.optim.Muon + torch.optim.AdamW on the unwrapped
    # model, layers named by their global index), with clipping: the grad norm spans both chunks of
    # both stages (Megatron's), and clipping scales them all alike
    kw = dict(VPP, steps=6, ns_dtype="bfloat16", clip_grad=0.5, muon_kw=dict(momentum=0.95, nesterov=True))
    results = run_dmuon(4, **kw)
    ref = run_reference(2, rules="torch_optim", **kw)
    assert results[0]["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-6)
    assert min(ref["grad_norms"]) > 0.5  # clipping in every step
    diffs = rel_diffs(full_params(results), ref["params"])
    assert max(diffs.values()) <= 1e-5, sorted(diffs.items(), key=lambda x: -x[1])[:3]
