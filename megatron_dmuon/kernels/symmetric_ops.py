"""Symmetric-output products of Gram Newton–Schulz, dispatched to one of four backends.

Operations (all batched over a leading dim, results [B, m, m] and symmetric):

* ``syrk(x)``                    ``x @ xᵀ``                                (x: [B, m, k])
* ``sym_poly(r, b, c, diag)``    ``b·r + c·r@r + diag·I``                  (the NS polynomial step)
* ``sym_axpby(a, z, beta)``      ``beta·a + a@z``                          (Q·Z' + a·Q, R updates)
* ``sym_matmul(a, b, c, ...)``   ``alpha·a@b + beta·c + diag·I``           (the general form)

Backends:

* ``'triton'`` – the upper-triangle kernel of ``triton_symmetric`` (fp16/bf16; CUDA with
  compute capability >= 8.0, or CPU tensors under TRITON_INTERPRET=1).
* ``'torch'``  – the reference fallback with the kernel's exact semantics: fp32 products,
  fp32 epilogue, one rounding to the output dtype, upper triangle mirrored. Any device/dtype.
* ``'cublas'`` – ``torch.baddbmm`` in the operands' dtype, full product, not symmetrised
  (the fastest library path; used when autotuning finds it beats the Triton kernel).
* ``'quack'``  – quack's symmetric GEMM (``quack.gemm_interface.gemm_symmetric``), used only
  if the package imports (SM90+); per batch element.
* ``'cutlass'`` – the upper-staircase CUTLASS sm90a kernel of ``cutlass_symmetric`` (fp16/bf16 on
  an SM90 GPU; built with nvcc at first use), the same semantics as ``'torch'``. Never picked
  by ``'auto'`` itself; the autotune cache picks it per shape when it is fastest.
* ``'auto'``   – triton when usable for the tensor, else torch.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

BACKENDS: tuple[str, ...] = ("auto", "triton", "torch", "cublas", "quack", "cutlass")
TRITON_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def triton_usable(t: Tensor) -> bool:
    """Whether the Triton kernel can run on this tensor (device, dtype, GPU generation)."""
    if t.dtype not in TRITON_DTYPES or not triton_importable():
        return False
    if t.is_cuda:
        return _cuda_capability(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= (8, 0)
    if t.device.type == "cpu":
        from .triton_symmetric import interpreter_active

        return interpreter_active()
    return False


@functools.lru_cache(maxsize=None)
def quack_symmetric_gemm():
    """quack's ``gemm_symmetric`` if quack imports, else None (it is an optional backend)."""
    if importlib.util.find_spec("quack") is None:
        return None
    try:
        from quack.gemm_interface import gemm_symmetric
    except Exception:  # quack registers ops at import; any failure means "not usable here"
        return None
    return gemm_symmetric


