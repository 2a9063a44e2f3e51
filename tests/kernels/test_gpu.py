"""The kernels on a CUDA GPU (skipped without one): Triton vs torch, autotune, CUDA graphs."""

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_symmetric_products_match_torch(dtype):
    from megatron_dmuon.kernels import sym_poly, syrk
    from megatron_dmuon.kernels.triton_symmetric import KernelConfig

    tol = 2e-3 if dtype == torch.float16 else 1e-2
    configs = [KernelConfig(), KernelConfig(128, 256, 64, 8, 3, 8), KernelConfig(64, 64, 32, 4, 4, 4)]
    for batch, m, k in [(3, 200, 333), (2, 512, 1024), (1, 130, 64)]:
        x = torch.randn(batch, m, k, device="cuda").to(dtype)
        ref = syrk(x, backend="torch")
        r = (ref.float() / ref.float().norm(dim=(-2, -1), keepdim=True)).to(dtype)
        poly_ref = sym_poly(r, -4.775, 2.0315, diag=1.0, backend="torch")
        for cfg in configs:
            out = torch.full_like(ref, float("nan"))
            syrk(x, out=out, backend="triton", config=cfg)
            assert torch.isfinite(out).all() and torch.equal(out, out.mT)
            assert _rel(out, ref) < tol, (batch, m, k, cfg)
            assert _rel(sym_poly(r, -4.775, 2.0315, diag=1.0, backend="triton", config=cfg), poly_ref) < tol


@pytest.mark.parametrize("shape", [(3, 256, 1024), (2, 1024, 256), (2, 384, 384)])
def test_gpu_gram_fast_matches_torch_and_polar(shape):
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.algorithms.newton_schulz import msgn_svd
    from megatron_dmuon.kernels import gram_newton_schulz_fast

    x = torch.randn(*shape, device="cuda")
    fast = gram_newton_schulz_fast(x, "polar_express", backend="triton", autotune=False)
    ref = gram_newton_schulz(x, "polar_express")
    exact = msgn_svd(x)
    assert fast.shape == x.shape and fast.dtype == x.dtype
    assert _rel(fast, ref) < 0.02
    assert _rel(fast, exact) <= _rel(ref, exact) + 0.01


