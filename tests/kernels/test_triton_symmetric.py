"""The Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1), vs the torch path.

The interpreter is chosen when a kernel is decorated, i.e. when the kernel module is first
imported; another test may already have imported it compiled in this process. So the parent
test re-runs this file in fresh child processes with TRITON_INTERPRET=1 and checks that every
child test passed; in the parent the child tests are skipped. The interpreter runs on one core:
the child tests are dealt round-robin to SHARDS children that run side by side, each skipping the
others' tests (every child test runs in exactly one of them).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHILD_ENV = "DMUON_KERNELS_INTERPRETER_CHILD"
IN_CHILD = os.environ.get(CHILD_ENV) == "1"
child_only = pytest.mark.skipif(not IN_CHILD, reason="runs in the TRITON_INTERPRET=1 child process")
SHARD_ENV = "DMUON_KERNELS_INTERPRETER_SHARD"  # "i/n": this child runs child tests i, i + n, i + 2n, ...
SHARDS = 2  # children side by side (the CI machine's cores)


@pytest.fixture(autouse=True)
def _this_childs_share(request):
    """In a child given a shard: the child tests dealt to the other children are skipped."""
    shard = os.environ.get(SHARD_ENV) if IN_CHILD else None
    if shard and request.node.name.startswith("test_child_"):
        index, count = map(int, shard.split("/"))
        dealt = [item for item in request.session.items if item.name.startswith("test_child_")]
        if dealt.index(request.node) % count != index:
            pytest.skip(f"dealt to another child than shard {shard}")


def _skip_discarded_overflow_checks() -> None:
    """The interpreter's builder runs with ``debug=False`` and ``sanitize_overflow=True``: every integer
    add/sub/mul of a kernel's index arithmetic then also runs in int64, compared against the int32
    range, and the result goes to ``device_assert``, which returns at once without ``debug``
    (triton/language/semantic.py), as on the GPU without debug. The check was computed and thrown
    away: over a third of this file's time. Switched off only where it is thrown away (``debug`` False)."""
    import dataclasses

    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and not options.debug and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _patch_the_language_once() -> None:
    """The interpreter swaps triton.language's builtins for interpreted ones (``_patch_lang``:
    ``inspect.getmembers`` over each of tl, tl.core a function sees, and tl.tensor, tl.math) at each
    kernel launch, restoring them after it, and at each call of a ``@triton.jit`` device function
    inside the kernel, never restoring those (triton 3.x: the swap stays for the rest of the process).
    A device function whose modules are already swapped, by the running launch or by an earlier
    device call, gets nothing from it but the getmembers walk: that is skipped; every other call runs
    as the interpreter has it. (A builtin left unswapped would raise, not compute something else.)
    Measured: a fifth of this file's time."""
    from triton import language as tl
    from triton.runtime import interpreter

    patch_lang, launch_langs, kept = interpreter._patch_lang, [], set()

    def langs_of(fn):
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_once(fn):
        langs = langs_of(fn)
        if launch_langs:  # a device function's call inside a launch: swapped for good, as the interpreter does
            if langs <= kept | launch_langs[-1]:
                return interpreter._LangPatchScope()  # (its scope is never restored)
            scope = patch_lang(fn)
            kept.update(langs)
            return scope
        scope = patch_lang(fn)  # a launch: swapped, restored when it ends
        launch_langs.append(langs)
        restore = scope.restore

        def restore_at_the_end():
            launch_langs.pop()
            restore()

        scope.restore = restore_at_the_end
        return scope

    interpreter._patch_lang = patch_once


if IN_CHILD:
    _skip_discarded_overflow_checks()
    _patch_the_language_once()

# Small tiles keep the interpreter fast and exercise partial tiles on tiny matrices.
TILE_CONFIGS = [(16, 16, 16), (32, 16, 16), (16, 32, 32)]


