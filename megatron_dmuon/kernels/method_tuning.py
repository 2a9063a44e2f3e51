"""Gram vs standard NS per [B, m, n] stack: measured on the GPU, stored in the autotune cache.

Kept above both ``autotune`` (cache, keys, timing) and ``ns_driver`` (the NS drivers it
times) so the imports run one way: ``method_tuning`` → ``ns_driver`` → ``autotune``.
"""

from __future__ import annotations

import time

import torch

from ..algorithms.gram_newton_schulz import gram_newton_schulz
from ..algorithms.ns_dispatch import method_compute_dtype
from ..algorithms.newton_schulz import newton_schulz
from .autotune import device_key, get_cache, method_key, relative_error, time_cuda_ms
from .ns_driver import gram_newton_schulz_fast, newton_schulz_fast

__all__ = ["tune_method", "METHOD_TOLERANCE"]

# Relative Frobenius tolerance of a whole orthogonalization vs the torch path of the same method.
METHOD_TOLERANCE = 5e-2


def tune_method(
    m: int, n: int, batch: int, dtype: torch.dtype, device: torch.device, *,
    coefficients="polar_express", steps: int = 5, cache_path=None, restart_after=None, normalisation: str = "frobenius",
) -> dict:
    """Time Gram vs standard NS on a [batch, m, n] stack, each checked against its torch path.

    Tunes the product kernels first (so they are cached), then stores and returns
    ``{'method', 'time_ms': {...}, 'error_vs_torch': {...}}``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"tune_method measures on a CUDA device; got {device}")
    if m > n:
        m, n = n, m
    cache = get_cache(cache_path)
    gen = torch.Generator(device=device).manual_seed(4321)
    x = torch.randn(batch, m, n, device=device, generator=gen)
    common = dict(coefficients=coefficients, steps=steps, compute_dtype=dtype, check_finite=False, normalisation=normalisation)
    # each method at the dtype an optimizer runs it in for this precision (Gram: fp16 for bf16)
    gram_kw = dict(common, compute_dtype=method_compute_dtype("gram", dtype), restart_after=restart_after,
                   min_aspect_ratio=1.0)
    runs = {
        "gram": (lambda: gram_newton_schulz_fast(x, **gram_kw, cache_path=cache_path), lambda: gram_newton_schulz(x, **gram_kw)),
        "standard": (lambda: newton_schulz_fast(x, **common, cache_path=cache_path), lambda: newton_schulz(x, **common)),
    }
    times, errors = {}, {}
    for name, (fast, reference) in runs.items():
        errors[name] = relative_error(fast(), reference())
        if errors[name] <= METHOD_TOLERANCE:
            times[name] = time_cuda_ms(fast, target_ms=100.0, max_reps=20)
    if not times:
        raise RuntimeError(f"autotune: neither method matched its torch path for {batch}x{m}x{n}: {errors}")
    entry = {"method": min(times, key=times.get), "time_ms": times, "error_vs_torch": errors, "tuned_at": time.time()}
    cache.put(method_key(device_key(device), m, n, batch, dtype, steps), entry)
    return entry
