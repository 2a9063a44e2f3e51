"""Fast Newton–Schulz drivers: the algorithms' recurrences on the symmetric kernels.

``gram_newton_schulz_fast`` and ``newton_schulz_fast`` keep the contracts of
``megatron_dmuon.algorithms.gram_newton_schulz`` / ``newton_schulz`` (shape and dtype of x,
any leading batch dims, tall inputs transposed, zeros → zeros, the same normalisation and
schedule). With ``backend='torch'`` — or when no GPU/Triton path fits the input — they *are*
those functions. Otherwise every symmetric product runs on the backend the autotune cache
chose for this shape (Triton kernel, cuBLAS or quack) and the m×n products ``Q X`` / ``B X``
on cuBLAS.

Gram recurrence on the fast path (wide X, m <= n), identical in exact arithmetic to the
algorithms' version (all m×m matrices are polynomials in R₀ and commute):

    R = X Xᵀ                                  syrk
    per step t with (a, b, c):
        Z' = b R + c R²                        sym_poly
        if the segment continues:  W = a R + R Z';  R = a W + W Z'     two sym_axpby
        Q = a I + Z'  (segment start)  |  Q = a Q + Q Z'               sym_axpby
        after a restart step:  X = Q X;  R = X Xᵀ;  Q = I
    result Q X

``check_finite=True`` validates the input (ValueError on NaN/Inf, as the algorithms do) and
checks every output matrix: one holding NaN/Inf is recomputed by the float32 torch path and
counted in ``metrics.NONFINITE_METRICS``.
"""

from __future__ import annotations

from collections.abc import Iterable
import sys
import warnings

import torch
from torch import Tensor

from ..algorithms.coefficients import get_coefficients
from ..algorithms.flops import NS_METHODS, ns_method_for
from ..algorithms.gram_newton_schulz import (
    GRAM_MIN_ASPECT_RATIO, default_restarts, gram_applies, gram_newton_schulz, gram_segments, gram_space_polynomial,
    restart_points, validate_min_aspect_ratio,
)
from ..algorithms.newton_schulz import (
    NS_EPS, safe_reciprocal, newton_schulz, validate_compute_dtype, validate_eps, validate_matrix_input,
    validate_normalisation,
)
from . import symmetric_ops
from .autotune import CACHE_ENV, ShapePlan, cached_method, shape_plan
from .metrics import NONFINITE_METRICS, retry_nonfinite

__all__ = [
    "gram_newton_schulz_fast", "newton_schulz_fast", "orthogonalize_batched", "fast_path_usable",
    "resolve_method", "sharded_gram_ops",
]

FAST_BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


def fast_path_usable(x: Tensor, compute_dtype: torch.dtype) -> bool:
    """Whether the kernel path can run: fp16/bf16 compute on a usable GPU (or the interpreter)."""
    return compute_dtype in symmetric_ops.TRITON_DTYPES and symmetric_ops.triton_usable(
        torch.empty(0, dtype=compute_dtype, device=x.device)
    )


def _sym(choice, a, b, *, c=None, alpha=1.0, beta=0.0, diag=0.0, b_symmetric=True) -> Tensor:
    out = torch.empty((*a.shape[:-1], a.shape[-2]), dtype=a.dtype, device=a.device)
    return symmetric_ops.sym_matmul(
        a, b, c=c, alpha=alpha, beta=beta, diag=diag, out=out, backend=choice.backend, config=choice.config,
        b_symmetric=b_symmetric,
    )


def _syrk(choice, X) -> Tensor:
    return _sym(choice, X, X.mT, b_symmetric=False)


