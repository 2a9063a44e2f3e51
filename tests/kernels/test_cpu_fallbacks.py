"""Kernels package on CPU without the Triton interpreter: torch fallbacks, dispatch, cache, CLI.

The Triton kernels themselves run in tests/kernels/test_triton_symmetric.py (TRITON_INTERPRET=1).
"""

import json
import warnings

import pytest
import torch

from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
from megatron_dmuon.algorithms.newton_schulz import newton_schulz
from megatron_dmuon.kernels import (
    AutotuneCache,
    gram_newton_schulz_fast,
    newton_schulz_fast,
    orthogonalize_batched,
    sym_axpby,
    sym_matmul,
    sym_poly,
    syrk,
)
from megatron_dmuon.kernels import autotune, autotune_cli, metrics, symmetric_ops
from megatron_dmuon.algorithms.flops import ns_method_for


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _sym(m, batch=2, dtype=torch.float32, seed=0):
    g = torch.randn(batch, m, m, generator=torch.Generator().manual_seed(seed))
    r = (g + g.mT) / 2
    return (r / r.norm(dim=(-2, -1), keepdim=True)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_fallback_matches_formula_and_is_exactly_symmetric(dtype):
    r = _sym(24, dtype=dtype)
    out = sym_matmul(r, r, c=r, alpha=2.0, beta=-3.0, diag=0.5, backend="torch")
    rf = r.double()
    ref = 2.0 * rf @ rf - 3.0 * rf + 0.5 * torch.eye(24, dtype=torch.float64)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype and out.shape == (2, 24, 24)
    assert _rel(out, ref) < tol
    assert torch.equal(out, out.mT)
    # The mirrored triangle is the computed upper one, bit for bit.
    assert torch.equal(torch.triu(out, 1), torch.triu(out, 1).mT.mT)


def test_syrk_poly_axpby_torch_semantics():
    x = torch.randn(3, 10, 30)
    s = syrk(x, backend="torch")
    assert _rel(s, x.double() @ x.double().mT) < 1e-6
    r = _sym(10, batch=3)
    p = sym_poly(r, -4.775, 2.0315, diag=3.4445, backend="torch")
    assert _rel(p, -4.775 * r.double() + 2.0315 * r.double() @ r.double() + 3.4445 * torch.eye(10).double()) < 1e-6
    z = sym_poly(r, 1.5, 0.5, backend="torch")  # commutes with r
    q = sym_axpby(r, z, 3.0, backend="torch")
    assert _rel(q, 3.0 * r.double() + r.double() @ z.double()) < 1e-6


def test_backend_errors_name_the_problem():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        syrk(x, backend="magma")
    with pytest.raises(ValueError, match="backend='triton'"):
        syrk(x, backend="triton")  # fp32 on CPU without the interpreter
    with pytest.raises(ValueError, match="backend='cublas' needs a CUDA tensor"):
        syrk(x.half(), backend="cublas")
    with pytest.raises(ValueError, match="b must be"):
        sym_matmul(torch.randn(4, 8), torch.randn(4, 8), backend="torch")


def test_upper_tile_list_covers_each_upper_element_once():
    from megatron_dmuon.kernels.triton_symmetric import upper_tile_list

    for m, bm, bn, group in [(100, 32, 32, 2), (100, 32, 64, 3), (64, 64, 16, 1), (5, 16, 16, 8)]:
        count = torch.zeros(m, m, dtype=torch.int32)
        for i, j in upper_tile_list(m, bm, bn, group):
            count[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] += 1
        upper = torch.ones(m, m, dtype=torch.bool).triu()
        assert torch.all(count[upper] == 1), (m, bm, bn)
        assert len(set(upper_tile_list(m, bm, bn, group))) == len(upper_tile_list(m, bm, bn, group))


def test_kernel_config_validation():
    from megatron_dmuon.kernels.triton_symmetric import KernelConfig

    with pytest.raises(ValueError, match="block_k must be a power of two"):
        KernelConfig(block_k=48).validate()
    with pytest.raises(ValueError, match="unknown keys"):
        KernelConfig.from_dict({"block_m": 64, "tile": 3})
    cfg = KernelConfig(64, 128, 32, 4, 3, 2)
    assert KernelConfig.from_dict(cfg.as_dict()) == cfg
    tma = KernelConfig(128, 256, 64, 8, 3, 8, tma=2)
    assert KernelConfig.from_dict(tma.as_dict()) == tma
    # Entries written before the TMA kernel existed load as pointer-kernel configs.
    old = {k: v for k, v in cfg.as_dict().items() if k != "tma"}
    assert KernelConfig.from_dict(old).tma == 0
    with pytest.raises(ValueError, match="tma must be 0"):
        KernelConfig(tma=3).validate()


def test_tma_path_needs_k_contiguous_operands_and_tile_multiple_m():
    from megatron_dmuon.kernels.triton_symmetric import KernelConfig, tma_applies

    cfg = KernelConfig(32, 32, 32, 4, 1, 2, tma=1)
    x = torch.randn(2, 64, 96).half()
    r = torch.randn(2, 64, 64).half()
    # Off the GPU (and without the interpreter) the TMA kernel never applies.
    assert not tma_applies(x, x.mT, cfg)
    assert not tma_applies(r, r, KernelConfig(32, 32, 32, 4, 1, 2), b_symmetric=True)


@pytest.mark.parametrize("shape", [(2, 16, 48), (40, 12), (2, 2, 20, 20)])
def test_fast_entry_points_fall_back_to_the_algorithms_exactly_on_cpu(shape):
    x = torch.randn(*shape)
    kw = dict(coefficients="polar_express", steps=5)
    for backend in ("auto", "torch"):
        assert torch.equal(gram_newton_schulz_fast(x, **kw, backend=backend), gram_newton_schulz(x, **kw))
        assert torch.equal(newton_schulz_fast(x, **kw, backend=backend), newton_schulz(x, **kw))
    fp32 = gram_newton_schulz_fast(x, compute_dtype=torch.float32)
    assert torch.equal(fp32, gram_newton_schulz(x, compute_dtype=torch.float32))
    narrow = orthogonalize_batched(x, "auto", out_dtype=torch.float16, **kw)
    assert narrow.dtype == torch.float16 and torch.equal(narrow, orthogonalize_batched(x, "auto", **kw).half())


def test_fast_entry_point_argument_errors():
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match="backend must be one of"):
        gram_newton_schulz_fast(x, backend="cuda")
    with pytest.raises(ValueError, match="backend='triton' needs"):
        gram_newton_schulz_fast(x, backend="triton", compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="min_aspect_ratio"):
        gram_newton_schulz_fast(x, min_aspect_ratio=0.5)
    with pytest.raises(ValueError, match="NaN or Inf"):
        gram_newton_schulz_fast(torch.full((4, 8), float("nan")), check_finite=True)
    with pytest.raises(ValueError, match="method must be one of"):
        orthogonalize_batched(torch.randn(2, 4, 8), method="svd")


