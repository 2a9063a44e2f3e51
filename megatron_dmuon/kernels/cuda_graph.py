"""CUDA-graph capture of a whole batched NS step, for owners that see static shapes.

A Gram NS of a [B, m, n] stack is ~25 kernel launches; for many small matrices the launch
overhead (Python + driver) dominates. ``GraphedOrthogonalizer`` captures one
``orthogonalize_batched`` call on a static input buffer once, then each call copies the new
input in and replays the graph.

Notes:
* The warm-up before capture compiles the kernels and fills the autotune cache, so capture
  launches nothing but cached work.
* The returned tensor is the graph's static output buffer: the next call overwrites it
  (pass ``copy_output=True`` to get a fresh tensor).
* ``check_finite`` is applied after the replay (it needs a host sync, which a graph cannot
  hold): non-finite output matrices are recomputed eagerly in float32 and counted.
* Off CUDA, ``graphed_orthogonalize`` simply calls ``orthogonalize_batched``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gram_ns_triton import _retry_nonfinite, orthogonalize_batched, resolve_method

__all__ = ["GraphedOrthogonalizer", "graphed_orthogonalize", "clear_graphs"]


class GraphedOrthogonalizer:
    """``orthogonalize_batched`` for one static (shape, dtype, device, options), graph-replayed."""

    def __init__(self, example: Tensor, method: str = "auto", warmup: int = 2, **kwargs):
        if not isinstance(example, Tensor) or not example.is_cuda:
            raise ValueError("GraphedOrthogonalizer needs a CUDA tensor as example; use orthogonalize_batched on CPU")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the kernels must compile before capture), got {warmup}")
        self.check_finite = bool(kwargs.pop("check_finite", False))
        self.method = resolve_method(example, method, kwargs)
        self.kwargs = kwargs
        self.static_input = example.detach().clone()
        side = torch.cuda.Stream(device=example.device)
        side.wait_stream(torch.cuda.current_stream(example.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                orthogonalize_batched(self.static_input, self.method, check_finite=False, **kwargs)
        torch.cuda.current_stream(example.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_output = orthogonalize_batched(self.static_input, self.method, check_finite=False, **kwargs)

    def __call__(self, x: Tensor, copy_output: bool = False) -> Tensor:
        if x.shape != self.static_input.shape or x.dtype != self.static_input.dtype or x.device != self.static_input.device:
            raise ValueError(
                f"this graph was captured for {tuple(self.static_input.shape)} {self.static_input.dtype} on "
                f"{self.static_input.device}; got {tuple(x.shape)} {x.dtype} on {x.device}: build another one"
            )
        self.static_input.copy_(x)
        self.graph.replay()
        out = self.static_output
        if self.check_finite:
            fp32 = dict(self.kwargs, compute_dtype=torch.float32, backend="torch")
            out = _retry_nonfinite(out, x, lambda sub: orthogonalize_batched(sub, self.method, **fp32))
        return out.clone() if copy_output and out is self.static_output else out


_GRAPHS: dict[tuple, GraphedOrthogonalizer] = {}


def _options_key(method: str, kwargs: dict) -> tuple:
    return (method, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))


def graphed_orthogonalize(x: Tensor, method: str = "auto", copy_output: bool = False, **kwargs) -> Tensor:
    """``orthogonalize_batched(x, method, **kwargs)`` through a per-(shape, dtype, device, options)
    cached CUDA graph; captured on first use. Off CUDA it runs eagerly."""
    if not x.is_cuda:
        return orthogonalize_batched(x, method, **kwargs)
    key = (tuple(x.shape), x.dtype, str(x.device), _options_key(method, kwargs))
    graphed = _GRAPHS.get(key)
    if graphed is None:
        graphed = _GRAPHS[key] = GraphedOrthogonalizer(x, method, **kwargs)
    return graphed(x, copy_output=copy_output)


def clear_graphs() -> None:
    """Drop every captured graph (frees their memory pools)."""
    _GRAPHS.clear()
