"""CUTLASS (Hopper, sm90a) backend of the symmetric products, built with nvcc at first use.

``OUT[b] = alpha·A[b]@B[b] + beta·C[b] + diag·I`` with only the upper staircase of output tiles
computed by a persistent warp-specialized TMA/wgmma GEMM (CUTLASS 3.x collectives, a custom
tile scheduler, an EVT epilogue ``beta·C + (alpha·acc + diag·[row == col])`` in fp32 rounded
once), then the strictly lower triangle copied from the upper one by a mirror kernel: the same
semantics as ``symmetric_ops._torch_sym_matmul`` (fp32 products and epilogue, one rounding,
exactly symmetric result). Sources: ``kernels/cutlass/`` (C++ with ``extern "C"`` entry points,
loaded with ctypes, so no torch C++ headers and no torch extension build).

Building needs ``nvcc`` (``$CUDA_HOME/bin``, ``PATH`` or ``/usr/local/cuda/bin``) and the CUTLASS
headers: ``$DMUON_CUTLASS_INCLUDE``, else the include dir of the ``nvidia-cutlass`` wheel
(``cutlass_library/source/include``). The library is cached per machine under
``$DMUON_CUTLASS_CACHE`` or ``~/.cache/megatron_dmuon/cutlass/<hash>/`` (hash of the sources,
the nvcc version, the flags and the CUTLASS version), built under a file lock, the translation
units compiled in parallel. Where it cannot be built or run ``cutlass_usable`` is False and an
explicit ``backend='cutlass'`` raises ``CutlassUnavailable`` saying why.

Operand requirements (a copy is made otherwise): A K-contiguous (row-major), B K-contiguous (a
transposed view such as ``Xᵀ``, or ``b_symmetric`` with row-major rows), C and OUT row-major; m
and k multiples of 8 (16-byte TMA rows), else ValueError.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

SOURCE_DIR = Path(__file__).with_name("cutlass")
SOURCES = ("sym_gemm_sm90.cuh", "sym_gemm_sm90.cu", "sym_mirror.cu")
INCLUDE_ENV = "DMUON_CUTLASS_INCLUDE"
CACHE_ENV = "DMUON_CUTLASS_CACHE"
NUM_CONFIGS = 4  # the DMUON_CFG variants of sym_gemm_sm90.cu (tile, cluster, schedule)
CONFIG_NAMES = ("128x128 c1x1 coop", "128x128 c2x1 coop", "128x256 c2x1 coop", "128x128 c2x1 pingpong")
FLAGS = (
    "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
    "-Xcompiler=-fPIC", "-DNDEBUG", "-w",
)
DTYPES = (torch.float16, torch.bfloat16)


class CutlassUnavailable(RuntimeError, ValueError):
    """The CUTLASS backend cannot be built or run here (no nvcc/headers/sm90, or a build failure)."""


MIRRORS = {1: "separate pass", 2: "fused"}


@dataclasses.dataclass(frozen=True)
class CutlassConfig:
    """Which compiled variant runs (an index into ``CONFIG_NAMES``) and how the lower triangle is
    filled: ``mirror=1`` a separate mirror pass over the whole triangle, ``mirror=2`` fused (the
    epilogue of each tile wholly above the diagonal also stores its transpose; a band pass
    mirrors the tiles touching the diagonal)."""

    index: int = 2
    mirror: int = 2

    def as_dict(self) -> dict:
        return {"cutlass": self.index, "mirror": self.mirror}

    @classmethod
    def from_dict(cls, data: dict) -> "CutlassConfig":
        index, mirror = int(data.get("cutlass", -1)), int(data.get("mirror", 2))
        if set(data) - {"cutlass", "mirror"} or not 0 <= index < NUM_CONFIGS or mirror not in MIRRORS:
            raise ValueError(f"CutlassConfig: expected {{'cutlass': 0..{NUM_CONFIGS - 1}, 'mirror': 1|2}}, got {data}")
        return cls(index, mirror)


def cutlass_include_dir() -> Path | None:
    """The CUTLASS include dir (holding ``cutlass/cutlass.h``), or None."""
    candidates = []
    if os.environ.get(INCLUDE_ENV):
        candidates.append(Path(os.environ[INCLUDE_ENV]))
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates.append(Path(location) / "source" / "include")
    return next((c for c in candidates if (c / "cutlass" / "cutlass.h").is_file()), None)


def nvcc_path() -> str | None:
    candidates = [os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


@functools.lru_cache(maxsize=None)
def missing_prerequisites() -> str | None:
    """Why the library cannot be built here (None when nvcc and the headers are found); cached."""
    if nvcc_path() is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if cutlass_include_dir() is None:
        return f"CUTLASS headers not found (pip install nvidia-cutlass, or set {INCLUDE_ENV})"
    return None


def build_key(nvcc: str, include: Path) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(_nvcc_version(nvcc).encode())
    digest.update(" ".join(FLAGS).encode())
    version_h = include / "cutlass" / "version.h"
    digest.update(version_h.read_bytes() if version_h.is_file() else str(include).encode())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def software_key() -> str:
    """``'|cutlass<build hash>'`` where the library can be built here, else ``''`` (autotune keys)."""
    if missing_prerequisites() is not None:
        return ""
    try:
        return f"|cutlass{build_key(nvcc_path(), cutlass_include_dir())}"
    except (OSError, subprocess.SubprocessError):
        return ""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megatron_dmuon" / "cutlass")


def _units() -> list[tuple[str, list[str]]]:
    units = [("sym_mirror.o", ["sym_mirror.cu"])]
    for cfg in range(NUM_CONFIGS):
        for bf16 in (0, 1):
            units.append((f"gemm_{cfg}_{bf16}.o", ["sym_gemm_sm90.cu", f"-DDMUON_CFG={cfg}", f"-DDMUON_BF16={bf16}"]))
    return units


def build_library(*, jobs: int | None = None, verbose: bool = False) -> Path:
    """Compile (or find in the cache) ``libdmuon_sym.so``; returns its path."""
    why = missing_prerequisites()
    if why:
        raise CutlassUnavailable(why)
    nvcc, include = nvcc_path(), cutlass_include_dir()
    out_dir = cache_root() / build_key(nvcc, include)
    library = out_dir / "libdmuon_sym.so"
    if library.is_file():
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.is_file():  # another process built it while we waited
            return library
        base = [nvcc, *FLAGS, f"-I{include}", f"-I{SOURCE_DIR}"]

        def compile_unit(unit):
            obj, args = unit
            src, *defines = args
            cmd = [*base, *defines, "-c", str(SOURCE_DIR / src), "-o", str(out_dir / obj)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if verbose:
                print(" ".join(cmd), result.stdout, result.stderr, sep="\n")
            return cmd, result

        workers = jobs or min(len(_units()), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(compile_unit, _units()))
        for cmd, result in results:
            if result.returncode != 0:
                (out_dir / "build.log").write_text(result.stderr)
                raise CutlassUnavailable(f"nvcc failed ({' '.join(cmd[-4:])}):\n{result.stderr[-3000:]}")
        tmp = out_dir / f"libdmuon_sym.so.{os.getpid()}.tmp"
        link = [nvcc, "-shared", "-o", str(tmp), *[str(out_dir / obj) for obj, _ in _units()]]
        result = subprocess.run(link, capture_output=True, text=True)
        if result.returncode != 0:
            raise CutlassUnavailable(f"link failed:\n{result.stderr[-3000:]}")
        os.replace(tmp, library)
    return library


_LIB_ERROR: list[str] = []


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build_library()))
    except (CutlassUnavailable, OSError) as exc:
        _LIB_ERROR.append(str(exc))
        return None
    i64, f32, i32, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
    lib.dmuon_sym_matmul.argtypes = [i32, i32, vp, vp, vp, vp, i32, i32, i32, *([i64] * 8), f32, f32, f32, i32, i32, vp]
    lib.dmuon_sym_matmul.restype = i32
    lib.dmuon_last_error.restype = ctypes.c_char_p
    return lib


def library_error() -> str | None:
    """Why the library failed to build or load in this process (None if it has not failed)."""
    return _LIB_ERROR[-1] if _LIB_ERROR else None


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def cutlass_usable(t: Tensor) -> bool:
    """Whether the backend can run on this tensor: fp16/bf16 on an sm90 GPU, nvcc and headers here.

    Cheap: it does not build the library (the first call does; a failed build raises then)."""
    if not t.is_cuda or t.dtype not in DTYPES:
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _device_info(index)[0] == (9, 0) and missing_prerequisites() is None and library_error() is None


def default_config(m: int, k: int, batch: int) -> CutlassConfig:
    """The variant used when none was tuned (from
    docs/results/kernels/bench_sym_cutlass_fp16_h200_2026-12-01.md): the separate mirror pass
    everywhere; 128x128 tiles for small m, 128x128 pingpong for batches of big products, 128x256
    (2x1 cluster) for a single big product."""
    if m < 2048:
        return CutlassConfig(0, 1)
    return CutlassConfig(3 if batch >= 2 else 2, 1)


def _aligned(t: Tensor, dims: tuple[int, ...]) -> bool:
    return t.data_ptr() % 16 == 0 and all(t.stride(d) % 8 == 0 for d in dims)


def sym_matmul(a, b, out, c=None, alpha=1.0, beta=0.0, diag=0.0, *, config=None, b_symmetric=False) -> Tensor:
    """``out = alpha·a@b + beta·c + diag·I`` (symmetric) on the CUTLASS kernel; shapes checked by the caller."""
    lib = _library()
    if lib is None:
        raise CutlassUnavailable(f"backend='cutlass' is unavailable: {library_error()}")
    if a.dtype not in DTYPES or b.dtype != a.dtype or out.dtype != a.dtype or (c is not None and c.dtype != a.dtype):
        raise ValueError(f"backend='cutlass' needs a, b, c and out all float16 or all bfloat16; got {a.dtype}")
    a3, b3, out3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (a, b, out))
    batch, m, k = a3.shape
    if m % 8 or k % 8:
        raise ValueError(f"backend='cutlass' needs m and k multiples of 8 (16-byte TMA rows); got m={m}, k={k}")
    if a3.stride(-1) != 1 or not _aligned(a3, (0, 1)):
        a3 = a3.contiguous()
    if b3.stride(-2) == 1 and _aligned(b3, (0, 2)):
        ldb, sb = b3.stride(-1), b3.stride(0)  # K-contiguous: a transposed view
    elif b_symmetric and b3.stride(-1) == 1 and _aligned(b3, (0, 1)):
        ldb, sb = b3.stride(-2), b3.stride(0)  # b == bᵀ: its rows are its columns
    else:
        b3 = b3.mT.contiguous().mT
        ldb, sb = b3.stride(-1), b3.stride(0)
    target = out3 if out3.stride(-1) == 1 and _aligned(out3, (0, 1)) else torch.empty_like(out3, memory_format=torch.contiguous_format)
    if c is not None and beta != 0.0:
        c3 = c if c.dim() == 3 else c.unsqueeze(0)
        if c3.stride(-1) != 1 or not _aligned(c3, (0, 1)):
            c3 = c3.contiguous()
    else:
        c3, beta = target, 0.0  # beta = 0: the epilogue never loads C
    index = a3.device.index if a3.device.index is not None else torch.cuda.current_device()
    config = config or default_config(m, k, batch)
    stream = torch.cuda.current_stream(a3.device).cuda_stream
    with torch.cuda.device(a3.device):
        rc = lib.dmuon_sym_matmul(
            config.index, int(a3.dtype == torch.bfloat16), a3.data_ptr(), b3.data_ptr(), c3.data_ptr(), target.data_ptr(),
            batch, m, k, a3.stride(1), a3.stride(0), ldb, sb, c3.stride(1), c3.stride(0), target.stride(1),
            target.stride(0), float(alpha), float(beta), float(diag), config.mirror, _device_info(index)[1], stream,
        )
    if rc != 0:
        raise RuntimeError(f"CUTLASS symmetric GEMM failed: {lib.dmuon_last_error().decode()}")
    if target is not out3:
        out3.copy_(target)
    return out


def warm_up() -> str | None:
    """Build/load the library now (e.g. before timing); returns the error if it is unusable."""
    with contextlib.suppress(Exception):
        _library()
    return library_error()