def test_owner_step_auto_method_comes_from_the_kernels(monkeypatch):
    """--dmuon-ns-method auto on CUDA: the owner step's choice (planning.ns_choice.NSResolver) reads the kernels'
    autotune lookup (megatron_dmuon.kernels.measured_method), else counts FLOPs, so a wide stack runs Gram NS
    (an import that fails would silently run standard NS everywhere); off CUDA the torch path's standard NS.
    The resolver's FLOPs are those of what it chose (the planner's owner cost)."""
    from megatron_dmuon.planning.params import ns_flops
    from megatron_dmuon.runtime import muon_settings
    from megatron_dmuon.runtime.owner_step import MuonSettings

    asked = []
    monkeypatch.setattr(muon_settings, "measured_method",
                        lambda device, cache_path=None: (lambda *key: asked.append(key)))
    settings = MuonSettings(ns_method="auto", ns_dtype=torch.bfloat16)
    gram = settings.ns_resolver("cuda").choice(512, 3584, 2)
    assert (gram.method, gram.compute_dtype, gram.runs) == ("gram", torch.float16, "gram")
    assert settings.ns_resolver("cuda").choice(512, 512, 2).method == "standard"
    assert settings.ns_resolver("cpu").choice(8, 64, 2).method == "standard"
    assert asked == [(512, 3584, 2, torch.bfloat16, 5), (512, 512, 2, torch.bfloat16, 5)]
    assert settings.ns_resolver("cuda").flops(512, 3584, 2) == ns_flops(512, 3584, 5, "gram")
    monkeypatch.setattr(muon_settings, "measured_method", lambda device, cache_path=None: (lambda *key: "standard"))
    assert settings.ns_resolver("cuda").choice(512, 3584, 2).method == "standard"  # a measurement outranks the FLOPs
    assert settings.ns_resolver("cuda").flops(512, 3584, 2) == ns_flops(512, 3584, 5, "standard")  # ... and its cost