def test_interpreter_child_process_passes():
    if IN_CHILD:
        pytest.skip("this is the child")
    children = []
    for shard in range(SHARDS):
        env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: "1", SHARD_ENV: f"{shard}/{SHARDS}"})
        env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
        children.append(subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__],
            cwd=Path(__file__).resolve().parents[2], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        ))
    try:
        outputs = [child.communicate(timeout=600) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    passed_in_all = 0
    for child, (out, err) in zip(children, outputs):
        summary = out.strip().splitlines()[-1] if out.strip() else ""
        assert child.returncode == 0, out[-6000:] + err[-3000:]
        passed = re.search(r"(\d+) passed", summary)
        assert passed, summary
        passed_in_all += int(passed.group(1))
    expected = sum(1 for name in globals() if name.startswith("test_child_"))
    assert passed_in_all >= expected, [out.strip().splitlines()[-1:] for out, _ in outputs]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _kernel_config(bm, bn, bk):
    from megatron_dmuon.kernels.triton_symmetric import KernelConfig

    return KernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=1, group=2)


@child_only
def test_child_interpreter_is_active():
    from megatron_dmuon.kernels.triton_symmetric import _sym_mm_kernel, interpreter_active

    assert interpreter_active()
    assert "Interpret" in type(_sym_mm_kernel).__name__


@child_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiles", TILE_CONFIGS)
def test_child_syrk_matches_torch(dtype, tiles):
    from megatron_dmuon.kernels import syrk

    gen = torch.Generator().manual_seed(sum(tiles))
    for batch, m, k in [(2, 40, 72), (1, 17, 20), (3, 32, 48), (2, 64, 40)]:  # odd and tile-multiple m
        x = torch.randn(batch, m, k, generator=gen).to(dtype)
        out = torch.full((batch, m, m), float("nan"), dtype=dtype)  # poison: every element must be written
        syrk(x, out=out, backend="triton", config=_kernel_config(*tiles))
        ref = syrk(x, backend="torch")
        tol = 2e-3 if dtype == torch.float16 else 1e-2
        assert torch.isfinite(out).all()
        assert _rel(out, ref) < tol, (batch, m, k)
        assert torch.equal(out, out.mT)


@child_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_child_poly_and_axpby_match_torch(dtype):
    from megatron_dmuon.kernels import sym_axpby, sym_poly

    gen = torch.Generator().manual_seed(5)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for m, tiles in [(36, t) for t in TILE_CONFIGS] + [(64, (32, 16, 16)), (64, (16, 32, 32))]:
        g = torch.randn(2, m, m, generator=gen)
        r = ((g + g.mT) / (2 * m)).to(dtype)
        cfg = _kernel_config(*tiles)
        p = sym_poly(r, -4.775, 2.0315, diag=3.4445, backend="triton", config=cfg)
        assert _rel(p, sym_poly(r, -4.775, 2.0315, diag=3.4445, backend="torch")) < tol
        z = sym_poly(r, 1.5, 0.5, backend="triton", config=cfg)
        q = sym_axpby(r, z, 3.0, backend="triton", config=cfg)
        assert _rel(q, sym_axpby(r, z, 3.0, backend="torch")) < tol
        assert torch.equal(q, q.mT) and torch.equal(p, p.mT)


@child_only
def test_child_transposed_operand_strides():
    """A tall matrix's wide view (column-major) goes to the kernel without a copy."""
    from megatron_dmuon.kernels import syrk

    tall = torch.randn(2, 50, 24).half()
    wide = tall.mT
    assert not wide.is_contiguous()
    out = syrk(wide, backend="triton", config=_kernel_config(16, 16, 16))
    assert _rel(out, syrk(wide.contiguous(), backend="torch")) < 2e-3


