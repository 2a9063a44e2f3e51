"""The CUTLASS sm90 symmetric-product backend (``kernels/cutlass_symmetric.py``).

* everywhere: without an SM90 GPU the backend reports itself unusable cleanly, an explicit
  ``backend='cutlass'`` raises a clear error, and ``'auto'`` never picks it;
* with nvcc and the CUTLASS headers (the ``nvidia-cutlass`` wheel or $DMUON_CUTLASS_INCLUDE):
  one translation unit compiles for sm_90a (skipped otherwise; no GPU needed);
* on an SM90 GPU: every compiled variant matches the float32 torch backend and is exactly
  symmetric (skipped elsewhere).
"""

import subprocess

import pytest
import torch

from megatron_dmuon.kernels import cutlass_symmetric as cs
from megatron_dmuon.kernels import symmetric_ops


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_cpu_tensor_is_not_usable_and_auto_never_picks_cutlass():
    x = torch.randn(2, 16, 32, dtype=torch.float16)
    assert not cs.cutlass_usable(x)
    assert not cs.cutlass_usable(x.float())
    assert symmetric_ops.resolve_backend("auto", x) != "cutlass"
    assert "cutlass" in symmetric_ops.BACKENDS


def test_explicit_cutlass_on_cpu_raises_clearly():
    x = torch.randn(2, 16, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="backend='cutlass' cannot run"):
        symmetric_ops.syrk(x, backend="cutlass")
    with pytest.raises(cs.CutlassUnavailable):
        symmetric_ops.resolve_backend("cutlass", x)


def test_missing_prerequisites_are_reported(monkeypatch, tmp_path):
    cs.missing_prerequisites.cache_clear()
    monkeypatch.setattr(cs, "nvcc_path", lambda: None)
    assert "nvcc" in cs.missing_prerequisites()
    with pytest.raises(cs.CutlassUnavailable, match="nvcc"):
        cs.build_library()
    monkeypatch.setattr(cs, "nvcc_path", lambda: "/bin/true")
    monkeypatch.setenv(cs.INCLUDE_ENV, str(tmp_path))  # no cutlass/cutlass.h there
    monkeypatch.setattr(cs.importlib.util, "find_spec", lambda name: None)
    assert cs.cutlass_include_dir() is None
    cs.missing_prerequisites.cache_clear()
    assert "CUTLASS headers" in cs.missing_prerequisites()
    monkeypatch.undo()
    cs.missing_prerequisites.cache_clear()


def test_cutlass_config_round_trip_and_autotune_choice():
    from megatron_dmuon.kernels.autotune import OpChoice

    choice = OpChoice("cutlass", cs.CutlassConfig(1, 1))
    assert OpChoice.from_dict(choice.as_dict()) == choice
    with pytest.raises(ValueError):
        cs.CutlassConfig.from_dict({"cutlass": cs.NUM_CONFIGS})
    assert len(cs.CONFIG_NAMES) == cs.NUM_CONFIGS


@pytest.mark.skipif(cs.missing_prerequisites() is not None, reason="needs nvcc and the CUTLASS headers")
def test_one_variant_compiles_for_sm90a(tmp_path):
    """One GEMM translation unit (the slowest part of a build) compiles: about a minute."""
    cmd = [cs.nvcc_path(), *cs.FLAGS, f"-I{cs.cutlass_include_dir()}", f"-I{cs.SOURCE_DIR}", "-DDMUON_CFG=0",
           "-c", str(cs.SOURCE_DIR / "sym_gemm_sm90.cu"), "-o", str(tmp_path / "g.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    mirror = [cs.nvcc_path(), *cs.FLAGS, "-c", str(cs.SOURCE_DIR / "sym_mirror.cu"), "-o", str(tmp_path / "m.o")]
    result = subprocess.run(mirror, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_cutlass_matches_torch(dtype):
    if cs.warm_up() is not None:
        pytest.skip(f"CUTLASS library unavailable: {cs.library_error()}")
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    for batch, m, k in [(3, 200, 336), (2, 512, 1024), (1, 136, 64)]:
        x = torch.randn(batch, m, k, device="cuda").to(dtype)
        ref = symmetric_ops.syrk(x, backend="torch")
        r = (ref.float() / ref.float().norm(dim=(-2, -1), keepdim=True)).to(dtype)
        poly_ref = symmetric_ops.sym_poly(r, -4.775, 2.0315, diag=1.0, backend="torch")
        axpby_ref = symmetric_ops.sym_axpby(r, poly_ref, 0.5, backend="torch")
        for index, mirror in [(i, mode) for i in range(cs.NUM_CONFIGS) for mode in cs.MIRRORS]:
            cfg = cs.CutlassConfig(index, mirror)
            out = torch.full_like(ref, float("nan"))
            symmetric_ops.syrk(x, out=out, backend="cutlass", config=cfg)
            assert torch.isfinite(out).all() and torch.equal(out, out.mT)
            assert _rel(out, ref) < tol, (batch, m, k, cfg)
            poly = symmetric_ops.sym_poly(r, -4.775, 2.0315, diag=1.0, backend="cutlass", config=cfg)
            assert torch.equal(poly, poly.mT) and _rel(poly, poly_ref) < tol, (batch, m, k, cfg)
            axpby = symmetric_ops.sym_axpby(r, poly_ref, 0.5, backend="cutlass", config=cfg)
            assert _rel(axpby, axpby_ref) < tol, (batch, m, k, cfg)


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 (Hopper) GPU")
def test_gpu_cutlass_rejects_unaligned_sizes():
    if cs.warm_up() is not None:
        pytest.skip(f"CUTLASS library unavailable: {cs.library_error()}")
    x = torch.randn(2, 100, 30, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="multiples of 8"):
        symmetric_ops.syrk(x, backend="cutlass")
