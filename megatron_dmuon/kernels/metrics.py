"""Process-wide counters of the kernels' numerical safety net.

``NONFINITE_METRICS`` counts, over the life of the process:

* ``outputs_checked``   – matrices whose fast-path result was checked for NaN/Inf,
* ``nonfinite_outputs`` – matrices whose fast-path result held NaN/Inf,
* ``fp32_retries``      – matrices recomputed by the float32 torch path because of that.

Read it directly or through ``nonfinite_metrics()``; ``reset_nonfinite_metrics()`` zeroes it.
"""

from __future__ import annotations

NONFINITE_METRICS: dict[str, int] = {"outputs_checked": 0, "nonfinite_outputs": 0, "fp32_retries": 0}


def nonfinite_metrics() -> dict[str, int]:
    """A copy of the counters."""
    return dict(NONFINITE_METRICS)


def reset_nonfinite_metrics() -> None:
    for key in NONFINITE_METRICS:
        NONFINITE_METRICS[key] = 0