@child_only
@pytest.mark.parametrize("coefficients", ["keller", "polar_express"])
@pytest.mark.parametrize("shape", [(2, 24, 80), (3, 96, 40), (2, 2, 16, 48)])
def test_child_gram_fast_matches_torch_gram_fp16(shape, coefficients):
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.algorithms.newton_schulz import msgn_svd
    from megatron_dmuon.kernels import gram_newton_schulz_fast

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
    fast = gram_newton_schulz_fast(x, coefficients, backend="triton")
    ref = gram_newton_schulz(x, coefficients)
    assert fast.shape == x.shape and fast.dtype == x.dtype
    assert _rel(fast, ref) < 0.02
    exact = msgn_svd(x)
    # Within the fp16 Gram NS accuracy of the reference path (docs/algorithms.md bounds).
    assert _rel(fast, exact) <= _rel(ref, exact) + 0.01
    if coefficients == "polar_express":
        assert _rel(fast, exact) < 0.12


@child_only
def test_child_gram_fast_bf16_and_restarts():
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.algorithms.newton_schulz import msgn_svd
    from megatron_dmuon.kernels import gram_newton_schulz_fast

    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(9))
    exact = msgn_svd(x)
    fast = gram_newton_schulz_fast(x, "polar_express", compute_dtype=torch.bfloat16, backend="triton")
    ref = gram_newton_schulz(x, "polar_express", compute_dtype=torch.bfloat16)
    assert abs(_rel(fast, exact) - _rel(ref, exact)) < 0.05  # bf16 rounding differs; accuracy does not
    for restarts in [(), (1, 3), (2, 4)]:
        fast = gram_newton_schulz_fast(x, "polar_express", restart_after=restarts, backend="triton")
        ref = gram_newton_schulz(x, "polar_express", restart_after=restarts)
        assert _rel(fast, ref) < 0.02, restarts


@child_only
def test_child_standard_fast_and_auto_dispatch():
    from megatron_dmuon.algorithms.newton_schulz import newton_schulz
    from megatron_dmuon.kernels import gram_newton_schulz_fast, newton_schulz_fast, orthogonalize_batched

    sq = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(2))
    fast = newton_schulz_fast(sq, "polar_express", compute_dtype=torch.float16, backend="triton")
    assert _rel(fast, newton_schulz(sq, "polar_express", compute_dtype=torch.float16)) < 0.02
    # Gram on a near-square matrix runs standard NS, as the algorithms do.
    assert torch.equal(gram_newton_schulz_fast(sq, "polar_express"), fast)
    kv = torch.randn(2, 16, 64)
    assert torch.equal(orthogonalize_batched(kv, "auto"), gram_newton_schulz_fast(kv))
    # out_dtype = the compute dtype: the last product's own result, which the float32 path widens
    half = dict(compute_dtype=torch.float16, out_dtype=torch.float16)
    assert torch.equal(orthogonalize_batched(kv, "auto", **half), orthogonalize_batched(kv, "auto").half())
    assert torch.equal(newton_schulz_fast(sq, "polar_express", backend="triton", **half), fast.half())


