"""The online NS check (runtime/ns_check.py): a bad NS output is found, recomputed exactly and logged.

A planted failure: an orthogonalizer that blows one matrix's output up (what bf16 Gram NS did on
real momenta). With the check on every step, the run equals the clean run bit for bit (the repair
is the exact float32 NS, which is what the clean run computes here), counts every repair and logs
it; with the check off, the same sabotage changes the result. Also through Megatron-LM's flags
(the hook's parser) on 2 gloo ranks, and in the main job's log.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os

import pytest
import torch

from megatron_dmuon.algorithms.coefficients import get_coefficients
from megatron_dmuon.algorithms.ns_metrics import orthogonality_overshoot, schedule_peak
from megatron_dmuon.runtime import owner_step
from megatron_dmuon.runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW
from megatron_dmuon.testing.multiproc import run_distributed, run_main_job
from tests.algorithms.test_ns_metrics import heavy_tailed  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHAPES = [(48, 32), (48, 32), (32, 96)]


def sabotaged(orthogonalizer, factor=20.0):
    """The first matrix of every stack comes back ``factor`` times too large."""

    def orth(stack):
        out = orthogonalizer(stack).clone()
        out[0] *= factor
        return out

    return orth


def _run(settings, plant: bool, steps=5):
    params = [torch.nn.Parameter(torch.randn(*s, generator=torch.Generator().manual_seed(i))) for i, s in
              enumerate(SHAPES)]
    orth = owner_step.default_orthogonalizer(settings)
    opt = OwnerMuonAdamW([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.1, muon=settings,
                         orthogonalizer=sabotaged(orth) if plant else orth)
    for p, info in zip(params, owner_step.with_ns_choices([MatrixInfo(f"w{i}", tuple(p.shape))
                                                           for i, p in enumerate(params)], settings, "cpu")):
        opt.register_matrix(p, info)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        opt.step()
    return [p.detach().clone() for p in params], opt


def test_a_planted_bad_output_is_recomputed_exactly_on_check_steps():
    exact = dict(ns_method="standard", coefficients="you", ns_dtype=torch.float32)
    clean, _ = _run(MuonSettings(**exact, ns_check_interval=1), plant=False)
    repaired, opt = _run(MuonSettings(**exact, ns_check_interval=1), plant=True)
    assert all(torch.equal(a, b) for a, b in zip(clean, repaired))  # the exact repair = the clean fp32 path
    assert opt.ns_check.recomputed_total == 5 * 2  # two stacks, one planted matrix each, 5 steps
    found = opt.ns_check.last
    assert found["recomputed"] == 2 and found["checked"] == 3 and found["worst"] > 300  # σ ≈ 20: σ² − 1
    assert found["worst_name"] in ("w0", "w2")
    unchecked, opt_off = _run(MuonSettings(**exact, ns_check_interval=0), plant=True)
    assert opt_off.ns_check.recomputed_total == 0
    assert not all(torch.equal(a, b) for a, b in zip(clean, unchecked))


def test_the_check_runs_only_on_its_interval_and_leaves_healthy_outputs_alone():
    fast = dict(ns_method="standard", coefficients="you", ns_dtype=torch.bfloat16)
    every_third, opt = _run(MuonSettings(**fast, ns_check_interval=3), plant=True, steps=5)
    assert opt.ns_check.recomputed_total == 2  # step 3 only (steps 1, 2, 4, 5 unchecked)
    clean_checked, opt_clean = _run(MuonSettings(**fast, ns_check_interval=1), plant=False)
    clean_unchecked, _ = _run(MuonSettings(**fast, ns_check_interval=0), plant=False)
    assert opt_clean.ns_check.recomputed_total == 0  # bf16 NS on these matrices is within bounds
    assert all(torch.equal(a, b) for a, b in zip(clean_checked, clean_unchecked))  # a check changes nothing


def test_the_probe_estimate_sees_what_the_svd_sees():
    """orthogonality_overshoot: a lower bound of σ_max² − 1 that finds a blown-up direction."""
    x = torch.stack([heavy_tailed(128, 352, s) for s in range(3)])
    settings = MuonSettings(ns_method="standard", coefficients="you", ns_dtype=torch.float32)
    out = owner_step.default_orthogonalizer(settings)(x)
    out[1] += 4.0 * torch.outer(torch.randn(128), torch.randn(352)) / 352 ** 0.5  # one direction out of bounds
    true = torch.linalg.matrix_norm(out.double(), ord=2) ** 2 - 1
    estimate = orthogonality_overshoot(out, generator=torch.Generator().manual_seed(0)).double()
    assert (estimate <= true * (1 + 1e-5) + 1e-4).all(), (estimate, true)  # a Rayleigh quotient: never above
    assert float(estimate[1]) >= 0.98 * float(true[1]), (estimate, true)  # the blown-up direction dominates
    assert (estimate >= true - 0.1).all(), (estimate, true)  # healthy: near-equal top values, close enough
    assert float(estimate[1]) > settings.ns_check_limit(128, 352) > float(estimate[0])
    assert settings.ns_check_limit(128, 352) == pytest.approx(
        (1.25 * schedule_peak(get_coefficients("you", 5), 5)) ** 2 - 1)


def test_schedule_peaks():
    grid = torch.linspace(0, 1, 20001, dtype=torch.float64)
    from megatron_dmuon.algorithms.ns_metrics import schedule_map

    for name in ("keller", "you", "polar_express"):
        assert schedule_peak(name) == pytest.approx(float(schedule_map(grid, name).max()), abs=1e-4)
    assert schedule_peak("keller") == pytest.approx(1.2024, abs=1e-3)


def test_bad_check_settings_name_the_flag():
    from megatron_dmuon.megatron.config import DMuonConfig

    with pytest.raises(ValueError, match="--dmuon-ns-check-interval"):
        DMuonConfig(muon=MuonSettings(ns_check_interval=-1))
    with pytest.raises(ValueError, match="--dmuon-ns-check-bound"):
        DMuonConfig(muon=MuonSettings(ns_check_bound=float("nan")))


# ------------------------------------------------------------- through Megatron-LM's flags, 2 ranks
def hook_run_with_planted_failure(rank, world_size, argv, plant):
    """train_from_argv (the Megatron-LM hook's parser and factories) with every owner's NS output
    of the first matrix of each stack blown up when ``plant``; returns losses, repairs and the log."""
    from tests.megatron import test_megatron_lm as hook

    if plant:
        real = owner_step.run_ns
        owner_step.run_ns = lambda stack, choice: sabotaged(lambda x: real(x, choice))(stack)
    log = io.StringIO()
    handler = logging.StreamHandler(log)  # the report goes through logging (megatron/step_guards.py)
    logger = logging.getLogger("megatron_dmuon")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(log):
            out = hook.train_from_argv(rank, world_size, argv, iters=4)
    finally:
        logger.removeHandler(handler)
    return {"losses": out["losses"], "log": log.getvalue()}


def test_planted_failure_is_caught_and_logged_under_megatron_lm_flags():
    from tests.megatron import test_megatron_lm as hook

    argv = list(hook.USER_ARGV) + ["--dmuon-ns-check-interval", "2"]
    clean = run_distributed("test_ns_check:hook_run_with_planted_failure", 2, kwargs={"argv": argv, "plant": False},
                            sys_path=[HERE, ROOT], timeout=600)
    planted = run_distributed("test_ns_check:hook_run_with_planted_failure", 2, kwargs={"argv": list(hook.USER_ARGV) + [
        "--dmuon-ns-check-interval", "1"], "plant": True}, sys_path=[HERE, ROOT], timeout=600)
    assert planted[0]["losses"] == clean[0]["losses"]  # repaired exactly, every step
    log = planted[0]["log"]  # rank 0 logs for all ranks
    assert log.count("> DMuon NS check at step") == 4 and "WARNING: DMuon's NS check" in log
    assert "recomputed by the exact fp32 NS: 0" not in log
    assert planted[1]["log"].count("DMuon NS check") == 0
    assert clean[0]["log"].count("> DMuon NS check at step") == 2 and "recomputed by the exact fp32 NS: 0 (0 in all)" \
        in clean[0]["log"] and "WARNING" not in clean[0]["log"]


def test_the_main_job_logs_the_check():
    proc = run_main_job(["--train-iters", "6", "--log-interval", "100", "--seq-length", "32",
                         "--dmuon-ns-check-interval", "3", "--eval-iters", "0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("> DMuon NS check at step")]
    assert [line.split(":")[0] for line in lines] == ["> DMuon NS check at step 3", "> DMuon NS check at step 6"]
    assert all("recomputed by the exact fp32 NS: 0 (0 in all)" in line for line in lines), lines
    # a log interval beyond the run still logs the last iteration ([bad-input-2])
    assert [l.split()[1] for l in proc.stdout.splitlines() if l.startswith(" iteration")] == ["1/", "6/"]
