"""DMuon with --dmuon-update normuon / dion3 on real megatron-core (gloo, CPU) against the
single-process reference (testing/reference.py: the rule one matrix at a time, no sharding)."""
import pytest

from megatron_dmuon.testing.compare import full_params, rel_diffs, run_dmuon, run_reference

FP32_TOL = 1e-6


def _check(dp, **kw):
    results = run_dmuon(dp, **kw)
    ref = run_reference(dp, layouts=results[0]["layouts"], **kw)
    diffs = rel_diffs(full_params(results), ref["params"])  # also checks the DP replicas agree
    assert max(diffs.values()) <= FP32_TOL, diffs
    assert results[0]["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    # momentum and row second moments on owners only, exactly for what they own
    assert [r["muon_states"] for r in results] == [r["owned"] for r in results]
    assert [r["row_variance_states"] for r in results] == [r["owned"] for r in results]
    assert sum(r["owned"] for r in results) == ref["num_matrices"]
    assert results[0]["ns_counts"] == [ref["num_matrices"]] * kw["steps"]
    return results, ref


@pytest.mark.parametrize("dp,update,fraction", [(2, "dion3", 0.25), (4, "dion3", 0.5), (2, "normuon", 1.0)])
def test_row_rules_match_single_process_reference(dp, update, fraction):
    kw = dict(steps=4, grad_accum=2, muon_kw=dict(update=update, fraction=fraction, nesterov=False))
    results, ref = _check(dp, **kw)
    if update == "dion3" and dp == 2:  # the rule is really used: the run differs from plain Muon
        muon = run_reference(dp, layouts=results[0]["layouts"], **{**kw, "muon_kw": dict(nesterov=False)})
        assert max(rel_diffs(full_params(results), muon["params"]).values()) > 1e-3


def test_dion3_per_split_piece_matches_reference():
    # QKV cut per attention head (a stack of head matrices): rows are selected inside every head
    _check(2, steps=3, grad_accum=1, split="heads", muon_kw=dict(update="dion3", fraction=0.25, nesterov=False,
                                                                fraction_lr="inverse_sqrt"))