@child_only
def test_child_ill_conditioned_and_zero_inputs_stay_finite():
    from megatron_dmuon.kernels import gram_newton_schulz_fast, nonfinite_metrics

    gen = torch.Generator().manual_seed(4)
    U, _ = torch.linalg.qr(torch.randn(2, 32, 32, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(2, 96, 32, dtype=torch.float64, generator=gen))
    x = ((U * torch.logspace(0, -6, 32, dtype=torch.float64)) @ V.mT).float()  # cond 1e6
    before = nonfinite_metrics()["outputs_checked"]
    for co in ("keller", "polar_express"):
        out = gram_newton_schulz_fast(x, co, backend="triton", check_finite=True)
        assert torch.isfinite(out).all()
    assert nonfinite_metrics()["outputs_checked"] == before + 4
    zeros = gram_newton_schulz_fast(torch.zeros(2, 16, 48), backend="triton")
    assert torch.equal(zeros, torch.zeros(2, 16, 48))


# finite entries at every scale the input dtype holds (fp16: its own range); powers of two scale
# the input exactly, powers of ten round it in its dtype
from megatron_dmuon.testing.ns_scales import SCALES  # noqa: E402


@child_only
@pytest.mark.parametrize("dtype", list(SCALES))
def test_child_scaled_norm_is_right_at_every_scale(dtype):
    from megatron_dmuon.kernels.triton_cast import scaled_norm_reciprocal

    x = torch.randn(3, 40, 72, generator=torch.Generator().manual_seed(9))
    x[1] = 0.0
    for scale in (1.0, *SCALES[dtype]):
        xs = (x * scale).to(dtype)
        for view in (xs, xs.mT):  # the tall view reads with the other stride
            exact = torch.linalg.vector_norm(view.double(), dim=(-2, -1))
            ours = scaled_norm_reciprocal(view, 1e-30).double()
            assert torch.isfinite(ours).all(), (dtype, scale)
            assert ours[1] == 1e30 * 0 + ours[1] and float(ours[1]) == pytest.approx(1e30, rel=1e-6)  # zero: 1/eps
            rel = ((ours[[0, 2]] * exact[[0, 2]]) - 1).abs().max()
            assert rel < 1e-5, (dtype, scale, float(rel))


@child_only
def test_child_float64_sum_of_squares_equals_the_float64_norm():
    """The grad norm's kernel (float64 partial sums, no float64 copy): equal to torch's float64
    norm to float64 rounding, for every grad dtype, partial blocks, empty and non-contiguous grads."""
    from megatron_dmuon.kernels.grad_norm import sum_of_squares_float64

    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(3001, generator=gen) * 1e3, torch.randn(17, 5, generator=gen).to(torch.bfloat16),
             torch.randn(2048, generator=gen).to(torch.float16), torch.empty(0),
             torch.randn(9, 40, generator=gen).mT, torch.full((1025,), 3e19)]  # squares past float32's range
    exact = sum(float(torch.linalg.vector_norm(g.double()).square()) for g in grads)
    ours = sum_of_squares_float64(grads, torch.device("cpu"))
    assert ours.dtype == torch.float64 and ours.shape == (1,)
    assert abs(float(ours) / exact - 1) < 1e-14
    assert float(sum_of_squares_float64([], torch.device("cpu"))) == 0.0


@child_only
@pytest.mark.parametrize("dtype", list(SCALES))
def test_child_public_entry_points_need_no_retry_at_any_scale(dtype):
    """newton_schulz_fast, gram_newton_schulz_fast, orthogonalize_batched: finite results equal to
    the unit-scale ones for entries from 1e-30 to 1e30, with no fp32 retry counted."""
    from megatron_dmuon.testing.ns_scales import check_entry_points_at_every_scale

    gen = torch.Generator().manual_seed(10)
    wide, square = torch.randn(2, 16, 48, generator=gen), torch.randn(2, 16, 16, generator=gen)
    check_entry_points_at_every_scale(wide, square, dtype, exact_fp32_tol=1e-6, backend="triton")


@child_only
def test_child_nonfinite_output_is_retried_in_fp32(monkeypatch):
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.kernels import gram_newton_schulz_fast, nonfinite_metrics, ns_driver

    real_core = ns_driver.gram_core

    def core_with_overflow(X, *args):
        out = real_core(X, *args)
        out[1, 0, 0] = float("inf")  # as if fp16 had overflowed in matrix 1
        return out

    monkeypatch.setattr(ns_driver, "gram_core", core_with_overflow)
    x = torch.randn(3, 16, 48, generator=torch.Generator().manual_seed(8))
    before = nonfinite_metrics()
    out = gram_newton_schulz_fast(x, "polar_express", backend="triton", check_finite=True)
    after = nonfinite_metrics()
    assert torch.isfinite(out).all()
    assert after["nonfinite_outputs"] - before["nonfinite_outputs"] == 1
    assert after["fp32_retries"] - before["fp32_retries"] == 1
    fp32 = gram_newton_schulz(x[1:2], "polar_express", compute_dtype=torch.float32)
    assert torch.equal(out[1:2], fp32)
    monkeypatch.setattr(ns_driver, "gram_core", real_core)
    clean = gram_newton_schulz_fast(x, "polar_express", backend="triton")
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])
    unchecked = gram_newton_schulz_fast(x, "polar_express", backend="triton", check_finite=False)
    assert nonfinite_metrics()["outputs_checked"] == after["outputs_checked"] and torch.isfinite(unchecked).all()