def _normalised_wide(stack: Tensor, compute_dtype: torch.dtype, eps: float) -> tuple[Tensor, bool]:
    """The algorithms' normalisation ``X / max(‖X‖_F, eps)``, written to a contiguous wide
    [B, m, n] buffer of the compute dtype (scale, cast and, for tall inputs, transpose), so the
    kernels read row-major operands. The norm is the scaled one (``triton_cast.scaled_norm_reciprocal``:
    max and scaled sum of squares in one read), right at every scale of finite entries: no
    matrix needs the float32 retry for its norm (a plain float32 norm overflows at entries ~1e20
    and underflows its squares at ~1e-20)."""
    from .triton_cast import scale_cast, scaled_norm_reciprocal  # the fast path runs only where Triton does

    transposed = stack.size(-2) > stack.size(-1)
    wide = stack.mT if transposed else stack
    scale = scaled_norm_reciprocal(stack, eps)  # the norm needs no orientation: read x as it lies
    out = torch.empty(wide.shape, dtype=compute_dtype, device=stack.device)
    return scale_cast(wide, scale, out), transposed


_BMM_FP32_OUT: dict = {}


def _bmm_writes_fp32(device: torch.device) -> bool:
    """Whether ``torch.bmm(half, half, out_dtype=torch.float32)`` runs here (torch >= 2.8, CUDA)."""
    key = str(device)
    if key not in _BMM_FP32_OUT:
        probe = torch.ones(1, 8, 8, dtype=torch.float16, device=device)
        try:
            _BMM_FP32_OUT[key] = torch.bmm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _BMM_FP32_OUT[key] = False
    return _BMM_FP32_OUT[key]


def _apply_q(Q: Tensor, X: Tensor, transposed: bool, out_dtype: torch.dtype) -> Tensor:
    """The result ``Q X`` in the input's orientation: wide [B, m, n], or for tall inputs
    ``(Q X)ᵀ = Xᵀ Q`` (Q is symmetric) written tall directly; float32 straight from the
    product when the input is float32 and cuBLAS can write it."""
    left, right = (X.mT, Q) if transposed else (Q, X)
    if out_dtype == torch.float32 and X.dtype != torch.float32 and X.is_cuda and _bmm_writes_fp32(X.device):
        return torch.bmm(left, right, out_dtype=torch.float32)
    return torch.bmm(left, right)


def _scale_(x: Tensor, scale: Tensor) -> Tensor:
    """``x[b] *= scale[b]`` in place (a vectorised pass; torch's broadcast multiply is not)."""
    from .triton_cast import scale_cast

    return scale_cast(x, scale.reshape(-1).float(), x)


def _quartic_first_step(R: Tensor, plan: ShapePlan, b: float, c: float) -> tuple[Tensor, Tensor, Tensor]:
    """``algorithms.newton_schulz.quartic_rescale`` fused for the kernels, with the first step's
    ``Z' = b R + c R²`` made in the same pass: R (overwritten) is rescaled, Z' returned, and γ for
    the caller to apply to X (standard) or to the first segment's Q (Gram). Same arithmetic:
    unit-Frobenius R, its square by the symmetric product, norms accumulated in float32."""
    from .triton_cast import quartic_first_step_

    f = torch.linalg.vector_norm(R, dim=(-2, -1), dtype=torch.float32)
    _scale_(R, safe_reciprocal(f))
    S = _sym(plan.square, R, R)
    g = torch.linalg.vector_norm(S, dim=(-2, -1), dtype=torch.float32)
    inv_g = safe_reciprocal(g)
    quartic_first_step_(R, S, inv_g.sqrt(), inv_g, b, c)
    return R, S, safe_reciprocal(f * g.sqrt()).sqrt()