def test_auto_method_follows_flops():
    assert ns_method_for(3584, 3584) == "standard"
    assert ns_method_for(512, 3584) == "gram"
    assert ns_method_for(18944, 3584) == "gram"
    assert ns_method_for(100, 150) == "standard"  # below min_aspect_ratio Gram would run standard anyway
    # a forced method is what runs: Gram only where it applies
    assert ns_method_for(100, 150, ns_method="gram") == "standard" and ns_method_for(100, 200, ns_method="gram") == "gram"
    assert ns_method_for(512, 3584, ns_method="standard") == "standard"
    with pytest.raises(ValueError, match="ns_method must be one of"):
        ns_method_for(512, 3584, ns_method="svd")
    x = torch.randn(2, 8, 40)
    assert torch.equal(orthogonalize_batched(x, "auto"), gram_newton_schulz_fast(x))
    sq = torch.randn(2, 12, 12)
    assert torch.equal(orthogonalize_batched(sq, "auto", compute_dtype=torch.float16),
                       newton_schulz_fast(sq, compute_dtype=torch.float16))


def test_cache_path_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv(autotune.CACHE_ENV, raising=False)
    assert autotune.default_cache_path().parts[-3:] == (".cache", "megatron_dmuon", "autotune.json")
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "env.json"))
    assert autotune.default_cache_path() == tmp_path / "env.json"
    assert AutotuneCache().path == tmp_path / "env.json"
    assert AutotuneCache(tmp_path / "arg.json").path == tmp_path / "arg.json"


def test_cache_roundtrip_merge_and_corruption(tmp_path):
    path = tmp_path / "sub" / "tune.json"
    first, second = AutotuneCache(path), AutotuneCache(path)
    first.put("op|gpu|syrk|m8|k8|b1|float16", {"choice": {"backend": "cublas", "config": None}})
    second.put("method|gpu|8x16|b1|float16|T5", {"method": "gram"})  # must not drop first's key
    data = json.loads(path.read_text())
    assert data["version"] == autotune.CACHE_VERSION and len(data["entries"]) == 2
    assert AutotuneCache(path).get("method|gpu|8x16|b1|float16|T5") == {"method": "gram"}
    path.write_text(path.read_text()[:60])  # a file of ours cut short (another file is refused: tests/planning/test_caches.py)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert AutotuneCache(path).entries == {}
    assert any("unreadable" in str(w.message) for w in caught)


def test_op_choice_serialisation_and_cpu_default():
    from megatron_dmuon.kernels.triton_symmetric import KernelConfig

    choice = autotune.OpChoice("triton", KernelConfig(64, 64, 32, 4, 2, 4))
    assert autotune.OpChoice.from_dict(json.loads(json.dumps(choice.as_dict()))) == choice
    cpu_choice = autotune.op_choice("syrk", 32, 96, 2, torch.float16, torch.device("cpu"), autotune=True)
    assert cpu_choice.backend == "triton" and cpu_choice.config == autotune.default_config(torch.device("cpu"), 32, 96)
    assert autotune.cached_method(8, 16, 1, torch.float16, torch.device("cpu"), 5) is None


