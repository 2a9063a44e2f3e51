"""DMuon with --dmuon-update normuon / dion3 on real megatron-core (gloo, CPU) against the
single-process reference (testing/reference.py: the rule one matrix at a time, no sharding)."""
import json
import subprocess
import sys

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


# NorMuon at DP=2 is checked by test_dmuon_verify_cli_passes_for_row_rules
@pytest.mark.parametrize("dp,update,fraction", [(2, "dion3", 0.25), (4, "dion3", 0.5)])
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


@pytest.mark.parametrize("update", ["dion3", "normuon"])
def test_dmuon_verify_cli_passes_for_row_rules(update):
    proc = subprocess.run([sys.executable, "-m", "megatron_dmuon.cli", "verify", "--dp", "2", "--update", update,
                           "--steps", "3", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["update"] == update and report["each_matrix_once"]
    assert report["max_rel_diff"] <= FP32_TOL