def gram_segment_q(R: Tensor, segment, plan: ShapePlan, normalise: bool = False) -> Tensor:
    """``algorithms.gram_newton_schulz.gram_space_polynomial`` on the symmetric kernels: one
    segment's ``Q`` (``X <- Q X``) from ``R = X Xᵀ`` ([B, m, m], overwritten). ``normalise``: the
    quartic rescale of R first, its γ folded into Q. The owner of a distributed Gram NS calls this
    with the reduced R (runtime/tp_exchange.py); ``gram_core`` with its own."""
    gamma = first_Z = None
    if normalise:
        R, first_Z, gamma = _quartic_first_step(R, plan, *segment[0][1:])
    Q = None  # the identity at the start of a segment
    for i, (a, b, c) in enumerate(segment):
        if first_Z is not None:
            Z, first_Z = first_Z, None  # Z' = b R + c R² came with the rescale
        else:
            Z = _sym(plan.square, R, R, c=R, alpha=c, beta=b)  # Z' = b R + c R²
        if i < len(segment) - 1:
            W = _sym(plan.square, R, Z, c=R, beta=a)  # R Z = a R + R Z'
            R = _sym(plan.square, W, Z, c=W, beta=a)  # Z R Z = a W + W Z'
        if Q is None:
            Q = Z
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = a I + Z' (Z' is not needed any more)
        else:
            Q = _sym(plan.square, Q, Z, c=Q, beta=a)  # Q Z = a Q + Q Z'
    return Q if gamma is None else _scale_(Q, gamma)  # the first segment's Q acts on γ X


def gram_core(X: Tensor, schedule, restarts: frozenset, plan: ShapePlan, transposed: bool = False,
              out_dtype: torch.dtype | None = None, quartic: bool = False) -> Tensor:
    """Gram NS on a normalised wide [B, m, n] stack. Returns Q X in the input's orientation
    (``transposed``: tall [B, n, m]), in ``out_dtype`` where the last product can write it.
    ``quartic``: rescale R by the quartic bound first (one more symmetric product, step 1 then
    needs none) and fold its γ into the first segment's Q."""
    segments = gram_segments(schedule, restarts)
    R = _syrk(plan.syrk, X)
    for i, segment in enumerate(segments):
        Q = gram_segment_q(R, segment, plan, quartic and i == 0)
        if i < len(segments) - 1:  # a restart: X = Q X, R = X Xᵀ, Q = I
            X = torch.bmm(Q, X)
            R = _syrk(plan.syrk, X)
    return _apply_q(Q, X, transposed, out_dtype or X.dtype)


def sharded_gram_ops(wide: Tensor, compute_dtype: torch.dtype, autotune: bool = True, cache_path=None):
    """A distributed Gram NS of the wide stack ``wide`` ([B, m, n_local] per rank) on the symmetric
    kernels: ``(gram, segment_q)``, this rank's ``X Xᵀ`` (syrk) and the owner's
    ``segment_q(R, segment, normalise)`` (``gram_segment_q``), both with this shape's kernel
    choices; None where the kernel path does not run for it (CPU without the Triton interpreter,
    float32 compute), and the caller keeps the torch products. A kernel choice that fails falls
    back to the torch product as the drivers' do (``_fast_or_torch``: warned, counted); the owner's
    fallback starts from a copy of R, which the kernel path overwrites."""
    if wide.dim() != 3 or wide.numel() == 0 or not fast_path_usable(wide, compute_dtype):
        return None
    plan = shape_plan(wide.size(1), wide.size(2), wide.size(0), compute_dtype, wide.device,
                      autotune=autotune, cache_path=cache_path)
    shape = (tuple(wide.shape), compute_dtype, str(wide.device))

    def gram(X):
        return _fast_or_torch(("distributed gram X Xᵀ", *shape), lambda: _syrk(plan.syrk, X), lambda: X @ X.mT,
                              forced=False)

    def segment_q(R, segment, normalise):
        kept = R.clone()
        return _fast_or_torch(("distributed gram Q", *shape), lambda: gram_segment_q(R, segment, plan, normalise),
                              lambda: gram_space_polynomial(kept, segment, normalise), forced=False)

    return gram, segment_q