def test_metrics_reset():
    metrics.NONFINITE_METRICS["fp32_retries"] += 3
    assert metrics.nonfinite_metrics()["fp32_retries"] >= 3
    metrics.reset_nonfinite_metrics()
    assert set(metrics.nonfinite_metrics().values()) == {0}


def test_quack_is_optional():
    assert symmetric_ops.quack_usable(torch.zeros(2, 2, dtype=torch.float16)) is False
    with pytest.raises(ValueError, match="quack"):
        syrk(torch.zeros(2, 2, dtype=torch.float16), backend="quack")


def test_cli_model_shapes_and_dry_run(capsys):
    shapes = autotune_cli.model_shapes(3584, 18944, 28, 4, split_qkv=True, split_fc1=True)
    assert shapes == {"q": (3584, 3584), "k": (512, 3584), "v": (512, 3584), "linear_proj": (3584, 3584),
                      "gate": (18944, 3584), "up": (18944, 3584), "linear_fc2": (3584, 18944)}
    fused = autotune_cli.model_shapes(3584, 18944, 28, 4)
    assert fused["linear_qkv"] == (4608, 3584) and fused["linear_fc1"] == (37888, 3584)
    items = autotune_cli.work_items(shapes, [1, 8])
    assert [(m, n, b) for m, n, b, _ in items] == [(512, 3584, 1), (512, 3584, 8), (3584, 3584, 1),
                                                  (3584, 3584, 8), (3584, 18944, 1), (3584, 18944, 8)]
    rc = autotune_cli.main(["--hidden", "3584", "--ffn", "18944", "--heads", "28", "--query-groups", "4",
                            "--split-qkv", "--split-fc1", "--layers", "28", "--batches", "1,8", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "6 (shape, batch) items" in out and "3584x18944 batch 8" in out


def test_cli_rejects_bad_arguments(capsys):
    assert autotune_cli.main(["--shapes", "12by4"]) == 2
    assert "ROWSxCOLS" in capsys.readouterr().err
    assert autotune_cli.main(["--hidden", "64"]) == 2
    assert autotune_cli.main([]) == 2
    assert autotune_cli.main(["--hidden", "64", "--ffn", "128", "--heads", "6"]) == 2  # 64 % 6 != 0


def test_orthogonalize_groups_off_cuda_runs_the_stacks_one_by_one():
    from megatron_dmuon.algorithms.schedules import schedule_for_shape
    from megatron_dmuon.kernels import orthogonalize_groups

    gen = torch.Generator().manual_seed(21)
    stacks = [torch.randn(2, 12, 12, generator=gen), torch.randn(3, 8, 40, generator=gen), torch.randn(1, 40, 8, generator=gen)]
    per = [schedule_for_shape(*s.shape[-2:]) for s in stacks]
    outs = orthogonalize_groups(stacks, "auto", per_stack_kwargs=per, compute_dtype=torch.float16)
    for s, o, p in zip(stacks, outs, per):
        assert torch.equal(o, orthogonalize_batched(s, "auto", compute_dtype=torch.float16, **p))
    outs = orthogonalize_groups(stacks, ["standard", "gram", "gram"])
    assert torch.equal(outs[1], orthogonalize_batched(stacks[1], "gram"))
    with pytest.raises(ValueError, match="one dict per stack"):
        orthogonalize_groups(stacks, per_stack_kwargs=per[:2])
    with pytest.raises(ValueError, match="one name or one per stack"):
        orthogonalize_groups(stacks, ["gram"])
    with pytest.raises(ValueError, match="non-empty list"):
        orthogonalize_groups(stacks[0])
    with pytest.raises(ValueError, match=r"stacks\[1\] must be a tensor"):
        orthogonalize_groups([stacks[0], torch.randn(5)])