def _tma_config(bm, bn, bk, tma=1):
    from megatron_dmuon.kernels.triton_symmetric import KernelConfig

    return KernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=1, group=2, tma=tma)


@child_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tma", [1, 2])
def test_child_tma_kernel_matches_torch(dtype, tma):
    from megatron_dmuon.kernels import sym_axpby, sym_poly, syrk
    from megatron_dmuon.kernels.triton_symmetric import tma_applies

    gen = torch.Generator().manual_seed(11 + tma)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    cfg = _tma_config(16, 32, 16, tma)
    for batch, m, k in [(3, 64, 72), (1, 32, 40), (2, 64, 24)]:  # K tails (40, 24) are zero-filled by TMA
        x = torch.randn(batch, m, k, generator=gen).to(dtype)
        assert tma_applies(x, x.mT, cfg)
        out = torch.full((batch, m, m), float("nan"), dtype=dtype)
        syrk(x, out=out, backend="triton", config=cfg)
        assert torch.isfinite(out).all() and torch.equal(out, out.mT)
        assert _rel(out, syrk(x, backend="torch")) < tol, (batch, m, k)
    g = torch.randn(2, 64, 64, generator=gen)
    r = ((g + g.mT) / 128).to(dtype)
    assert tma_applies(r, r, cfg, b_symmetric=True) and not tma_applies(r, r, cfg)
    p = sym_poly(r, -4.775, 2.0315, diag=3.4445, backend="triton", config=cfg)
    assert _rel(p, sym_poly(r, -4.775, 2.0315, diag=3.4445, backend="torch")) < tol
    z = sym_poly(r, 1.5, 0.5, backend="torch")
    q = sym_axpby(r, z, 3.0, backend="triton", config=cfg)
    assert _rel(q, sym_axpby(r, z, 3.0, backend="torch")) < tol
    assert torch.equal(p, p.mT) and torch.equal(q, q.mT)


@child_only
def test_child_tma_config_falls_back_to_the_pointer_kernel():
    from megatron_dmuon.kernels import syrk
    from megatron_dmuon.kernels.triton_symmetric import tma_applies

    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3)).half()  # 40: not a tile multiple
    tma_cfg = _tma_config(16, 16, 16)
    assert not tma_applies(x, x.mT, tma_cfg)
    assert not tma_applies(x[:, :32].contiguous().mT.contiguous().mT[:, :, :32], x[:, :32], tma_cfg)  # K not contiguous
    out = syrk(x, backend="triton", config=tma_cfg)
    assert torch.equal(out, syrk(x, backend="triton", config=_kernel_config(16, 16, 16)))


@child_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_child_scale_cast_transposes_and_scales(dtype):
    from megatron_dmuon.kernels.triton_cast import scale_cast

    gen = torch.Generator().manual_seed(6)
    scale = torch.tensor([0.5, 3.0, 1e-3])
    for x in (torch.randn(3, 40, 24, generator=gen), torch.randn(3, 24, 40, generator=gen).mT):  # wide; tall's wide view
        out = torch.full(x.shape, float("nan"), dtype=dtype)
        scale_cast(x, scale, out)
        ref = (x * scale[:, None, None]).to(dtype)
        if dtype == torch.float16:
            assert torch.equal(out, ref)
        else:  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): within one bf16 ulp
            torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=0)
    with pytest.raises(ValueError, match="scale must be float32"):
        scale_cast(x, scale.double(), out)