def standard_core(X: Tensor, schedule, plan: ShapePlan, quartic: bool = False) -> Tensor:
    """Standard NS on a normalised wide [B, m, n] stack: X <- a X + (b A + c A²) X, A = X Xᵀ
    (``quartic``: step 1 rescales A and X by the quartic bound first). The a X term is added in
    the GEMM's float32 epilogue (``baddbmm``), not folded into the 16-bit matrix as a I + b A + c A²:
    rounded there, a sits at the diagonal's magnitude (bf16 spacing 2⁻⁵ at 4.08), the same rounding
    in every entry, and the result leaned by ~1e-3 in scale on real shapes (H200,
    bench/ns.py accuracy --heavy-tailed; Megatron's NS adds a X this way too). The price is one
    copy of X per step (baddbmm writes its input into the output first)."""
    for t, (a, b, c) in enumerate(schedule):
        A = _syrk(plan.syrk, X)
        if quartic and t == 0:
            _, B, gamma = _quartic_first_step(A, plan, b, c)
            X = _scale_(X, gamma)
        else:
            B = _sym(plan.square, A, A, c=A, alpha=c, beta=b)  # b A + c A²
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def _check_backend(backend: str) -> None:
    if backend not in FAST_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(FAST_BACKENDS)}; got {backend!r}")


_FAILED: dict[tuple, str] = {}  # (method, shape, dtype, device) whose kernel choice failed -> why


