"""DMuon with --dmuon-update normuon / dion3 on real megatron-core (gloo, CPU) against the
single-process reference (testing/reference.py: the rule one matrix at a time, no sharding)."""
import json

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


# NorMuon at DP=2 is checked by test_dmuon_verify_cli_passes_for_row_rules, Dion3 at DP=4 (with
# megabatching and overlap) by test_megabatch_dion3_at_dp4_matches_reference
def test_dion3_at_dp2_matches_single_process_reference():
    kw = dict(steps=4, grad_accum=2, muon_kw=dict(update="dion3", fraction=0.25, nesterov=False))
    results, ref = _check(2, **kw)
    muon = run_reference(2, layouts=results[0]["layouts"], **{**kw, "muon_kw": dict(nesterov=False)})
    assert max(rel_diffs(full_params(results), muon["params"]).values()) > 1e-3  # the rule is really used


def test_megabatch_dion3_at_dp4_matches_reference():
    # one bucket per buffer although overlap and a small bucket_size ask for several
    results, _ = _check(4, steps=4, grad_accum=2, overlap=True, bucket_size=20000, megabatch=True,
                        muon_kw=dict(update="dion3", fraction=0.5, nesterov=False))
    from megatron_dmuon.planning.owner_layout import OwnerLayout

    assert [len(OwnerLayout.from_json(j).buckets) for j in results[0]["layouts"]] == [1]


def test_megabatch_collectives_per_step_do_not_grow_with_layers():
    # torch.distributed calls in one steady-state step, counted by wrapping every collective
    from megatron_dmuon.testing.multiproc import run_distributed

    counts = run_distributed("megatron_dmuon.testing.workers:collective_calls", 2,
                             kwargs=dict(layer_counts=(2, 4, 8), muon_kw=dict(update="dion3", nesterov=False,
                                                                            fraction=0.25)))[0]
    bucketed, mega = counts["bucketed"], counts["megabatch"]
    rs = lambda c, n: c[n]["calls"]["reduce_scatter_tensor"]  # noqa: E731
    ag = lambda c, n: c[n]["calls"]["all_gather_into_tensor"]  # noqa: E731
    assert [(rs(mega, n), ag(mega, n)) for n in (2, 4, 8)] == [(1, 1)] * 3
    assert rs(bucketed, 2) < rs(bucketed, 4) < rs(bucketed, 8)
    assert [ag(bucketed, n) for n in (2, 4, 8)] == [rs(bucketed, n) for n in (2, 4, 8)]
    # everything else (grad norm, NaN flag, loss) is the same constant in both paths
    others = {(name, n): {k: v for k, v in c[n]["calls"].items() if k not in ("reduce_scatter_tensor",
                                                                             "all_gather_into_tensor")}
              for name, c in counts.items() for n in (2, 4, 8)}
    assert len({tuple(sorted(v.items())) for v in others.values()}) == 1


def test_dion3_per_split_piece_matches_reference():
    # QKV cut per attention head (a stack of head matrices): rows are selected inside every head
    _check(2, steps=3, grad_accum=1, split="heads", muon_kw=dict(update="dion3", fraction=0.25, nesterov=False,
                                                                fraction_lr="inverse_sqrt"))


@pytest.mark.parametrize("update", ["dion3", "normuon"])
def test_dmuon_verify_cli_passes_for_row_rules(update, capsys):
    # the CLI's main in this process: its ranks fork from the tests' fork server (the `-m` entry point
    # runs under torchrun in tests/runtime/test_dp_exchange.py::test_dmuon_verify_under_torchrun)
    from megatron_dmuon.testing.verify_cli import main

    code = main(["--dp", "2", "--update", update, "--steps", "3", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] and report["update"] == update and report["each_matrix_once"]
    assert report["max_rel_diff"] <= FP32_TOL


RESUME = "megatron_dmuon.testing.checkpoint_workers:dmuon_resume"
DION3 = dict(update="dion3", fraction=0.5, nesterov=False)


@pytest.mark.parametrize("fmt", ["dist", "torch"])
def test_row_rule_resume_is_bit_identical(fmt):
    # the row second moments travel with the checkpoint (both formats): the resumed run equals the
    # uninterrupted one bit for bit, params and every state tensor
    from megatron_dmuon.testing.compare import full_optimizer_state, state_diffs
    from megatron_dmuon.testing.multiproc import run_distributed

    out = run_distributed(RESUME, 2, kwargs=dict(resume_at=2, steps=4, grad_accum=1, fmt=fmt, muon_kw=DION3))
    uninterrupted, resumed = [r["uninterrupted"] for r in out], [r["resumed"] for r in out]
    state = state_diffs(full_optimizer_state(resumed), full_optimizer_state(uninterrupted))
    assert "row_variance" in {k.rsplit(":", 1)[1] for k in state}
    assert max(rel_diffs(full_params(resumed), full_params(uninterrupted)).values()) == 0.0
    assert max(state.values()) == 0.0
    assert resumed[0]["losses"] == uninterrupted[0]["losses"][2:]


def test_row_rule_checkpoint_reshards_dp2_to_dp1(tmp_path):
    from megatron_dmuon.testing.compare import full_optimizer_state, state_diffs
    from megatron_dmuon.testing.multiproc import run_distributed

    common = dict(resume_at=2, steps=4, grad_accum=1, shape_kw=dict(fp64=True), ns_dtype="float64",
                  muon_kw=dict(update="normuon"))
    saved = run_distributed(RESUME, 2, kwargs=dict(common, save_dir=str(tmp_path), resume_here=False))
    resumed = run_distributed(RESUME, 1, kwargs=dict(common, load_dir=str(tmp_path), data_dp=2))
    uninterrupted = [r["uninterrupted"] for r in saved]
    state = state_diffs(full_optimizer_state([r["resumed"] for r in resumed]), full_optimizer_state(uninterrupted))
    assert "row_variance" in {k.rsplit(":", 1)[1] for k in state}
    assert max(rel_diffs(full_params([r["resumed"] for r in resumed]), full_params(uninterrupted)).values()) <= 1e-10
    assert max(state.values()) <= 1e-10