@child_only
def test_child_gram_core_with_tma_plan_matches_pointer_plan():
    from megatron_dmuon.algorithms.coefficients import get_coefficients
    from megatron_dmuon.kernels.autotune import OpChoice, ShapePlan
    from megatron_dmuon.kernels.ns_driver import _normalised_wide, gram_core

    x = torch.randn(2, 96, 32, generator=torch.Generator().manual_seed(12))  # tall: result comes back tall
    X, transposed = _normalised_wide(x, torch.float16, 1e-7)
    schedule = get_coefficients("polar_express", 5)
    tma = ShapePlan(OpChoice("triton", _tma_config(16, 32, 16)), OpChoice("triton", _tma_config(16, 16, 16, 2)))
    ptr = ShapePlan(OpChoice("triton", _kernel_config(16, 32, 16)), OpChoice("triton", _kernel_config(16, 16, 16)))
    out_tma = gram_core(X, schedule, frozenset({2}), tma, transposed, torch.float32)
    out_ptr = gram_core(X, schedule, frozenset({2}), ptr, transposed, torch.float32)
    assert out_tma.shape == x.shape
    assert _rel(out_tma, out_ptr) < 2e-3


@child_only
def test_child_six_step_square_schedule():
    """Square matrices run standard NS (Gram NS in fp16 loses accuracy on their tiny singular
    values, which is why min_aspect_ratio defaults to 2); the 6-step schedule goes through."""
    from megatron_dmuon.algorithms.newton_schulz import msgn_svd, newton_schulz
    from megatron_dmuon.algorithms.schedules import POLAR_EXPRESS_6
    from megatron_dmuon.kernels import gram_newton_schulz_fast, newton_schulz_fast

    sq = torch.randn(2, 48, 48, generator=torch.Generator().manual_seed(13))
    std = newton_schulz_fast(sq, POLAR_EXPRESS_6, steps=6, compute_dtype=torch.float16, backend="triton")
    assert _rel(std, newton_schulz(sq, POLAR_EXPRESS_6, steps=6, compute_dtype=torch.float16)) < 0.02
    assert _rel(std, msgn_svd(sq)) < 0.01  # measured 0.0013
    from megatron_dmuon.algorithms.newton_schulz import newton_schulz_reference

    assert _rel(std, newton_schulz_reference(sq, POLAR_EXPRESS_6, steps=6)) < 0.003  # measured 0.0010 (0.0009 with baddbmm)
    assert torch.equal(gram_newton_schulz_fast(sq, POLAR_EXPRESS_6, steps=6, compute_dtype=torch.float16), std)


@child_only
def test_child_quartic_normalisation_on_the_kernels():
    """The per-shape (quartic) schedules on the kernel path match the torch path in fp16 and the
    exact polar factor; with and without a Gram restart; zeros stay zeros."""
    from megatron_dmuon.algorithms.newton_schulz import msgn_svd, newton_schulz_reference
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.algorithms.schedules import schedule_for_shape
    from megatron_dmuon.kernels import gram_newton_schulz_fast, newton_schulz_fast

    g = torch.Generator().manual_seed(21)
    wide = torch.randn(3, 32, 96, generator=g)
    wide[1] = 0.0
    kw = schedule_for_shape(32, 96)
    for restart_after in [(2,), ()]:
        fast = gram_newton_schulz_fast(wide, compute_dtype=torch.float16, backend="triton", restart_after=restart_after, **kw)
        torch_path = gram_newton_schulz(wide, compute_dtype=torch.float16, restart_after=restart_after, **kw)
        assert _rel(fast, torch_path) < 0.02
        assert fast[1].abs().max() == 0
        exact = newton_schulz_reference(wide[[0, 2]], **kw)
        assert _rel(fast[[0, 2]], exact) < 0.02
    sq = torch.randn(2, 48, 48, generator=g)
    kw = schedule_for_shape(48, 48)
    std = newton_schulz_fast(sq, compute_dtype=torch.float16, backend="triton", **kw)
    # measured 0.0042 (a X in baddbmm's float32 epilogue; 0.0040 with a·I folded into the fp16 B,
    # which leaned the result by ~1e-3 in scale on real shapes: tests/algorithms/test_ns_metrics.py)
    assert _rel(std, newton_schulz_reference(sq, **kw)) < 0.006
    assert _rel(std, msgn_svd(sq)) < 0.1


