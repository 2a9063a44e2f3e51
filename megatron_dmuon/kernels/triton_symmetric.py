"""Triton kernel for batched products whose result is symmetric.

Every m×m product in Gram Newton–Schulz is symmetric: X·Xᵀ, and the products of R, Q and Z',
which are all polynomials in the same Gram matrix and therefore commute. One kernel covers
them all:

    OUT[b] = alpha · A[b] @ B[b] + beta · C[b] + diag · I        (OUT[b] symmetric)

Only output tiles that hold at least one element on or above the diagonal are computed
(about half of the FLOPs of a full product). Each computed tile writes its upper-triangle
elements in place and their mirror images below the diagonal, so every element is written
exactly once and the result is bit-for-bit symmetric and deterministic.

Operands may be fp16 or bf16 (fp32 accumulation, the epilogue in fp32), strided in any way
(a SYRK passes B = Xᵀ as a transposed view, no copy), and batched over one leading dim.
This module needs Triton; the dispatch and torch fallbacks live in ``symmetric_ops``.

Two kernels share the tile list and the epilogue:

* ``_sym_mm_kernel`` – one program per (tile, batch), pointer loads; any strides and sizes.
* ``_sym_mm_tma_kernel`` – operands fetched by TMA tensor descriptors (Hopper); with
  ``KernelConfig.tma=1`` persistent (one program per SM walks the (batch, tile) list), with
  ``tma=2`` one program per (tile, batch) like the pointer kernel. It needs both
  operands K-contiguous: A row-major, and B either a transposed view (SYRK: B = Xᵀ) or a
  symmetric matrix whose rows are read as its columns (``b_symmetric=True``: every m×m
  operand of Gram NS). It also needs tile-multiple m and 16-byte-aligned rows; otherwise
  ``sym_matmul`` runs the pointer kernel with the same tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters of the symmetric-output kernel."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group: int = 8  # tile rows that share a column sweep, for L2 reuse
    tma: int = 0  # TMA-descriptor loads (Hopper) where the operands allow it: 1 persistent, 2 one program per tile

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KernelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"KernelConfig: unknown keys {sorted(unknown)}; valid keys: {sorted(fields)}")
        return cls(**{k: int(v) for k, v in data.items()})

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps must be one of 1,2,4,8,16, got {self.num_warps}")
        if self.num_stages < 1 or self.group < 1:
            raise ValueError(f"KernelConfig: num_stages and group must be >= 1, got {self}")
        if self.tma not in (0, 1, 2):
            raise ValueError(f"KernelConfig: tma must be 0 (pointer loads), 1 (persistent) or 2 (per tile), got {self}")


def interpreter_active() -> bool:
    """True when Triton kernels run through its CPU interpreter (TRITON_INTERPRET=1)."""
    try:
        from triton import knobs  # triton >= 3.3

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older triton reads the variable directly
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _symmetric_epilogue(
    acc, tile_row, tile_col, batch, C, OUT, M,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    alpha, beta, diag,
    HAS_C: tl.constexpr,
    EVEN_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """alpha·acc + beta·C + diag·I, stored on and above the diagonal and mirrored below."""
    rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
    result = alpha * acc
    if HAS_C:
        c_ptrs = C + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        if EVEN_M:
            result += beta * tl.load(c_ptrs).to(tl.float32)
        else:
            c_mask = (rows[:, None] < M) & (cols[None, :] < M)
            result += beta * tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    result += tl.where(rows[:, None] == cols[None, :], diag, 0.0)
    out = result.to(OUT.dtype.element_ty)
    # The mirror image (c, r) of element (r, c) is stored from the transposed tile, so both
    # stores run along the output's contiguous dim.
    out_t = tl.trans(out)
    out_base = OUT + batch * stride_ob
    direct_ptrs = out_base + rows[:, None] * stride_om + cols[None, :] * stride_on
    mirror_ptrs = out_base + cols[:, None] * stride_om + rows[None, :] * stride_on
    # A tile whose last row is <= its first column has no element below the diagonal.
    above_diagonal = tile_row * BLOCK_M + BLOCK_M - 1 <= tile_col * BLOCK_N
    if EVEN_M and above_diagonal:
        tl.store(direct_ptrs, out)
        tl.store(mirror_ptrs, out_t)
    else:
        inside = (rows[:, None] < M) & (cols[None, :] < M)
        tl.store(direct_ptrs, out, mask=inside & (rows[:, None] <= cols[None, :]))
        inside_t = (cols[:, None] < M) & (rows[None, :] < M)
        tl.store(mirror_ptrs, out_t, mask=inside_t & (rows[None, :] < cols[:, None]))


@triton.jit
def _sym_mm_kernel(
    A, B, C, OUT, TILES,
    M, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    alpha, beta, diag,
    HAS_C: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tile_row = tl.load(TILES + 2 * tile)
    tile_col = tl.load(TILES + 2 * tile + 1)

    rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_M:
        # Plain aranges keep the compiler's contiguity facts: vectorized loads along either dim.
        rows_in = rows
        cols_in = cols
    else:
        # Rows/cols past M read a valid row (their results are never stored): no masks in the loop.
        rows_in = tl.where(rows < M, rows, 0)
        cols_in = tl.where(cols < M, cols, 0)
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = A + batch * stride_ab + rows_in[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = B + batch * stride_bb + ks[:, None] * stride_bk + cols_in[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(ks[None, :] + k0) < K, other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] + k0) < K, other=0.0)
        if UPCAST_DOT:  # Triton's CPU interpreter mis-computes bf16 dots; products are exact in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    _symmetric_epilogue(
        acc, tile_row, tile_col, batch, C, OUT, M,
        stride_cb, stride_cm, stride_cn, stride_ob, stride_om, stride_on,
        alpha, beta, diag, HAS_C, EVEN_M, BLOCK_M, BLOCK_N,
    )


@triton.jit
def _tma_tile(
    work, a_desc, b_desc, C, OUT, TILES,
    M, K, num_tiles,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    alpha, beta, diag,
    HAS_C: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    batch = work // num_tiles
    tile = work - batch * num_tiles
    tile_row = tl.load(TILES + 2 * tile)
    tile_col = tl.load(TILES + 2 * tile + 1)
    a_row = batch * M + tile_row * BLOCK_M
    b_row = batch * M + tile_col * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([a_row, ki * BLOCK_K])
        b = b_desc.load([b_row, ki * BLOCK_K])
        if UPCAST_DOT:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    _symmetric_epilogue(
        acc, tile_row, tile_col, batch.to(tl.int64), C, OUT, M,
        stride_cb, stride_cm, stride_cn, stride_ob, stride_om, stride_on,
        alpha, beta, diag, HAS_C, True, BLOCK_M, BLOCK_N,
    )


@triton.jit(do_not_specialize=["num_tiles", "total_work", "num_programs"])
def _sym_mm_tma_kernel(
    a_desc, b_desc, C, OUT, TILES,
    M, K, num_tiles, total_work, num_programs,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    alpha, beta, diag,
    HAS_C: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # a_desc: A as [batch*M, K]; b_desc: Bᵀ as [batch*M, K] (K contiguous in both). M is a
    # multiple of both block sizes, so a tile never straddles two matrices; the K tail past
    # the end of a row is zero-filled by the TMA unit. Work item w = (batch, tile), batch-major;
    # with num_programs == total_work every program does one item (the per-tile variant).
    for work in tl.range(tl.program_id(0), total_work, num_programs):
        _tma_tile(work, a_desc, b_desc, C, OUT, TILES, M, K, num_tiles,
                  stride_cb, stride_cm, stride_cn, stride_ob, stride_om, stride_on,
                  alpha, beta, diag, HAS_C, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_K)


def upper_tile_list(m: int, block_m: int, block_n: int, group: int) -> list[tuple[int, int]]:
    """Output tiles holding at least one element with row <= col, in L2-friendly order.

    Tile rows are taken ``group`` at a time; within a group the sweep goes column by
    column, so the A rows of the group stay in L2 while B columns stream past.
    """
    tile_rows = triton.cdiv(m, block_m)
    tile_cols = triton.cdiv(m, block_n)
    tiles = []
    for first in range(0, tile_rows, group):
        for j in range(tile_cols):
            for i in range(first, min(first + group, tile_rows)):
                if i * block_m <= (j + 1) * block_n - 1:
                    tiles.append((i, j))
    return tiles


_TILE_TENSORS: dict = {}


def _tile_tensor(m: int, config: KernelConfig, device: torch.device) -> torch.Tensor:
    key = (m, config.block_m, config.block_n, config.group, str(device))
    tiles = _TILE_TENSORS.get(key)
    if tiles is None:
        pairs = upper_tile_list(m, config.block_m, config.block_n, config.group)
        tiles = torch.tensor(pairs, dtype=torch.int32).reshape(-1).to(device)
        _TILE_TENSORS[key] = tiles
    return tiles


def _as_batched(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


_SM_COUNTS: dict = {}


def _programs_per_launch(device: torch.device, config: KernelConfig) -> int:
    """Programs of the persistent kernel: one per SM (two for tiles of <= 128x128)."""
    if device.type != "cuda":
        return 4  # the interpreter: a few programs exercise the persistent loop
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SM_COUNTS.get(index)
    if sms is None:
        sms = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return sms * (2 if config.block_m * config.block_n <= 128 * 128 else 1)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _tma_capable(device: torch.device) -> bool:
    if device.type == "cuda":
        return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)
    return interpreter_active()


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """t [B, R, K] as a [B*R, K] view with K contiguous and 16-byte rows, or None."""
    batch, rows, k = t.shape
    if t.stride(2) != 1 or (batch > 1 and t.stride(0) != rows * t.stride(1)):
        return None
    if (t.stride(1) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    return t.as_strided((batch * rows, k), (t.stride(1), 1))


def _tma_operands(a3, b3, b_symmetric: bool, config: KernelConfig):
    """Row views of A and of Bᵀ for the TMA kernel, or None when the operands do not allow it."""
    m = a3.shape[1]
    if m % config.block_m or m % config.block_n or not _tma_capable(a3.device):
        return None
    if b3.stride(1) == 1:  # B is a transposed view (SYRK): its transpose is row-major
        bt = b3.mT
    elif b_symmetric and b3.shape[1] == m:  # rows of a symmetric B are its columns
        bt = b3
    else:
        return None
    a_rows, bt_rows = _rows_view(a3), _rows_view(bt)
    if a_rows is None or bt_rows is None:
        return None
    return a_rows, bt_rows


def sym_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out: torch.Tensor,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    config: KernelConfig = KernelConfig(),
    b_symmetric: bool = False,
) -> torch.Tensor:
    """``out = alpha·a@b + beta·c + diag·I`` for products known to be symmetric.

    Args:
        a: [B, M, K] or [M, K]; b: [B, K, M] or [K, M] (any strides; pass ``x.mT`` for X·Xᵀ).
        out: [B, M, M] or [M, M] of the operands' dtype; must not share memory with a, b or c.
        c: optional [B, M, M] addend (read on and above the diagonal only).
        alpha, beta, diag: scalars of the epilogue, applied in fp32.
        config: tile shape and launch parameters (``tma=1``/``2``: the TMA kernel where the
            operands allow it, else the pointer kernel with the same tiles).
        b_symmetric: b equals its transpose (K == M), so the TMA kernel may read its rows as
            columns. The Gram NS drivers pass it for their m×m operands, which the kernel
            itself wrote as exact mirrors.
    The caller guarantees the exact product is symmetric; the lower triangle of the result is
    the mirror of the computed upper triangle.
    """
    a3, b3, out3 = _as_batched(a), _as_batched(b), _as_batched(out)
    batch, m, k = a3.shape
    if b3.shape != (batch, k, m):
        raise ValueError(f"sym_matmul: b must have shape {(batch, k, m)} to match a {tuple(a3.shape)}, got {tuple(b3.shape)}")
    if out3.shape != (batch, m, m):
        raise ValueError(f"sym_matmul: out must have shape {(batch, m, m)}, got {tuple(out3.shape)}")
    if a.dtype not in SUPPORTED_DTYPES or b.dtype != a.dtype or out.dtype != a.dtype:
        raise ValueError(
            f"sym_matmul: a, b and out must share one dtype of {SUPPORTED_DTYPES}; got "
            f"{a.dtype}, {b.dtype}, {out.dtype} (use the torch fallback for float32)"
        )
    for name, t in (("a", a), ("b", b), ("c", c)):
        if t is not None and t.data_ptr() == out.data_ptr():
            raise ValueError(f"sym_matmul: out must not alias {name}; pass a separate buffer")
    if c is not None:
        c3 = _as_batched(c)
        if c3.shape != (batch, m, m):
            raise ValueError(f"sym_matmul: c must have shape {(batch, m, m)}, got {tuple(c3.shape)}")
    else:
        c3 = out3  # never read (HAS_C is False); any valid pointer
    config.validate()
    if m == 0 or batch == 0:
        return out
    tiles = _tile_tensor(m, config, a.device)
    num_tiles = tiles.numel() // 2
    upcast = a.dtype == torch.bfloat16 and interpreter_active()
    operands = _tma_operands(a3, b3, b_symmetric, config) if config.tma else None
    if operands is not None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_rows, bt_rows = operands
        a_desc = TensorDescriptor.from_tensor(a_rows, [config.block_m, config.block_k])
        b_desc = TensorDescriptor.from_tensor(bt_rows, [config.block_n, config.block_k])
        total = num_tiles * batch
        programs = min(total, _programs_per_launch(a.device, config)) if config.tma == 1 else total
        _sym_mm_tma_kernel[(programs,)](
            a_desc, b_desc, c3, out3, tiles,
            m, k, num_tiles, total, programs,
            c3.stride(0), c3.stride(1), c3.stride(2),
            out3.stride(0), out3.stride(1), out3.stride(2),
            float(alpha), float(beta), float(diag),
            HAS_C=c is not None,
            UPCAST_DOT=upcast,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return out
    _sym_mm_kernel[(num_tiles, batch)](
        a3, b3, c3, out3, tiles,
        m, k,
        a3.stride(0), a3.stride(1), a3.stride(2),
        b3.stride(0), b3.stride(1), b3.stride(2),
        c3.stride(0), c3.stride(1), c3.stride(2),
        out3.stride(0), out3.stride(1), out3.stride(2),
        float(alpha), float(beta), float(diag),
        HAS_C=c is not None,
        EVEN_K=(k % config.block_k == 0),
        EVEN_M=(m % config.block_m == 0 and m % config.block_n == 0),
        UPCAST_DOT=upcast,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def tma_applies(a: torch.Tensor, b: torch.Tensor, config: KernelConfig, b_symmetric: bool = False) -> bool:
    """Whether ``sym_matmul`` with this config runs the TMA kernel for these operands."""
    return bool(config.tma) and _tma_operands(_as_batched(a), _as_batched(b), b_symmetric, config) is not None