def _fast_or_torch(key: tuple, fast, torch_path, forced: bool) -> Tensor:
    """The kernel path, or the torch path when this shape's (cached) kernel choice fails to
    compile or launch: warned once per shape, counted in NONFINITE_METRICS['kernel_fallbacks'].
    backend='triton' (forced) re-raises."""
    if key in _FAILED and not forced:
        NONFINITE_METRICS["kernel_fallbacks"] += 1
        return torch_path()
    try:
        return fast()
    except Exception as exc:  # noqa: BLE001 - any compile/launch failure of a kernel choice
        if forced:
            raise
        _FAILED[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
        warnings.warn(
            f"DMuon kernels: the kernel choice for {key[0]} NS of shape {key[1]} ({key[2]}) failed "
            f"({_FAILED[key]}); this shape runs the torch path from now on. The autotune cache may hold a "
            f"choice made by other software: re-tune (dmuon autotune) or remove {CACHE_ENV} / the cache file",
            RuntimeWarning)
        # also on stderr: a job run with PYTHONWARNINGS=ignore must still see that it is slower
        print(f"> WARNING: DMuon kernels failed for {key[0]} NS of shape {key[1]} ({_FAILED[key]}); "
              "that shape runs the torch path from now on", file=sys.stderr, flush=True)
        NONFINITE_METRICS["kernel_fallbacks"] += 1
        return torch_path()


def _finish(out_wide: Tensor, transposed: bool, x: Tensor, out_dtype: torch.dtype) -> Tensor:
    out = out_wide.mT if transposed else out_wide
    return out.reshape(x.shape).to(out_dtype)


def _validated(x: Tensor, backend: str, check_finite: bool, compute_dtype: torch.dtype, eps: float,
               normalisation: str, coefficients, steps: int, safety: float) -> tuple:
    """Both drivers' argument checks; returns (schedule, quartic)."""
    _check_backend(backend)
    validate_matrix_input(x, check_finite)
    validate_compute_dtype(compute_dtype)
    validate_eps(eps)
    quartic = validate_normalisation(normalisation)
    return get_coefficients(coefficients, steps, safety), quartic


def _kernels_usable(x: Tensor, compute_dtype: torch.dtype, backend: str) -> bool:
    """Whether the kernel path runs for ``x``; backend='triton' where it cannot is an error."""
    usable = fast_path_usable(x, compute_dtype)
    if backend == "triton" and not usable:
        raise ValueError(
            f"backend='triton' needs compute_dtype float16/bfloat16 (got {compute_dtype}) and a CUDA GPU of "
            f"compute capability >= 8.0 or TRITON_INTERPRET=1 (x is on {x.device}); use backend='torch'"
        )
    return usable


def _run_kernels(method: str, x: Tensor, core, torch_fn, torch_kwargs: dict, *, compute_dtype: torch.dtype, eps: float,
                 backend: str, autotune: bool, cache_path, check_finite: bool, out_dtype: torch.dtype) -> Tensor:
    """The kernel path of one driver: ``core(X, plan, transposed)`` on the normalised wide stack
    with this shape's kernel choices, the torch path ``torch_fn(x, **torch_kwargs)`` where that
    choice fails (``_fast_or_torch``), and with ``check_finite`` the fp32 retry of non-finite
    outputs."""
    def fast():
        stack = x.reshape(-1, x.size(-2), x.size(-1))
        X, transposed = _normalised_wide(stack, compute_dtype, eps)
        plan = shape_plan(
            X.size(1), X.size(2), X.size(0), compute_dtype, X.device,
            autotune=autotune, cache_path=cache_path, force_triton=(backend == "triton"),
        )
        return core(X, plan, transposed)

    out = _fast_or_torch((method, tuple(x.shape), compute_dtype, str(x.device)), fast,
                         lambda: torch_fn(x, **torch_kwargs).to(out_dtype), forced=backend == "triton")
    if check_finite:
        fp32_kwargs = dict(torch_kwargs, compute_dtype=torch.float32)
        out = retry_nonfinite(out, x, lambda sub: torch_fn(sub, **fp32_kwargs))
    return out


def newton_schulz_fast(
    x: Tensor,
    coefficients="keller",
    steps: int = 5,
    compute_dtype: torch.dtype = torch.bfloat16,
    eps: float = NS_EPS,
    safety: float = 1.01,
    check_finite: bool = False,
    backend: str = "auto",
    autotune: bool = True,
    cache_path=None,
    normalisation: str = "frobenius",
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Standard NS with symmetric kernels for A = X Xᵀ and b A + c A²; contract of
    ``algorithms.newton_schulz`` (its default compute dtype bf16 too). ``cache_path``
    overrides the autotune cache location; ``out_dtype`` the result's dtype (default x's)."""
    schedule, quartic = _validated(x, backend, check_finite, compute_dtype, eps, normalisation, coefficients, steps,
                                   safety)
    usable = _kernels_usable(x, compute_dtype, backend)
    torch_kwargs = dict(coefficients=schedule, steps=steps, compute_dtype=compute_dtype, eps=eps, check_finite=False,
                        normalisation=normalisation)
    out_dtype = out_dtype or x.dtype
    if backend == "torch" or not usable or x.numel() == 0:
        return newton_schulz(x, **torch_kwargs).to(out_dtype)
    return _run_kernels(
        "standard", x, lambda X, plan, transposed: _finish(standard_core(X, schedule, plan, quartic), transposed, x,
                                                           out_dtype),
        newton_schulz, torch_kwargs, compute_dtype=compute_dtype, eps=eps, backend=backend, autotune=autotune,
        cache_path=cache_path, check_finite=check_finite, out_dtype=out_dtype)


def gram_newton_schulz_fast(
    x: Tensor,
    coefficients="keller",
    steps: int = 5,
    compute_dtype: torch.dtype = torch.float16,
    eps: float = NS_EPS,
    safety: float = 1.01,
    restart_after: Iterable[int] | None = None,
    min_aspect_ratio: float = GRAM_MIN_ASPECT_RATIO,
    check_finite: bool = False,
    backend: str = "auto",
    autotune: bool = True,
    cache_path=None,
    normalisation: str = "frobenius",
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Gram NS with symmetric kernels; contract of ``algorithms.gram_newton_schulz``.

    Args (beyond the algorithms' ones):
        check_finite: validate the input and retry non-finite output matrices in fp32 (syncs).
        backend: 'auto' (kernels when usable, per-op choice from the autotune cache),
            'triton' (force the Triton kernel for every symmetric product), 'torch'.
        autotune: tune and cache kernel choices for unseen shapes (CUDA only); False uses the
            cached choice if any was loaded already, else default Triton configs.
        cache_path: autotune cache file (default ``$DMUON_AUTOTUNE_CACHE`` or
            ``~/.cache/megatron_dmuon/autotune.json``).
        out_dtype: the result's dtype (default x's). The compute dtype lets the last product
            write its own rounding and skips a float32 result its consumer would only read.
    """
    schedule, quartic = _validated(x, backend, check_finite, compute_dtype, eps, normalisation, coefficients, steps,
                                   safety)
    restart_after = default_restarts(normalisation) if restart_after is None else tuple(restart_after)
    restarts = restart_points(restart_after, steps)
    validate_min_aspect_ratio(min_aspect_ratio)
    usable = _kernels_usable(x, compute_dtype, backend)
    torch_kwargs = dict(
        coefficients=schedule, steps=steps, compute_dtype=compute_dtype, eps=eps,
        restart_after=restart_after, min_aspect_ratio=min_aspect_ratio, check_finite=False, normalisation=normalisation,
    )
    out_dtype = out_dtype or x.dtype
    if backend == "torch" or not usable or x.numel() == 0:
        return gram_newton_schulz(x, **torch_kwargs).to(out_dtype)
    if not gram_applies(x.size(-2), x.size(-1), min_aspect_ratio):
        # As the algorithms do: near-square matrices run standard NS (same schedule and dtype).
        return newton_schulz_fast(
            x, schedule, steps=steps, compute_dtype=compute_dtype, eps=eps, check_finite=check_finite,
            backend=backend, autotune=autotune, cache_path=cache_path, normalisation=normalisation,
            out_dtype=out_dtype,
        )
    return _run_kernels(
        "gram", x, lambda X, plan, transposed: gram_core(X, schedule, restarts, plan, transposed, out_dtype,
                                                         quartic).reshape(x.shape).to(out_dtype),
        gram_newton_schulz, torch_kwargs, compute_dtype=compute_dtype, eps=eps, backend=backend, autotune=autotune,
        cache_path=cache_path, check_finite=check_finite, out_dtype=out_dtype)


def resolve_method(x: Tensor, method: str, kwargs: dict) -> str:
    """'gram' or 'standard' for this stack: explicit, else ``algorithms.flops.ns_method_for`` with
    the autotune cache's measurement (the owner step passes its plan's resolved method instead)."""
    if method not in NS_METHODS:
        raise ValueError(f"method must be one of {', '.join(NS_METHODS)}; got {method!r}")
    if method != "auto":
        return method
    rows, cols = x.size(-2), x.size(-1)
    steps = kwargs.get("steps", 5)
    batch = x.numel() // max(rows * cols, 1)
    dtype = kwargs.get("compute_dtype", torch.float16)
    cached = cached_method(min(rows, cols), max(rows, cols), batch, dtype, x.device, steps, kwargs.get("cache_path"))
    return ns_method_for(rows, cols, steps, "auto", kwargs.get("restart_after"),
                         kwargs.get("min_aspect_ratio", GRAM_MIN_ASPECT_RATIO), kwargs.get("normalisation", "frobenius"),
                         measured=cached)


def orthogonalize_batched(x: Tensor, method: str = "auto", **kwargs) -> Tensor:
    """Orthogonalize a same-shape stack [B, m, n] (any leading dims) in one batched call.

    method: 'gram', 'standard', or 'auto' = the autotune cache's measured choice for this
    (GPU, shape, batch, dtype), else the FLOP-based ``algorithms.flops.ns_method_for``. ``kwargs`` go to
    ``gram_newton_schulz_fast`` / ``newton_schulz_fast`` (each keeps its own default
    compute dtype: fp16 for Gram, bf16 for standard); Gram-only keys are dropped for standard.
    """
    if not isinstance(x, Tensor) or x.ndim < 2:
        raise ValueError(f"x must be a tensor [..., m, n]; got {getattr(x, 'shape', type(x))}")
    if resolve_method(x, method, kwargs) == "gram":
        return gram_newton_schulz_fast(x, **kwargs)
    standard_kwargs = {k: v for k, v in kwargs.items() if k not in ("restart_after", "min_aspect_ratio")}
    return newton_schulz_fast(x, **standard_kwargs)