@child_only
@pytest.mark.parametrize("normalisation", ["frobenius", "quartic"])
def test_child_distributed_gram_ns_runs_on_the_symmetric_kernels(normalisation):
    """The TP path's distributed Gram NS with the kernels' ops (``sharded_gram_ops``: syrk for each
    shard's X Xᵀ, ``gram_segment_q`` on the owner), here one shard with local callbacks: it equals
    the kernel driver on the whole matrix to fp16 rounding, the torch sharded path within fp16 NS
    tolerance, and the ops are used (not torch's products)."""
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz_sharded, gram_space_polynomial
    from megatron_dmuon.kernels import gram_newton_schulz_fast
    from megatron_dmuon.kernels.ns_driver import sharded_gram_ops

    wide = torch.randn(2, 32, 96, generator=torch.Generator().manual_seed(5))
    gram, segment_q = sharded_gram_ops(wide, torch.float16)
    calls = {"gram": 0, "q": 0}

    def counted_gram(X):
        calls["gram"] += 1
        return gram(X)

    def q_on_kernels(R, segment, normalise):
        calls["q"] += 1
        return segment_q(R, segment, normalise)

    kw = dict(compute_dtype=torch.float16, normalisation=normalisation)
    ident = lambda t: t  # noqa: E731 - one shard: the sum and max over shards are the tensor itself
    on_kernels = gram_newton_schulz_sharded(wide, ident, q_on_kernels, max_over_shards=ident, gram=counted_gram, **kw)
    assert calls == {"gram": 2, "q": 2}  # two segments (restart after step 2)
    whole = gram_newton_schulz_fast(wide, backend="triton", **kw)
    on_torch = gram_newton_schulz_sharded(wide, ident, gram_space_polynomial, max_over_shards=ident, **kw)
    assert _rel(on_kernels, whole) < 5e-3
    assert _rel(on_kernels, on_torch) < 2e-2
    assert sharded_gram_ops(wide, torch.float32) is None  # float32 compute: torch's products


@child_only
def test_child_distributed_gram_kernel_failure_falls_back_to_torch(monkeypatch):
    """A kernel choice of the distributed Gram ops that fails runs torch's products instead, warned
    and counted as the drivers do (a rank that raised would leave the others in a collective); the
    owner's fallback starts from R as reduced, not as the failed kernel left it."""
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz_sharded, gram_space_polynomial
    from megatron_dmuon.kernels import ns_driver
    from megatron_dmuon.kernels.metrics import NONFINITE_METRICS

    wide = torch.randn(2, 32, 96, generator=torch.Generator().manual_seed(6))

    def broken(R, segment, plan, normalise):
        R.mul_(3.0)  # what a kernel may leave behind before it fails
        raise RuntimeError("no kernel")

    monkeypatch.setattr(ns_driver, "gram_segment_q", broken)
    monkeypatch.setattr(ns_driver, "_FAILED", {})
    gram, segment_q = ns_driver.sharded_gram_ops(wide, torch.float16)
    before = NONFINITE_METRICS["kernel_fallbacks"]
    ident = lambda t: t  # noqa: E731 - one shard
    kw = dict(compute_dtype=torch.float16, normalisation="quartic")
    with pytest.warns(RuntimeWarning, match="distributed gram"):
        out = gram_newton_schulz_sharded(wide, ident, segment_q, max_over_shards=ident, gram=gram, **kw)
    assert NONFINITE_METRICS["kernel_fallbacks"] > before
    reference = gram_newton_schulz_sharded(wide, ident, gram_space_polynomial, max_over_shards=ident, gram=gram, **kw)
    assert torch.equal(out, reference)
