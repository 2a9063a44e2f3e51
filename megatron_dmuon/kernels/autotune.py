"""Shape-adaptive autotuning of the symmetric kernels, cached on disk.

Two kinds of decisions are tuned per (GPU, shape, batch, dtype) and cached:

* ``op`` entries – for each symmetric product of Gram NS (``syrk``: [B,m,k]·[B,m,k]ᵀ, and
  ``square``: an m×m·m×m product with an addend), which backend (Triton kernel with which
  BM/BN/BK, warps and stages; cuBLAS; quack; the CUTLASS sm90 kernel in each compiled
  variant) is fastest. Every candidate is checked against the
  float32 torch fallback first and dropped if it disagrees.
* ``method`` entries – whether Gram or standard NS orthogonalizes a [B, m, n] stack faster,
  each checked against the torch reference path of the same method. They are measured by
  ``method_tuning.tune_method`` (it runs the NS drivers of ``ns_driver``, which build on
  this module) and read here by ``cached_method``.

The cache is a JSON file: ``cache_path`` argument, else ``$DMUON_AUTOTUNE_CACHE``, else
``~/.cache/megatron_dmuon/autotune.json``. Keys hold the GPU (name, compute capability) and the
software that compiled the kernels (torch and Triton versions): an upgrade re-tunes instead of
reusing a choice that may no longer compile. A write takes an exclusive lock on a side file,
re-reads the file, merges and replaces it atomically, so concurrent ranks neither corrupt it
nor drop each other's keys. Lookups are memoised in-process. A cached kernel choice that fails
when it runs is reported once (warning), counted (``metrics.NONFINITE_METRICS
['kernel_fallbacks']``) and that shape runs the torch path from then on (ns_driver).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
from pathlib import Path

import torch

from ..json_store import JsonStore
from . import symmetric_ops
from .cutlass_symmetric import NUM_CONFIGS as NUM_CUTLASS_CONFIGS, CutlassConfig, cutlass_usable
from .symmetric_ops import quack_usable, triton_usable

CACHE_ENV = "DMUON_AUTOTUNE_CACHE"
CACHE_VERSION = 3  # 2: Triton configs gained the tma field; 3: keys hold the torch/Triton versions
OPS: tuple[str, ...] = ("syrk", "square")
# Relative Frobenius tolerance of a candidate kernel vs the float32 torch fallback.
OP_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


@dataclasses.dataclass(frozen=True)
class OpChoice:
    """How one symmetric product runs: a backend, and the Triton config when it is Triton."""

    backend: str
    config: object = None  # KernelConfig for 'triton'

    def as_dict(self) -> dict:
        return {"backend": self.backend, "config": None if self.config is None else self.config.as_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "OpChoice":
        config = data.get("config")
        if config is not None and data["backend"] == "cutlass":
            config = CutlassConfig.from_dict(config)
        elif config is not None:
            from .triton_symmetric import KernelConfig

            config = KernelConfig.from_dict(config)
        return cls(backend=data["backend"], config=config)


@dataclasses.dataclass(frozen=True)
class ShapePlan:
    """The choices for the two product kinds of one [B, m, n] orthogonalization."""

    syrk: OpChoice
    square: OpChoice


_RUN_CACHE_PATH: "Path | None" = None  # this run's DMuonConfig.autotune_cache (use_cache_file)


def use_cache_file(path) -> None:
    """Point this process's kernels at ``path`` (a run's ``DMuonConfig.autotune_cache``; None: the
    default again). The config reaches the kernels here, not through the environment."""
    global _RUN_CACHE_PATH
    _RUN_CACHE_PATH = Path(path).expanduser() if path else None


def default_cache_path() -> Path:
    if _RUN_CACHE_PATH is not None:
        return _RUN_CACHE_PATH
    env = os.environ.get(CACHE_ENV)  # the default's default, read where no run set a file
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "megatron_dmuon" / "autotune.json"


class AutotuneCache(JsonStore):
    """The kernels' cache: ``entries`` maps ``op_key`` / ``method_key`` strings (GPU, shape,
    batch, dtype) to what ``tune_op`` / ``tune_method`` measured; a file of another
    ``CACHE_VERSION`` is ignored and its shapes re-tuned."""

    version = CACHE_VERSION
    label = "autotune cache"
    env = f"${CACHE_ENV} (or DMuonConfig.autotune_cache)"  # where a user points it (the flag: megatron/flags.py)
    default_path = staticmethod(default_cache_path)


_CACHES: dict[Path, AutotuneCache] = {}
_MEMO: dict[tuple, object] = {}


def get_cache(path: str | os.PathLike | None = None) -> AutotuneCache:
    resolved = Path(path).expanduser() if path is not None else default_cache_path()
    cache = _CACHES.get(resolved)
    if cache is None:
        cache = _CACHES[resolved] = AutotuneCache(resolved)
    return cache


def device_key(device: torch.device) -> str:
    """GPU name, compute capability and the compiling software, e.g.
    'NVIDIA H200|sm90|torch2.11.0|triton3.6.0'; 'cpu|torch...|triton...' for CPU tensors."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{device.type}|{software_key()}"
    return _cuda_device_key(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def software_key() -> str:
    """The versions that decide whether a cached kernel still compiles: torch and Triton."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"torch{torch.__version__}|triton{triton_version}"


@functools.lru_cache(maxsize=None)
def _cuda_device_key(index: int) -> str:  # queried once per GPU: this sits on every call's path
    major, minor = torch.cuda.get_device_capability(index)
    key = f"{torch.cuda.get_device_name(index)}|sm{major}{minor}|{software_key()}"
    if (major, minor) == (9, 0):  # a CUTLASS candidate exists here: its sources/nvcc/headers decide too
        from .cutlass_symmetric import software_key as cutlass_key

        key += cutlass_key()
    return key


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def op_key(dev: str, op: str, m: int, k: int, batch: int, dtype: torch.dtype) -> str:
    return f"op|{dev}|{op}|m{m}|k{k}|b{batch}|{_dtype_name(dtype)}"


def method_key(dev: str, m: int, n: int, batch: int, dtype: torch.dtype, steps: int) -> str:
    return f"method|{dev}|{m}x{n}|b{batch}|{_dtype_name(dtype)}|T{steps}"


def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device.index if device.index is not None else torch.cuda.current_device())


def default_config(device: torch.device, m: int, k: int):
    """A config that is good without measuring (Hopper/Ampere heuristics; small tiles for small m)."""
    from .triton_symmetric import KernelConfig

    if device.type != "cuda":  # the interpreter: big tiles mean few (slow, Python-level) programs
        return KernelConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1, group=4)
    major, _ = _capability(device)
    if m <= 256:
        return KernelConfig(64, 64, 64, 4, 4, 4)
    if major >= 9:
        return KernelConfig(128, 128, 64, 8, 3, 8)
    return KernelConfig(128, 128, 32, 4, 4, 8)


def candidate_configs(device: torch.device, m: int, k: int) -> list:
    """The Triton configs tried for one product shape (kept short: each one compiles)."""
    from .triton_symmetric import KernelConfig

    major, _ = _capability(device)
    if major >= 9:
        configs = [
            # Pointer kernel (128x128 with 3 stages leaves room for two programs per SM).
            KernelConfig(128, 128, 64, 8, 3, 8),
            KernelConfig(128, 128, 64, 8, 4, 8),
            KernelConfig(128, 256, 64, 8, 3, 8),
            KernelConfig(128, 256, 64, 8, 4, 8),
            KernelConfig(64, 64, 64, 4, 4, 4),
            # TMA loads (used only where the operands allow it, else = the pointer kernel):
            # persistent (tma=1) and one program per tile (tma=2).
            KernelConfig(128, 128, 64, 8, 4, 8, tma=1),
            KernelConfig(128, 256, 64, 8, 4, 8, tma=1),
            KernelConfig(128, 128, 64, 8, 3, 8, tma=2),
            KernelConfig(128, 256, 64, 8, 3, 8, tma=2),
            KernelConfig(128, 256, 64, 8, 4, 8, tma=2),
        ]
    else:
        configs = [
            KernelConfig(128, 128, 32, 4, 4, 8),
            KernelConfig(128, 128, 32, 8, 3, 8),
            KernelConfig(128, 256, 32, 8, 3, 8),
            KernelConfig(64, 64, 32, 4, 4, 4),
            KernelConfig(64, 128, 32, 4, 4, 4),
        ]
    # Tiles much larger than the matrix only waste work; small matrices need many small tiles
    # to fill the GPU (there cuBLAS usually wins anyway, so fewer candidates are tried).
    limit = max(64, 1 << max(6, math.ceil(math.log2(max(m, 1)))))
    if m <= 1024:
        limit = min(limit, 128)
    return [c for c in configs if c.block_m <= limit and c.block_n <= limit]


def time_cuda_ms(fn, *, target_ms: float = 40.0, min_reps: int = 3, max_reps: int = 50) -> float:
    """Median time of ``fn()`` in ms, measured with CUDA events after two warm-up calls."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate = max((time.perf_counter() - start) * 1e3, 1e-3)
    reps = int(min(max_reps, max(min_reps, target_ms / estimate)))
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    ref = reference.double()
    return float((value.double() - ref).norm() / ref.norm().clamp(min=1e-30))


def _op_inputs(op: str, m: int, k: int, batch: int, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(1234)
    if op == "syrk":
        x = torch.randn(batch, m, k, device=device, generator=gen)
        x = (x / x.norm(dim=(-2, -1), keepdim=True)).to(dtype)
        return dict(a=x, b=x.mT)
    g = torch.randn(batch, m, k, device=device, generator=gen) / math.sqrt(m)
    r = (g + g.mT) / 2
    r = (r / r.norm(dim=(-2, -1), keepdim=True)).to(dtype)  # spectral norm <= 1, like NS's R
    return dict(a=r, b=r, c=r, alpha=2.0, beta=-4.75, b_symmetric=True)  # an NS polynomial step


def tune_op(
    op: str,
    m: int,
    k: int,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    cache: AutotuneCache | None = None,
    candidates: list | None = None,
    backends: tuple[str, ...] = ("triton", "cublas", "quack", "cutlass"),
) -> OpChoice:
    """Measure the candidates of one product shape, keep the fastest correct one, cache it."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "square" and k != m:
        raise ValueError(f"op='square' needs k == m, got m={m}, k={k}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"tune_op measures CUDA kernels; got device {device}")
    cache = cache or get_cache()
    inputs = _op_inputs(op, m, k, batch, dtype, device)
    reference = symmetric_ops.sym_matmul(**inputs, backend="torch")
    out = torch.empty_like(reference)
    tolerance = OP_TOLERANCE[dtype]
    results = []

    def trial(choice: OpChoice):
        run = lambda: symmetric_ops.sym_matmul(**inputs, out=out, backend=choice.backend, config=choice.config)  # noqa: E731
        try:
            out.fill_(float("nan"))
            run()
            error = relative_error(out, reference)
            if not error <= tolerance:
                results.append({**choice.as_dict(), "rejected": f"relative error {error:.3g} > {tolerance}"})
                return
            results.append({**choice.as_dict(), "time_ms": time_cuda_ms(run, target_ms=25.0, max_reps=30), "error": error})
        except Exception as exc:  # a config that does not compile/launch here (e.g. shared memory)
            results.append({**choice.as_dict(), "rejected": f"{type(exc).__name__}: {str(exc)[:200]}"})

    probe = inputs["a"]
    if "triton" in backends and triton_usable(probe):
        for config in candidates if candidates is not None else candidate_configs(device, m, k):
            trial(OpChoice("triton", config))
    if "cublas" in backends:
        trial(OpChoice("cublas"))
    if "quack" in backends and quack_usable(probe):
        trial(OpChoice("quack"))
    if "cutlass" in backends and cutlass_usable(probe):
        for index in range(NUM_CUTLASS_CONFIGS):
            for mirror in (1, 2):
                trial(OpChoice("cutlass", CutlassConfig(index, mirror)))
    timed = [r for r in results if "time_ms" in r]
    if not timed:
        raise RuntimeError(f"autotune: no backend produced a correct {op} product for m={m}, k={k}: {results}")
    best = min(timed, key=lambda r: r["time_ms"])
    choice = OpChoice.from_dict(best)
    cache.put(
        op_key(device_key(device), op, m, k, batch, dtype),
        {"choice": choice.as_dict(), "time_ms": best["time_ms"], "candidates": results, "tuned_at": time.time()},
    )
    _MEMO[("op", str(cache.path), device_key(device), op, m, k, batch, dtype)] = choice
    return choice


def op_choice(
    op: str, m: int, k: int, batch: int, dtype: torch.dtype, device: torch.device, *,
    autotune: bool, cache_path=None, force_triton: bool = False,
) -> OpChoice:
    """The cached choice for a product shape; tuned now if missing and ``autotune``."""
    device = torch.device(device)
    dev = device_key(device)
    cache = get_cache(cache_path)
    memo_key = ("op", str(cache.path), dev, op, m, k, batch, dtype)
    choice = _MEMO.get(memo_key)
    if choice is None and autotune and device.type == "cuda":
        entry = cache.get(op_key(dev, op, m, k, batch, dtype))
        if entry is not None:
            choice = OpChoice.from_dict(entry["choice"])
        else:
            choice = tune_op(op, m, k, batch, dtype, device, cache=cache)
        _MEMO[memo_key] = choice
    if choice is None:
        choice = OpChoice("triton", default_config(device, m, k))
    if force_triton and choice.backend != "triton":
        # The best Triton candidate recorded for this shape, else the default config.
        entry = cache.get(op_key(dev, op, m, k, batch, dtype)) if device.type == "cuda" else None
        triton_timed = [c for c in (entry or {}).get("candidates", []) if c.get("backend") == "triton" and "time_ms" in c]
        if triton_timed:
            return OpChoice.from_dict(min(triton_timed, key=lambda c: c["time_ms"]))
        return OpChoice("triton", default_config(device, m, k))
    return choice


def shape_plan(
    m: int, n: int, batch: int, dtype: torch.dtype, device: torch.device, *,
    autotune: bool = True, cache_path=None, force_triton: bool = False,
) -> ShapePlan:
    """Choices for the products of orthogonalizing a [batch, m, n] stack (m <= n)."""
    kwargs = dict(autotune=autotune, cache_path=cache_path, force_triton=force_triton)
    return ShapePlan(
        syrk=op_choice("syrk", m, n, batch, dtype, device, **kwargs),
        square=op_choice("square", m, m, batch, dtype, device, **kwargs),
    )


def measured_method(device: torch.device, cache_path=None):
    """The autotune cache's lookup for ``planning.ns_choice.choose_ns`` on ``device``:
    ``(m, n, batch, dtype, steps) -> 'gram' | 'standard' | None``."""
    return lambda m, n, batch, dtype, steps: cached_method(m, n, batch, dtype, device, steps, cache_path)


def cached_method(m: int, n: int, batch: int, dtype: torch.dtype, device: torch.device, steps: int, cache_path=None) -> str | None:
    """'gram' or 'standard' if ``tune_method`` measured this shape on this GPU, else None."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():  # a planner without a GPU: nothing measured here
        return None
    entry = get_cache(cache_path).get(method_key(device_key(device), m, n, batch, dtype, steps))
    return None if entry is None else entry["method"]