def quack_usable(t: Tensor) -> bool:
    return (
        t.is_cuda
        and t.dtype in TRITON_DTYPES
        and quack_symmetric_gemm() is not None
        and _cuda_capability(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= (9, 0)
    )


def resolve_backend(backend: str, t: Tensor) -> str:
    """Map ``'auto'`` to a concrete backend and reject impossible explicit choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        return "triton" if triton_usable(t) else "torch"
    if backend == "triton" and not triton_usable(t):
        raise ValueError(
            f"backend='triton' cannot run on a {t.dtype} tensor on {t.device}: it needs fp16/bf16 on a "
            "CUDA GPU of compute capability >= 8.0 (or TRITON_INTERPRET=1 for CPU tensors); "
            "use backend='torch'"
        )
    if backend == "quack" and not quack_usable(t):
        raise ValueError("backend='quack' needs the quack package and an fp16/bf16 tensor on an SM90+ GPU")
    if backend == "cutlass":
        from .cutlass_symmetric import CutlassUnavailable, cutlass_usable, library_error, missing_prerequisites

        if not cutlass_usable(t):
            why = library_error() or missing_prerequisites() or "it needs an fp16/bf16 tensor on an SM90 (Hopper) GPU"
            raise CutlassUnavailable(f"backend='cutlass' cannot run on a {t.dtype} tensor on {t.device}: {why}")
    if backend == "cublas" and not t.is_cuda:
        raise ValueError(f"backend='cublas' needs a CUDA tensor, got one on {t.device}; use backend='torch'")
    return backend


def _batched(t: Tensor) -> Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def _mirror_upper_(out: Tensor) -> Tensor:
    """Make ``out`` symmetric from its upper triangle (diagonal included), in place."""
    upper = torch.triu(out)
    out.copy_(upper + torch.triu(out, diagonal=1).mT)
    return out


def _torch_sym_matmul(a, b, out, c, alpha, beta, diag):
    result = torch.matmul(a.float(), b.float()).mul_(alpha)
    if c is not None and beta != 0.0:
        result.add_(c.float(), alpha=beta)
    if diag != 0.0:
        result.diagonal(dim1=-2, dim2=-1).add_(diag)
    out.copy_(result)
    return _mirror_upper_(out)


def _cublas_sym_matmul(a, b, out, c, alpha, beta, diag):
    if c is not None and beta != 0.0:
        torch.baddbmm(_batched(c), _batched(a), _batched(b), beta=beta, alpha=alpha, out=_batched(out))
    else:
        torch.bmm(_batched(a), _batched(b), out=_batched(out))
        if alpha != 1.0:
            out.mul_(alpha)
    if diag != 0.0:
        out.diagonal(dim1=-2, dim2=-1).add_(diag)
    return out


def _quack_sym_matmul(a, b, out, c, alpha, beta, diag):
    gemm_symmetric = quack_symmetric_gemm()
    a3, b3, out3 = _batched(a), _batched(b), _batched(out)
    c3 = _batched(c) if c is not None else None
    for i in range(a3.shape[0]):
        gemm_symmetric(
            a3[i], b3[i], C=None if c3 is None else c3[i], out=out3[i], alpha=alpha, beta=beta if c3 is not None else 0.0
        )
    if diag != 0.0:
        out.diagonal(dim1=-2, dim2=-1).add_(diag)
    return out


def sym_matmul(
    a: Tensor,
    b: Tensor,
    *,
    c: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    out: Tensor | None = None,
    backend: str = "auto",
    config=None,
    b_symmetric: bool = False,
) -> Tensor:
    """``alpha·a@b + beta·c + diag·I`` where the exact product is known to be symmetric.

    a: [B, m, k] or [m, k]; b: [B, k, m] or [k, m]; c, out: [B, m, m] or [m, m].
    ``config``: a ``KernelConfig`` (Triton) or ``CutlassConfig`` (CUTLASS), else ignored. ``b_symmetric``
    promises b == bᵀ, which lets the Triton TMA kernel read b's rows as its columns.
    """
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(f"sym_matmul: a and b must both be 2-D or both 3-D; got {tuple(a.shape)} and {tuple(b.shape)}")
    m = a.shape[-2]
    if b.shape[-2] != a.shape[-1] or b.shape[-1] != m or b.shape[:-2] != a.shape[:-2]:
        raise ValueError(f"sym_matmul: b must be [..., {a.shape[-1]}, {m}] to match a {tuple(a.shape)}; got {tuple(b.shape)}")
    if c is not None and c.shape != (*a.shape[:-1], m):
        raise ValueError(f"sym_matmul: c must have shape {(*a.shape[:-1], m)}, got {tuple(c.shape)}")
    if out is None:
        out = torch.empty((*a.shape[:-1], m), dtype=a.dtype, device=a.device)
    elif out.shape != (*a.shape[:-1], m):
        raise ValueError(f"sym_matmul: out must have shape {(*a.shape[:-1], m)}, got {tuple(out.shape)}")
    chosen = resolve_backend(backend, a)
    if chosen == "triton":
        from .triton_symmetric import KernelConfig, sym_matmul as triton_sym_matmul

        return triton_sym_matmul(
            a, b, out=out, c=c, alpha=alpha, beta=beta, diag=diag, config=config or KernelConfig(),
            b_symmetric=b_symmetric,
        )
    if chosen == "cublas":
        return _cublas_sym_matmul(a, b, out, c, alpha, beta, diag)
    if chosen == "cutlass":
        from .cutlass_symmetric import sym_matmul as cutlass_sym_matmul

        return cutlass_sym_matmul(a, b, out, c, alpha, beta, diag, config=config, b_symmetric=b_symmetric)
    if chosen == "quack":
        return _quack_sym_matmul(a, b, out, c, alpha, beta, diag)
    return _torch_sym_matmul(a, b, out, c, alpha, beta, diag)


def syrk(x: Tensor, *, out: Tensor | None = None, alpha: float = 1.0, backend: str = "auto", config=None) -> Tensor:
    """``alpha · x @ xᵀ`` for x [B, m, k] or [m, k]; only the upper tiles are computed (Triton)."""
    return sym_matmul(x, x.mT, alpha=alpha, out=out, backend=backend, config=config)


def sym_poly(
    r: Tensor, b: float, c: float, *, diag: float = 0.0, out: Tensor | None = None, backend: str = "auto", config=None
) -> Tensor:
    """The NS polynomial step ``b·r + c·r@r + diag·I`` for symmetric r (one fused kernel)."""
    return sym_matmul(r, r, c=r, alpha=c, beta=b, diag=diag, out=out, backend=backend, config=config, b_symmetric=True)


def sym_axpby(
    a: Tensor, z: Tensor, beta: float, *, out: Tensor | None = None, backend: str = "auto", config=None
) -> Tensor:
    """``beta·a + a@z`` for commuting symmetric a, z: Q·Z' + a·Q and both R-update products."""
    return sym_matmul(a, z, c=a, alpha=1.0, beta=beta, out=out, backend=backend, config=config, b_symmetric=True)
