"""The kernels' public NS entry points at every scale (tests: the Triton interpreter on CPU and the
GPU run the same check): finite results equal to the unit-scale ones, no fp32 retry counted."""
from __future__ import annotations

import torch

# entries each dtype can hold (fp16: 6e-8 .. 65504)
SCALES = {torch.float32: (2.0 ** -100, 1e-30, 1e-20, 1e20, 1e30, 2.0 ** 100),
          torch.bfloat16: (2.0 ** -100, 1e-30, 1e30, 2.0 ** 100),
          torch.float16: (2.0 ** -6, 1e2)}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_entry_points_at_every_scale(wide: torch.Tensor, square: torch.Tensor, dtype: torch.dtype,
                                      exact_fp32_tol: float, **fast_kw) -> None:
    """newton_schulz_fast, gram_newton_schulz_fast (``fast_kw``: backend, cache_path, ...) and
    orthogonalize_batched on ``wide``/``square`` scaled by each of ``SCALES[dtype]``. A power-of-2
    scale keeps the input to the last bit (only the norm's rounding may differ: ``exact_fp32_tol``
    in fp32, 1e-2 in half precision); another rounds it, which moves the NS result by the dtype's
    noise (measured up to 0.030 in bf16, 0.014 in fp16)."""
    from megatron_dmuon.kernels import gram_newton_schulz_fast, newton_schulz_fast, nonfinite_metrics, orthogonalize_batched

    calls = {"standard": (lambda x: newton_schulz_fast(x, "polar_express", check_finite=True, **fast_kw),
                          (square, wide.mT.contiguous())),
             "gram": (lambda x: gram_newton_schulz_fast(x, "polar_express", check_finite=True, **fast_kw),
                      (wide, wide.mT.contiguous())),
             "batched": (lambda x: orthogonalize_batched(x, "auto", check_finite=True), (wide,))}
    for name, (call, inputs) in calls.items():
        for x in inputs:
            unit = call(x.to(dtype)).double()
            before = nonfinite_metrics()
            for scale in SCALES[dtype]:
                out = call((x * scale).to(dtype))
                assert torch.isfinite(out).all(), (name, dtype, scale)
                exact_input = float(torch.tensor(scale).log2()).is_integer()
                tol = (exact_fp32_tol if dtype == torch.float32 else 1e-2) if exact_input else (
                    5e-2 if dtype == torch.bfloat16 else 3e-2)
                assert _rel(out, unit) < tol, (name, dtype, scale, _rel(out, unit))
            after = nonfinite_metrics()
            assert after["fp32_retries"] == before["fp32_retries"], (name, dtype)
            assert after["nonfinite_outputs"] == before["nonfinite_outputs"], (name, dtype)