def test_gpu_ill_conditioned_input_is_finite():
    from megatron_dmuon.kernels import gram_newton_schulz_fast

    U, _ = torch.linalg.qr(torch.randn(2, 256, 256, device="cuda", dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(2, 1024, 256, device="cuda", dtype=torch.float64))
    s = torch.logspace(0, -6, 256, device="cuda", dtype=torch.float64)
    x = ((U * s) @ V.mT).float()
    for co in ("keller", "polar_express", "you"):
        out = gram_newton_schulz_fast(x, co, backend="triton", autotune=False, check_finite=False)
        assert torch.isfinite(out).all(), co


def test_gpu_autotune_writes_cache_and_reuses_it(tmp_path):
    from megatron_dmuon.kernels import autotune, gram_newton_schulz_fast, method_tuning

    path = tmp_path / "tune.json"
    x = torch.randn(2, 128, 512, device="cuda")
    out = gram_newton_schulz_fast(x, "polar_express", cache_path=path)
    entries = json.loads(path.read_text())["entries"]
    dev = autotune.device_key(x.device)
    keys = {autotune.op_key(dev, "syrk", 128, 512, 2, torch.float16), autotune.op_key(dev, "square", 128, 128, 2, torch.float16)}
    assert keys <= set(entries)
    for key in keys:
        assert entries[key]["choice"]["backend"] in ("triton", "cublas", "quack")
        assert any("time_ms" in c for c in entries[key]["candidates"])
    mtime = path.stat().st_mtime_ns
    again = gram_newton_schulz_fast(x, "polar_express", cache_path=path)
    assert path.stat().st_mtime_ns == mtime  # reused, not re-tuned
    assert _rel(again, out) < 1e-6
    entry = method_tuning.tune_method(128, 512, 2, torch.float16, x.device, cache_path=path)
    assert entry["method"] in ("gram", "standard") and max(entry["error_vs_torch"].values()) < 0.05
    reread = tmp_path / "reread.json"  # another file: read from disk, not this process's lookups
    reread.write_bytes(path.read_bytes())
    assert autotune.cached_method(128, 512, 2, torch.float16, x.device, 5, reread) == entry["method"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="TMA needs Hopper")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_tma_kernel_matches_torch(dtype):
    from megatron_dmuon.kernels import sym_axpby, sym_poly, syrk
    from megatron_dmuon.kernels.triton_symmetric import KernelConfig, tma_applies

    tol = 2e-3 if dtype == torch.float16 else 1e-2
    configs = [KernelConfig(128, 256, 64, 8, 3, 8, tma=1), KernelConfig(128, 128, 64, 8, 3, 8, tma=2),
               KernelConfig(64, 128, 64, 4, 4, 4, tma=1)]
    for batch, m, k in [(3, 512, 1000), (2, 768, 2048), (1, 256, 64)]:  # 1000: a K tail
        x = torch.randn(batch, m, k, device="cuda").to(dtype)
        ref = syrk(x, backend="torch")
        r = (ref.float() / ref.float().norm(dim=(-2, -1), keepdim=True)).to(dtype)
        poly_ref = sym_poly(r, -4.775, 2.0315, diag=1.0, backend="torch")
        z = sym_poly(r, 1.5, 0.5, backend="torch")
        axpby_ref = sym_axpby(r, z, 3.0, backend="torch")
        for cfg in configs:
            assert tma_applies(x, x.mT, cfg) and tma_applies(r, z, cfg, b_symmetric=True)
            out = torch.full_like(ref, float("nan"))
            syrk(x, out=out, backend="triton", config=cfg)
            assert torch.isfinite(out).all() and torch.equal(out, out.mT)
            assert _rel(out, ref) < tol, (batch, m, k, cfg)
            assert _rel(sym_poly(r, -4.775, 2.0315, diag=1.0, backend="triton", config=cfg), poly_ref) < tol
            assert _rel(sym_axpby(r, z, 3.0, backend="triton", config=cfg), axpby_ref) < tol


def test_gpu_fast_path_writes_the_input_dtype_and_layout():
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.kernels import gram_newton_schulz_fast

    for shape, dtype in [((2, 1024, 256), torch.float32), ((2, 256, 1024), torch.float32), ((2, 256, 1024), torch.bfloat16)]:
        x = torch.randn(*shape, device="cuda").to(dtype)
        fast = gram_newton_schulz_fast(x, "polar_express", autotune=False)
        assert fast.shape == x.shape and fast.dtype == x.dtype and fast.is_contiguous()
        assert _rel(fast, gram_newton_schulz(x, "polar_express")) < 0.02


def test_gpu_groups_on_streams_equal_one_by_one_and_graph_replays():
    from megatron_dmuon.algorithms.schedules import schedule_for_shape
    from megatron_dmuon.kernels import GraphedGroups, orthogonalize_batched, orthogonalize_groups

    shapes = [(2, 384, 384), (2, 128, 768), (3, 256, 1024)]
    stacks = [torch.randn(*s, device="cuda") for s in shapes]
    per = [schedule_for_shape(*s[-2:]) for s in shapes]
    kw = dict(autotune=False)
    outs = orthogonalize_groups(stacks, "gram", per_stack_kwargs=per, **kw)
    torch.cuda.synchronize()
    for x, o, p in zip(stacks, outs, per):
        assert torch.equal(o, orthogonalize_batched(x, "gram", **p, **kw))  # same kernels, same data
    graphed = GraphedGroups(stacks, "gram", per_stack_kwargs=per, **kw)
    for _ in range(2):  # each replay reads the new inputs (the static buffers are overwritten)
        fresh = [torch.randn_like(x) for x in stacks]
        replayed = [o.clone() for o in graphed(fresh)]
        for x, o, p in zip(fresh, replayed, per):
            assert _rel(o, orthogonalize_batched(x, "gram", **p, **kw)) < 1e-3
    with pytest.raises(ValueError, match="captured for"):
        graphed(fresh[:2])


def test_gpu_owner_step_launch_modes_are_bit_identical(tmp_path, monkeypatch):
    """The owner's whole Muon step with its per-shape NS calls eager, on streams, or replayed
    from one captured CUDA graph (re-captured when the set of shapes changes)."""
    from megatron_dmuon.kernels.metrics import NONFINITE_METRICS
    from megatron_dmuon.runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW, with_ns_choices

    monkeypatch.setenv("DMUON_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    # a kernel failing inside the graph capture (once: a host-to-device copy in the scaled norm)
    # sends its shape to the torch path for the rest of the process: the modes must run the kernels
    fallbacks = NONFINITE_METRICS["kernel_fallbacks"]
    shapes = [(256, 1024)] * 3 + [(512, 512)] * 2 + [(64, 256)] * 4
    finals, graph_counts = [], []
    for launch in ("eager", "streams", "graph"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s, device="cuda")) for s in shapes]
        opt = OwnerMuonAdamW([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.01,
                             muon=MuonSettings(ns_method="auto", coefficients="adaptive", ns_launch=launch))
        infos = with_ns_choices([MatrixInfo(f"w{i}", tuple(q.shape)) for i, q in enumerate(params)], opt.muon, "cuda")
        for q, info in zip(params, infos):
            opt.register_matrix(q, info)
        for step in range(4):
            for i, q in enumerate(params):
                # step 3 leaves the last matrix out: another set of stack shapes, another graph
                q.grad = None if (step == 3 and i == len(params) - 1) else torch.randn_like(q)
            opt.step()
        torch.cuda.synchronize()
        finals.append([q.detach().clone() for q in params])
        graph_counts.append(len(opt._graphs))
    assert graph_counts == [0, 0, 2]
    assert NONFINITE_METRICS["kernel_fallbacks"] == fallbacks
    for other in finals[1:]:
        for a, b in zip(finals[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("launch", ["eager", "streams", "graph"])
def test_gpu_overlapped_owner_step_is_bit_identical_to_its_sync_twin(tmp_path, monkeypatch, launch):
    """--dmuon-overlap-step on the GPU: each need group's NS launched on a side stream by step()
    and finished later, in need order, while other work (a stand-in forward: GEMMs on the current
    stream) runs, gives bit for bit the params of the same per-group stacks run inside step()
    ('sync'), with the kernels' auto NS (Gram and standard, Triton) under each launch mode."""
    from megatron_dmuon.runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW, with_ns_choices

    monkeypatch.setenv("DMUON_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    shapes = [(512, 3584), (3584, 512), (1024, 1024), (512, 3584), (256, 1024), (1024, 1024)]
    needs = [0, 0, 1, 1, 2, 2]
    finals = {}
    for mode in ("sync", "on"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s, device="cuda")) for s in shapes]
        opt = OwnerMuonAdamW([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.01,
                             muon=MuonSettings(ns_method="auto", ns_launch=launch, overlap_step=mode))
        applied = []
        opt.on_applied = applied.append
        infos = [MatrixInfo(f"w{i}", tuple(q.shape), need=needs[i]) for i, q in enumerate(params)]
        for q, info in zip(params, with_ns_choices(infos, opt.muon, "cuda")):
            opt.register_matrix(q, info)
        work = torch.randn(4096, 4096, device="cuda")
        for step in range(4):
            for q in params:
                q.grad = torch.randn_like(q)
            opt.step()
            for need in range(3):  # the next forward: each group finished just before its layers run
                opt.finish_need_group(need)
                work = torch.tanh(work @ work) * 0.5
        torch.cuda.synchronize()
        assert not opt.needs_in_flight() and len(applied) == 4 * 3 and opt.stats["overlap_groups_left"] == 0
        finals[mode] = [q.detach().clone() for q in params]
    for a, b in zip(finals["sync"], finals["on"]):
        assert torch.equal(a, b)


def test_gpu_quartic_schedules_match_the_torch_path_and_the_polar_factor():
    """The per-shape quartic schedules on the kernels (fused rescale, no Gram restart) against the
    algorithms' torch path and the exact polar factor; zero matrices stay zero; every scale
    bf16/fp32 holds gives the same result."""
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz
    from megatron_dmuon.algorithms.newton_schulz import msgn_svd, newton_schulz
    from megatron_dmuon.algorithms.schedules import schedule_for_shape
    from megatron_dmuon.kernels import orthogonalize_batched

    for shape, method, reference in [((3, 256, 1024), "gram", gram_newton_schulz), ((3, 1024, 256), "gram", gram_newton_schulz),
                                     ((3, 512, 512), "standard", newton_schulz)]:
        x = torch.randn(*shape, device="cuda")
        x[1] = 0.0
        kw = dict(schedule_for_shape(*shape[-2:]), compute_dtype=torch.float16)
        fast = orthogonalize_batched(x, method, autotune=False, **kw)
        assert fast[1].abs().max() == 0
        assert _rel(fast, reference(x, **kw)) < 0.02
        exact = msgn_svd(x[[0, 2]].cpu())
        assert _rel(fast[[0, 2]].cpu(), exact) < 0.1  # measured 0.009 (wide), 0.05 (512²)
        from megatron_dmuon.kernels import nonfinite_metrics

        before = nonfinite_metrics()["fp32_retries"]
        for scale in (1e-30, 1e-20, 1e20, 1e30):  # the scaled norm: no retry at any scale
            assert _rel(orthogonalize_batched(x * scale, method, autotune=False, check_finite=True, **kw), fast) < 1e-2
        assert nonfinite_metrics()["fp32_retries"] == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_apply_equals_the_torch_ops(dtype):
    # one pass over the master weights, the roundings of mul_ then add_(alpha) (and of the piece's
    # lr multiplier applied first, as muon_direction does)
    from megatron_dmuon.algorithms.muon import muon_apply_
    from megatron_dmuon.kernels.fused_muon import muon_apply_fast_

    torch.manual_seed(0)
    for n, piece_scale in [(1000003, 1.0), (4096 * 3, 1.7320508)]:
        p = torch.randn(n, device="cuda").to(dtype)
        o = torch.randn(n, device="cuda")
        ref = p.clone()
        muon_apply_(ref, o * piece_scale if piece_scale != 1.0 else o, 0.02, 0.1, 1.3)
        ours = p.clone()
        muon_apply_fast_(ours, o, 0.02, 0.1, 1.3 if piece_scale == 1.0 else 1.0, piece_scale)
        if piece_scale != 1.0:
            ref = p.clone()
            muon_apply_(ref, o * piece_scale, 0.02, 0.1, 1.0)
        assert torch.equal(ours, ref), (n, float((ours.double() - ref.double()).abs().max()))


@pytest.mark.parametrize("piece_scale", [1.0, 0.75])
def test_gpu_fused_apply_reads_a_narrow_update_as_its_float32_value(piece_scale):
    # the owner step hands the NS output in the compute dtype (fp16): the fused apply equals the
    # torch path on that output cast to float32 (what muon_direction does on the general path)
    from megatron_dmuon.algorithms.muon import muon_apply_
    from megatron_dmuon.kernels.fused_muon import muon_apply_fast_

    torch.manual_seed(2)
    p = torch.randn(1000003, device="cuda")
    o = (torch.randn(1000003, device="cuda") * 0.01).half()
    ref, ours = p.clone(), p.clone()
    muon_apply_(ref, o.float() * piece_scale, 0.02, 0.1, 1.0 if piece_scale != 1.0 else 1.3)
    muon_apply_fast_(ours, o, 0.02, 0.1, 1.0 if piece_scale != 1.0 else 1.3, piece_scale)
    assert torch.equal(ours, ref)


def test_gpu_ns_result_in_the_compute_dtype_is_the_float32_result_rounded_once():
    # out_dtype=fp16: the last product writes fp16 itself; the float32 result rounded to fp16
    # differs by at most one fp16 rounding of that product (last-bit differences, not more)
    from megatron_dmuon.algorithms.schedules import schedule_for_shape
    from megatron_dmuon.kernels import orthogonalize_batched

    torch.manual_seed(3)
    for shape in ((2, 256, 256), (3, 128, 512), (2, 512, 128)):
        x = torch.randn(*shape, device="cuda")
        kw = dict(schedule_for_shape(*shape[-2:]), compute_dtype=torch.float16)
        wide = orthogonalize_batched(x, "auto", **kw)
        narrow = orthogonalize_batched(x, "auto", out_dtype=torch.float16, **kw)
        assert wide.dtype == torch.float32 and narrow.dtype == torch.float16 and narrow.shape == x.shape
        assert float((narrow.float() - wide).abs().max()) <= 2 * float(wide.abs().max()) * 2 ** -11


@pytest.mark.parametrize("beta,nesterov,clip", [(0.95, True, None), (0.9, False, None), (0.3, True, None),
                                                (0.95, True, 0.3716), (0.9, False, 1 / 3)])
def test_gpu_fused_momentum_equals_the_torch_ops(beta, nesterov, clip):
    # momentum.lerp_(grad, 1 - beta) and grad.lerp(momentum, beta) in one pass: the same bits;
    # with a clip coefficient, as if Megatron's clip (grad * coefficient) ran first
    from megatron_dmuon.algorithms.muon import muon_momentum_
    from megatron_dmuon.kernels.fused_muon import muon_momentum_fast_

    torch.manual_seed(1)
    m, g = torch.randn(1000003, device="cuda") * 1e-3, torch.randn(1000003, device="cuda")
    m_ref, m_ours = m.clone(), m.clone()
    ref = muon_momentum_(m_ref, g if clip is None else g * clip, beta, nesterov).clone()
    out = torch.empty_like(g)
    assert muon_momentum_fast_(m_ours, g, beta, nesterov, out, grad_scale=clip) is out
    assert torch.equal(m_ours, m_ref) and torch.equal(out, ref)


def test_gpu_owner_step_with_adamw_on_a_side_stream_is_deterministic(tmp_path, monkeypatch):
    """AdamW (element-wise params) runs on a side stream concurrently with the Muon step: the
    result equals the one-stream order, bit for bit, run after run; gradient clipping handed to the
    step (grad_scale) equals clipping the grads first."""
    from megatron_dmuon.runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW, with_ns_choices

    monkeypatch.setenv("DMUON_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    shapes = [(1024, 4096)] * 3 + [(1024, 1024)] * 2

    def run(overlap, clip_in_step=True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s, device="cuda")) for s in shapes]
        vectors = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (4_000_000, 1024, 77)]
        opt = OwnerMuonAdamW([{"params": params, "use_muon": True}, {"params": vectors, "use_muon": False}],
                             lr=0.02, weight_decay=0.01,
                             muon=MuonSettings(ns_method="auto", coefficients="adaptive", ns_launch="graph"))
        if not overlap:
            monkeypatch.setattr(opt, "_side_stream", lambda device: None)
        infos = with_ns_choices([MatrixInfo(f"w{i}", tuple(q.shape)) for i, q in enumerate(params)], opt.muon, "cuda")
        for q, info in zip(params, infos):
            opt.register_matrix(q, info)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(4):
            for q in params + vectors:
                q.grad = torch.randn(q.shape, device="cuda", generator=gen)
                if not clip_in_step:  # Megatron's own clipping pass
                    q.grad = q.grad * 0.37
            if clip_in_step:  # the same clipping, handed to the step (fused into the momentum pass)
                opt.grad_scale = 0.37
            opt.step()
        torch.cuda.synchronize()
        return [q.detach().clone() for q in params + vectors]

    sequential, first, second = run(False, clip_in_step=False), run(True), run(True)
    for a, b, c in zip(sequential, first, second):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_gpu_float64_sum_of_squares_equals_the_float64_norm():
    """The grad norm's kernel on the GPU: torch's float64 norm to float64 rounding (fp32, bf16,
    partial blocks, squares past float32's range)."""
    from megatron_dmuon.kernels.grad_norm import sum_of_squares_float64

    gen = torch.Generator(device="cuda").manual_seed(5)
    grads = [torch.randn(10_000_019, device="cuda", generator=gen), torch.full((8193,), 3e19, device="cuda"),
             torch.randn(4096, 37, device="cuda", generator=gen).to(torch.bfloat16)]
    exact = sum(float(torch.linalg.vector_norm(g.double()).square()) for g in grads)
    assert abs(float(sum_of_squares_float64(grads, grads[0].device)) / exact - 1) < 1e-14


def test_gpu_owner_adamw_is_torch_fused_adamw_and_takes_cpu_step_counters():
    """On CUDA the element-wise params step by torch's fused AdamW: bit-equal to
    torch.optim.AdamW(fused=True), within fp32 rounding of the foreach AdamW; step counters
    left on the CPU (a checkpoint loaded by DMuon's code) are moved to the params' device."""
    from megatron_dmuon.runtime.owner_step import OwnerMuonAdamW

    torch.manual_seed(0)
    ref_params = [torch.randn(300, 7, device="cuda"), torch.randn(1000, device="cuda")]
    ours_p = [torch.nn.Parameter(p.clone()) for p in ref_params]
    fused_p = [torch.nn.Parameter(p.clone()) for p in ref_params]
    foreach_p = [torch.nn.Parameter(p.clone()) for p in ref_params]
    ours = OwnerMuonAdamW([{"params": ours_p}], lr=1e-2, weight_decay=0.1)
    assert ours.param_groups[0]["fused"]
    fused = torch.optim.AdamW(fused_p, lr=1e-2, weight_decay=0.1, fused=True)
    foreach = torch.optim.AdamW(foreach_p, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(5):
        grads = [torch.randn_like(p) for p in ref_params]
        for ps in (ours_p, fused_p, foreach_p):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        if step == 2:  # as a DMuon checkpoint load leaves them
            for p in ours_p:
                ours.state[p]["step"] = ours.state[p]["step"].cpu()
        ours.step(), fused.step(), foreach.step()
    for a, b, c in zip(ours_p, fused_p, foreach_p):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_gpu_distributed_gram_ns_runs_on_the_symmetric_kernels(tmp_path):
    """The TP path's distributed Gram NS with the kernels' ops, one shard with local callbacks: equal
    to the kernel driver on the whole matrix to fp16 rounding (tests/kernels/test_triton_symmetric.py
    checks the same in the interpreter)."""
    from megatron_dmuon.algorithms.gram_newton_schulz import gram_newton_schulz_sharded
    from megatron_dmuon.kernels import gram_newton_schulz_fast
    from megatron_dmuon.kernels.ns_driver import sharded_gram_ops

    wide = torch.randn(2, 512, 2048, device="cuda")
    gram, segment_q = sharded_gram_ops(wide, torch.float16, cache_path=tmp_path / "tune.json")
    ident = lambda t: t  # noqa: E731 - one shard
    out = gram_newton_schulz_sharded(wide, ident, segment_q, max_over_shards=ident, gram=gram,
                                     compute_dtype=torch.float16)
    assert _rel(out, gram_newton_schulz_fast(wide, cache_path=tmp_path / "tune.json")) < 5e-3


from megatron_dmuon.testing.ns_scales import SCALES  # noqa: E402


@pytest.mark.parametrize("dtype", list(SCALES))
def test_gpu_public_entry_points_need_no_retry_at_any_scale(dtype, tmp_path):
    """[fast-default] item 3 on the GPU (the interpreter test's twin): newton_schulz_fast,
    gram_newton_schulz_fast, orthogonalize_batched give finite results equal to the unit-scale ones
    for entries from 1e-30 to 1e30, and no fp32 retry is counted."""
    from megatron_dmuon.testing.ns_scales import check_entry_points_at_every_scale

    gen = torch.Generator(device="cuda").manual_seed(10)
    wide = torch.randn(2, 256, 768, device="cuda", generator=gen)
    square = torch.randn(2, 256, 256, device="cuda", generator=gen)
    check_entry_points_at_every_scale(wide, square, dtype, exact_fp32_tol=1e-5, cache_path=tmp_path / "tune.json")
