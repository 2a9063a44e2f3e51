"""Numerical guards: a non-finite gradient skips the step on every rank (no loss scaler needed),
non-finite NS output is recomputed in fp32 and counted, all-zero gradients stay finite, and
`dmuon-check` finds a DP replica that diverged."""
import subprocess
import sys

import torch

from megatron_dmuon.kernels import metrics
from megatron_dmuon.runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW, fp32_orthogonalizer, with_ns_choices
from megatron_dmuon.testing.compare import full_optimizer_state, full_params, rel_diffs, state_diffs
from megatron_dmuon.testing.multiproc import run_distributed


def test_nan_gradient_on_one_rank_skips_the_step_everywhere():
    # bf16 (the supported mode, no loss scaler): rank 1's gradient of one matrix is NaN at step 3
    out = run_distributed("megatron_dmuon.testing.guard_workers:nan_vs_never_seen", 2,
                          kwargs=dict(nan_at=(3, 1), steps=6, shape_kw=dict(bf16=True), ns_dtype="bfloat16"))
    nan, never = [r["nan"] for r in out], [r["never_seen"] for r in out]
    assert [r["updated"] for r in nan] == [[True, True, True, False, True, True]] * 2  # skipped on both ranks
    assert [r["skipped_iterations"] for r in nan] == [1, 1] and never[0]["skipped_iterations"] == 0
    # the same parameters and optimizer state as a run that never saw that batch
    assert max(rel_diffs(full_params(nan), full_params(never)).values()) == 0.0
    assert max(state_diffs(full_optimizer_state(nan), full_optimizer_state(never)).values()) == 0.0


def _owner(params, orthogonalizer=None, retry=True):
    opt = OwnerMuonAdamW([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.1,
                         muon=MuonSettings(ns_dtype=torch.float32, retry_nonfinite=retry), orthogonalizer=orthogonalizer)
    infos = with_ns_choices([MatrixInfo(f"w{i}", tuple(p.shape)) for i, p in enumerate(params)], opt.muon, "cpu")
    for p, info in zip(params, infos):
        opt.register_matrix(p, info)
    return opt


def test_nonfinite_ns_output_is_recomputed_in_fp32_and_counted():
    torch.manual_seed(0)
    starts = [torch.randn(16, 24) for _ in range(3)]
    grads = [torch.randn(16, 24) for _ in range(3)]

    def overflowing(stack):  # a fast path whose fp16 result overflowed for the second matrix
        out = fp32_orthogonalizer(MuonSettings(ns_dtype=torch.float32))(stack).clone()
        out[1] = float("inf")
        return out

    ours = [torch.nn.Parameter(s.clone()) for s in starts]
    ref = [torch.nn.Parameter(s.clone()) for s in starts]
    metrics.reset_nonfinite_metrics()
    for params, orth in ((ours, overflowing), (ref, None)):
        opt = _owner(params, orth)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))  # the retry is the fp32 NS of the same input
    assert metrics.nonfinite_metrics()["fp32_retries"] == 1 and metrics.nonfinite_metrics()["nonfinite_outputs"] == 1
    without_retry = [torch.nn.Parameter(s.clone()) for s in starts]
    opt = _owner(without_retry, overflowing, retry=False)
    for p, g in zip(without_retry, grads):
        p.grad = g.clone()
    opt.step()
    assert not torch.isfinite(without_retry[1]).all()  # the guard is what kept the step finite


def test_all_zero_gradient_is_finite_and_only_decays():
    p = torch.nn.Parameter(torch.randn(16, 24))
    v = torch.nn.Parameter(torch.randn(24))
    start_p, start_v = p.detach().clone(), v.detach().clone()
    opt = OwnerMuonAdamW([{"params": [p], "use_muon": True}, {"params": [v], "use_muon": False}], lr=0.02,
                         weight_decay=0.1, muon=MuonSettings(ns_dtype=torch.float32))
    opt.register_matrix(p, with_ns_choices([MatrixInfo("w", (16, 24))], opt.muon, "cpu")[0])
    opt.init_state()
    p.grad, v.grad = torch.zeros_like(p), torch.zeros_like(v)
    opt.step()
    decay = 1 - 0.02 * 0.1
    assert torch.allclose(p, start_p * decay) and torch.allclose(v, start_v * decay)  # no 0/0 NaN
    assert torch.isfinite(opt.state[p]["momentum_buffer"]).all() and torch.isfinite(opt.state[v]["exp_avg_sq"]).all()


def test_state_is_created_for_every_param_before_the_first_step():
    # every rank holds the same state keys from the start (checkpoints need them), with the values
    # the first step would create; a param without a grad keeps its state and is not stepped
    p, q = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
    v, w = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = OwnerMuonAdamW([{"params": [p, q], "use_muon": True}, {"params": [v, w], "use_muon": False}], lr=0.02,
                         weight_decay=0.1, muon=MuonSettings(ns_dtype=torch.float32))
    for param, info in zip((p, q), with_ns_choices([MatrixInfo("p", (8, 8)), MatrixInfo("q", (8, 8))], opt.muon, "cpu")):
        opt.register_matrix(param, info)
    opt.init_state()
    assert set(opt.state[p]) == {"momentum_buffer"} and set(opt.state[v]) == {"step", "exp_avg", "exp_avg_sq"}
    q0, w0 = q.detach().clone(), w.detach().clone()
    p.grad, v.grad = torch.randn(8, 8), torch.randn(8)  # q and w: no grad this step
    opt.step()
    assert torch.equal(q, q0) and torch.equal(w, w0) and float(opt.state[w]["step"]) == 0.0
    assert not torch.equal(p, p.detach() * 0) and float(opt.state[v]["step"]) == 1.0
    assert opt.adam_steps() == {0.0, 1.0}  # a checkpoint refuses such a state (see tests/megatron/train/test_checks.py)


def test_found_nonfinite_without_a_process_group():
    from megatron_dmuon.megatron.optimizer import found_nonfinite

    assert not found_nonfinite([torch.ones(3), None, torch.zeros(0)], None)
    assert found_nonfinite([torch.ones(3), torch.tensor([1.0, float("nan")])], None)
    assert found_nonfinite([torch.tensor([float("-inf")], dtype=torch.float64)], None)


def test_dmuon_check_finds_a_diverged_replica():
    proc = subprocess.run([sys.executable, "-m", "megatron_dmuon.testing.check_cli", "--dp", "2", "--steps", "1",
                           "--corrupt-rank", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "DP replicas differ: first mismatch" in proc.stdout and "linear_qkv.weight" in proc.stdout
    assert "DP ranks [1]" in proc.stdout
