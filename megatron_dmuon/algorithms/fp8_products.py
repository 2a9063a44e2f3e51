"""Newton–Schulz with its big products in FP8 (e4m3 operands, float32 accumulation): the math of [fp8-ns].

``scaled_fp8_matmul(a, b, scaling=...)`` multiplies ``[.., m, k] @ [.., k, n]`` after quantizing both
operands to e4m3 along the contraction dim k. Scales are powers of two chosen from the amax of each
scaling group (``E4M3_MAX / amax`` rounded down to a power of two), so the dequantization is exact in
float32 and the scales factor out of every sum exactly:

* ``'tensor'``: one scale per matrix of the stack;
* ``'row'``: one per row of ``a`` and one per column of ``b`` (the product of the two scales is the
  output element's scale);
* ``'block128'``: one per 1x128 block along k for each row of ``a`` and each column of ``b`` (the
  activation tiles of DeepSeek-V3, arXiv 2412.19437, §3.3; their weights use 128x128 blocks, but
  both NS operands are iterates, so both get the finer tiles). A partial last block is padded
  with zeros.

e4m3 has 3 mantissa bits: a quantized value is within 2⁻⁴ (relative) of the input for normal
values (|x·scale| ≥ 2⁻⁶), and the normal range spans 2⁻⁶..448, about 15 binades under the group's
amax; smaller values lose relative precision (subnormal spacing 2⁻⁹) and those under 2⁻¹⁰·scale⁻¹
become 0.

On CUDA the products run ``torch._scaled_mm`` (row-major ``a``, column-major ``b``), one call per
matrix of a batched stack (``_scaled_mm`` has no batch dimension); ``use_fast_accum=False`` keeps
cuBLAS's promotion of the tensor cores' partial sums into float32 (DeepSeek-V3 §3.3.2: Hopper's FP8
MMA accumulates with ~14 bits otherwise). Elsewhere (and with ``emulate=True``) the same e4m3 casts
are dequantized and multiplied in float32, so CPU tests exercise the same operand numerics.

The NS variants (``fp8_newton_schulz``, ``fp8_gram_newton_schulz``) follow
``newton_schulz``/``gram_newton_schulz`` step for step (normalisation, quartic rescale, schedules,
restarts, the ``a X`` term added in float32) and only swap the chosen products for FP8 ones.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from .coefficients import CoefficientSpec, get_coefficients
from .gram_newton_schulz import default_restarts, gram_segments, restart_points
from .newton_schulz import NS_EPS, as_stack, normalised_wide, quartic_rescale, validate_normalisation

__all__ = ["E4M3", "E4M3_MAX", "SCALINGS", "FP8_PRODUCTS", "quantize_e4m3", "dequantize", "fp8_gemm", "scaled_fp8_matmul",
           "fp8_newton_schulz", "fp8_gram_newton_schulz", "Fp8Unavailable"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALINGS = ("tensor", "row", "block128")
BLOCK = 128
# which NS products may run in FP8: 'gram' the rectangular X Xᵀ (standard NS's A, Gram NS's R at the
# start and at a restart), 'apply' the rectangular products with the iterate (standard NS's B X, Gram
# NS's restart Q X and final Q X), 'square' the m×m products of Gram NS's iteration; 'rect' is
# shorthand for 'gram' + 'apply'. They are separate because they fail differently: on recorded
# momenta (tests/data) the Gram NS's Q X in e4m3 is 5-10x off where its X Xᵀ in e4m3 is fine.
FP8_PRODUCTS = ("gram", "apply", "square")


class Fp8Unavailable(RuntimeError):
    """This torch/GPU cannot run the requested FP8 product natively (the caller may emulate)."""


def _pow2_scale(amax: Tensor) -> Tensor:
    """E4M3_MAX / amax rounded down to a power of two (1 for an all-zero group, NaN for a non-finite
    amax so a NaN input shows in the product instead of being hidden)."""
    amax = amax.float()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / safe)))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))


def quantize_e4m3(x: Tensor, scaling: str) -> tuple[Tensor, Tensor]:
    """``(q, scale_inv)`` of ``x`` [.., r, k] quantized along its last dim k (the contraction dim of
    an ``a`` operand; ``b`` operands are quantized as ``b.mT``). ``q``: e4m3, x's shape (k padded to a
    multiple of 128 for 'block128'); ``scale_inv``: float32, [.., 1, 1] ('tensor'), [.., r, 1]
    ('row') or [.., r, k/128] ('block128'); ``q·scale_inv`` (blocks expanded) is the dequantized x."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}; got {scaling!r}")
    # row-major q whatever x's strides: x is often a transposed view (b.mT), and cuBLASLt takes
    # only a row-major a with a column-major b (qbt.t())
    xf = x.to(torch.float32, memory_format=torch.contiguous_format)
    if scaling == "block128":
        pad = (-xf.size(-1)) % BLOCK
        if pad:
            xf = torch.nn.functional.pad(xf, (0, pad))
        blocks = xf.unflatten(-1, (-1, BLOCK))
        scale = _pow2_scale(blocks.abs().amax(dim=-1))  # [.., r, k/128]
        # clamp before the cast: on CUDA an out-of-range value casts to NaN (saturates on CPU)
        q = (blocks * scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).flatten(-2)
        return q, scale.reciprocal()
    dims = (-2, -1) if scaling == "tensor" else (-1,)
    scale = _pow2_scale(xf.abs().amax(dim=dims, keepdim=True))
    q = (xf * scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.reciprocal()


def dequantize(q: Tensor, scale_inv: Tensor) -> Tensor:
    """float32 values of ``quantize_e4m3``'s output (blocks expanded along the last dim)."""
    if scale_inv.size(-1) > 1 and scale_inv.size(-1) != q.size(-1):  # block128
        return (q.float().unflatten(-1, (-1, BLOCK)) * scale_inv.unsqueeze(-1)).flatten(-2)
    return q.float() * scale_inv


def _is_transpose(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` is a view of ``a.mT`` (X Xᵀ): one quantization serves both operands."""
    return b.shape == a.mT.shape and b.data_ptr() == a.data_ptr() and b.stride() == a.mT.stride()


def _quantized_operands(a: Tensor, b: Tensor, scaling: str):
    qa, sa = quantize_e4m3(a, scaling)
    qbt, sbt = (qa, sa) if _is_transpose(a, b) else quantize_e4m3(b.mT, scaling)
    return qa, sa, qbt, sbt


def scaled_fp8_matmul(a: Tensor, b: Tensor, *, scaling: str = "row", out_dtype: torch.dtype = torch.bfloat16,
                      fast_accum: bool = False, emulate: bool | None = None) -> Tensor:
    """``a @ b`` with e4m3 operands (quantized along k, ``scaling`` as in the module docstring) and
    float32 accumulation, returned in ``out_dtype`` (bf16, fp16 or fp32). ``a`` [.., m, k], ``b``
    [.., k, n] with equal leading dims. ``emulate``: None = native on CUDA, emulated elsewhere;
    True = the float32 emulation anywhere; False = native or ``Fp8Unavailable``."""
    if a.ndim < 2 or b.ndim != a.ndim or a.shape[:-2] != b.shape[:-2] or a.size(-1) != b.size(-2):
        raise ValueError(f"scaled_fp8_matmul needs [.., m, k] @ [.., k, n]; got {tuple(a.shape)} @ {tuple(b.shape)}")
    if emulate is None:
        emulate = not a.is_cuda
    qa, sa, qbt, sbt = _quantized_operands(a, b, scaling)
    if emulate:
        return (dequantize(qa, sa) @ dequantize(qbt, sbt).mT).to(out_dtype)
    if not a.is_cuda or not hasattr(torch, "_scaled_mm"):
        raise Fp8Unavailable("native FP8 products need CUDA and torch._scaled_mm")
    lead = a.shape[:-2]
    qa3, sa3 = qa.reshape(-1, *qa.shape[-2:]), sa.reshape(-1, *sa.shape[-2:])
    qb3, sb3 = qbt.reshape(-1, *qbt.shape[-2:]), sbt.reshape(-1, *sbt.shape[-2:])
    # no batched _scaled_mm: one call per matrix of the stack
    outs = [fp8_gemm(qa3[i], sa3[i], qb3[i], sb3[i], scaling, out_dtype, fast_accum) for i in range(qa3.size(0))]
    return torch.stack(outs).reshape(*lead, a.size(-2), b.size(-1))


def fp8_gemm(qa, sa, qbt, sbt, scaling, out_dtype, fast_accum):
    """One native [m, k] @ [k, n] product of ``quantize_e4m3`` outputs: ``qa`` [m, k] row-major,
    ``qbt`` [n, k] (``b``'s transpose, contiguous: ``qbt.t()`` is the column-major ``b``)."""
    b = qbt.t()
    if scaling == "tensor":
        return torch._scaled_mm(qa, b, scale_a=sa.reshape(()), scale_b=sbt.reshape(()), out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    if scaling == "row":
        if out_dtype == torch.bfloat16:  # sm90's rowwise kernels write bf16 only
            return torch._scaled_mm(qa, b, scale_a=sa.contiguous(), scale_b=sbt.reshape(1, -1).contiguous(),
                                    out_dtype=out_dtype, use_fast_accum=fast_accum)
        # other dtypes: unit tensor scales, float32 out, then the row/column scales (powers of two:
        # exact, the same values the rowwise kernel gives) in one pass
        one = torch.ones((), device=qa.device, dtype=torch.float32)
        out = torch._scaled_mm(qa, b, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast_accum)
        return (out * sa * sbt.reshape(1, -1)).to(out_dtype)
    return _gemm_block128(qa, sa, qbt, sbt, out_dtype, fast_accum)


def _gemm_block128(qa, sa, qbt, sbt, out_dtype, fast_accum):
    """1x128 x 1x128 blockwise scaling: torch.nn.functional.scaled_mm (torch >= 2.10, CUDA >= 12.9,
    sm90), scales outer-dim-major ([m, k/128] with stride (1, m)) as torch's own tests lay them."""
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    kinds = getattr(torch.nn.functional, "ScalingType", None)
    if fn is None or kinds is None:
        raise Fp8Unavailable(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (blockwise FP8)")
    if qa.size(-1) % BLOCK:
        raise Fp8Unavailable("blockwise FP8 needs k % 128 == 0")
    try:
        return fn(qa, qbt.t(), sa.t().contiguous().t(), kinds.BlockWise1x128, sbt.t().contiguous().t(),
                  kinds.BlockWise1x128, output_dtype=out_dtype, use_fast_accum=fast_accum)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        raise Fp8Unavailable(f"blockwise FP8 scaled_mm failed: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _check_products(products: Iterable[str]) -> frozenset:
    products = frozenset(products) if not isinstance(products, str) else frozenset((products,))
    if "rect" in products:
        products = (products - {"rect"}) | {"gram", "apply"}
    unknown = products - set(FP8_PRODUCTS)
    if unknown:
        raise ValueError(f"fp8 products must be among {FP8_PRODUCTS} (or 'rect'); got {sorted(unknown)}")
    return products


def _check_keep_last(keep_last: int, steps: int) -> None:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or not 0 <= keep_last <= steps:
        raise ValueError(f"keep_last must be an int in [0, steps={steps}]; got {keep_last!r}")


class _Products:
    """The NS's products: FP8 where a call says so, else the very 16-bit ops the reference NS runs
    (so a variant with no FP8 product is bitwise the reference). ``fp8_count`` counts FP8 calls."""

    def __init__(self, dtype, scaling, fast_accum, emulate):
        self.dtype, self.scaling, self.fast_accum, self.emulate = dtype, scaling, fast_accum, emulate
        self.fp8_count = 0

    def mm(self, p: Tensor, q: Tensor, fp8: bool) -> Tensor:
        """p @ q rounded once to the compute dtype."""
        if not fp8:
            return p @ q
        self.fp8_count += 1
        out = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32  # rowwise sm90: bf16 only
        return scaled_fp8_matmul(p, q, scaling=self.scaling, out_dtype=out, fast_accum=self.fast_accum,
                                 emulate=self.emulate).to(self.dtype)

    def add_mm(self, c: Tensor, beta: float, p: Tensor, q: Tensor, fp8: bool, alpha: float = 1.0) -> Tensor:
        """beta·c + alpha·(p @ q), the sum in float32 (as baddbmm's epilogue), rounded once."""
        if not fp8:
            return torch.baddbmm(c, p, q, beta=beta, alpha=alpha)
        self.fp8_count += 1
        prod = scaled_fp8_matmul(p, q, scaling=self.scaling, out_dtype=torch.float32, fast_accum=self.fast_accum,
                                 emulate=self.emulate)
        return prod.mul_(alpha).add_(c.float(), alpha=beta).to(self.dtype)


def _start(x: Tensor, compute_dtype, eps, normalisation, coefficients, steps, safety):
    quartic = validate_normalisation(normalisation)
    schedule = get_coefficients(coefficients, steps, safety)
    stack = as_stack(x)
    X, transposed = normalised_wide(stack if stack.ndim == 3 else stack.unsqueeze(0), compute_dtype, eps)
    return X, transposed, quartic, schedule


def _finish(X: Tensor, transposed: bool, x: Tensor) -> Tensor:
    return (X.mT if transposed else X).reshape(x.shape).to(x.dtype)


def fp8_newton_schulz(x: Tensor, coefficients: CoefficientSpec = "keller", steps: int = 5, *,
                      compute_dtype: torch.dtype = torch.bfloat16, products: Iterable[str] = ("gram", "apply"),
                      scaling: str = "row", keep_last: int = 1, fast_accum: bool = False,
                      emulate: bool | None = None, eps: float = NS_EPS, safety: float = 1.01,
                      normalisation: str = "frobenius") -> Tensor:
    """Standard NS (``newton_schulz``'s steps: ``A = X Xᵀ``, ``B = b A + c A²``, ``X = a X + B X``)
    with ``A = X Xᵀ`` in FP8 when ``'gram' in products`` and ``B X`` when ``'apply'``, except in the last
    ``keep_last`` iterations (16-bit there: the last step's rounding is the output's). ``A²`` stays
    16-bit (m×m). Same contract as ``newton_schulz`` (shape and dtype kept; finite input assumed)."""
    products = _check_products(products)
    _check_keep_last(keep_last, steps)
    if x.numel() == 0:
        return torch.zeros_like(x)
    X, transposed, quartic, schedule = _start(x, compute_dtype, eps, normalisation, coefficients, steps, safety)
    ops = _Products(compute_dtype, scaling, fast_accum, emulate)
    for t, (a, b, c) in enumerate(schedule):
        early = t < len(schedule) - keep_last
        A = ops.mm(X, X.mT, early and "gram" in products)
        if quartic and t == 0:
            A, A2, gamma = quartic_rescale(A)
            X = X * gamma
            B = A * b + A2 * c
        else:
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = ops.add_mm(X, a, B, X, early and "apply" in products)
    return _finish(X, transposed, x)


def _gram_q(R: Tensor, segment, normalise: bool, ops: _Products, fp8: Iterable[bool]) -> Tensor:
    """``gram_space_polynomial`` with each step's m×m products in FP8 where ``fp8`` (one flag per
    step of the segment) says so."""
    gamma = square = None
    if normalise:
        R, square, gamma = quartic_rescale(R)
    Q = None
    for i, ((a, b, c), low) in enumerate(zip(segment, fp8)):
        if square is not None:
            Z, square = R * b + square * c, None
        else:
            Z = ops.add_mm(R, b, R, R, low, alpha=c)  # Z' = b R + c R²
        if i < len(segment) - 1:
            RZ = ops.add_mm(R, a, R, Z, low)  # R Z = a R + R Z'
            R = ops.add_mm(RZ, a, Z, RZ, low)  # Z R Z = a RZ + Z' RZ
            R = (R + R.mT).mul_(0.5)
        if Q is None:
            Z.diagonal(dim1=-2, dim2=-1).add_(a)
            Q = Z
        else:
            Q = ops.add_mm(Q, a, Q, Z, low)  # Q Z = a Q + Q Z'
    return Q if gamma is None else Q * gamma


def fp8_gram_newton_schulz(x: Tensor, coefficients: CoefficientSpec = "keller", steps: int = 5, *,
                           compute_dtype: torch.dtype = torch.float16, products: Iterable[str] = ("gram",),
                           scaling: str = "row", keep_last: int = 1, fast_accum: bool = False,
                           emulate: bool | None = None, restart_after: Iterable[int] | None = None,
                           eps: float = NS_EPS, safety: float = 1.01, normalisation: str = "frobenius") -> Tensor:
    """Gram NS (``gram_newton_schulz``'s segments and restarts; the Gram path always runs here, no
    aspect-ratio fallback) with FP8 products:

    * ``'gram'``: ``R = X Xᵀ`` at the start and at each restart;
    * ``'apply'``: the restart's ``X = Q X`` and the final ``Q X``;
    * ``'square'``: the m×m iteration's products (``R²``, ``R Z'``, ``Z' RZ``, ``Q Z'``).

    ``keep_last``: iterations ``t > steps − keep_last`` (1-based) keep 16-bit products: their
    m×m products, a restart after them, and (``keep_last ≥ 1``) the final ``Q X``."""
    products = _check_products(products)
    _check_keep_last(keep_last, steps)
    if x.numel() == 0:
        return torch.zeros_like(x)
    X, transposed, quartic, schedule = _start(x, compute_dtype, eps, normalisation, coefficients, steps, safety)
    restarts = restart_points(default_restarts(normalisation) if restart_after is None else restart_after, steps)
    ops = _Products(compute_dtype, scaling, fast_accum, emulate)
    fp8_from = len(schedule) - keep_last  # iterations 1..fp8_from may run FP8 products
    gram, apply, square = ("gram" in products), ("apply" in products), ("square" in products)
    segments = gram_segments(schedule, restarts)
    R = ops.mm(X, X.mT, gram and fp8_from >= 1)
    done = 0  # iterations finished before this segment
    for i, segment in enumerate(segments):
        flags = [square and done + j + 1 <= fp8_from for j in range(len(segment))]
        Q = _gram_q(R, segment, quartic and i == 0, ops, flags)
        done += len(segment)
        if i < len(segments) - 1:  # restart after iteration `done`
            X = ops.mm(Q, X, apply and done <= fp8_from)
            R = ops.mm(X, X.mT, gram and done <= fp8_from)
    X = ops.mm(Q, X, apply and keep_last == 0)
    return _finish(X, transposed, x)

