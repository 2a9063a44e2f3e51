"""Gram Newton–Schulz kernels: Triton symmetric products, batching, autotuning, CUDA graphs.

Public API (Triton is imported lazily; everything falls back to torch where it cannot run):

* ``gram_newton_schulz_fast(x, ...)`` / ``newton_schulz_fast(x, ...)`` – drop-in fast versions
  of ``megatron_dmuon.algorithms.gram_newton_schulz`` / ``newton_schulz``.
* ``orthogonalize_batched(x, method='auto'|'gram'|'standard', **kw)`` – one same-shape stack;
  ``resolve_method(x, method, kw)`` – the method it runs ('auto': the autotune cache's measured
  choice, else ``algorithms.flops.ns_method_for``).
* ``syrk``, ``sym_poly``, ``sym_axpby``, ``sym_matmul`` – the symmetric-output products.
* ``orthogonalize_groups`` / ``GraphedGroups`` – several shape groups at once, one CUDA stream
  each (an owner's whole Muon step), optionally captured as one graph.
* ``tune_op``, ``tune_method``, ``AutotuneCache`` – shape-adaptive autotuning (disk cache);
  ``measured_method(device)`` – its Gram-vs-standard lookup, which ``planning.ns_choice`` reads.
* ``NONFINITE_METRICS`` – counters of the NaN/Inf → fp32 retry safety net.

The Polar Express schedules (``design_polar_express``, ``POLAR_EXPRESS_6``,
``schedule_for_shape``) are pure math: import them from ``megatron_dmuon.algorithms.schedules``.
"""

from .autotune import AutotuneCache, default_cache_path, measured_method, tune_op
from .ns_driver import gram_newton_schulz_fast, newton_schulz_fast, orthogonalize_batched, resolve_method
from .method_tuning import tune_method
from .multi_stream import GraphedGroups, orthogonalize_groups
from .metrics import NONFINITE_METRICS, nonfinite_metrics, reset_nonfinite_metrics, retry_nonfinite
from .symmetric_ops import sym_axpby, sym_matmul, sym_poly, syrk

__all__ = [
    "AutotuneCache",
    "GraphedGroups",
    "NONFINITE_METRICS",
    "default_cache_path",
    "gram_newton_schulz_fast",
    "measured_method",
    "newton_schulz_fast",
    "nonfinite_metrics",
    "orthogonalize_batched",
    "orthogonalize_groups",
    "reset_nonfinite_metrics",
    "resolve_method",
    "retry_nonfinite",
    "sym_axpby",
    "sym_matmul",
    "sym_poly",
    "syrk",
    "tune_method",
    "tune_op",
]
