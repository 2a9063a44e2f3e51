"""Several same-shape stacks at once (an owner's shape groups): one CUDA stream per stack.

One owner rank orthogonalizes a few shape groups per step (for a Qwen2.5-7B layer: q,o |
k,v | gate,up,down). Run one after the other, each group's tail waves, its launch gaps and its
memory-bound passes leave SMs idle, and small groups (k,v: m = 512) never fill the GPU. Here
the largest stack runs on the current stream and every other one on its own side stream, so
their kernels fill those gaps. Results are bit-identical to running the stacks one by one
(the same kernels on the same data; only their overlap in time changes).

``GraphedGroups`` captures the whole multi-stream step in one CUDA graph for static shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .ns_driver import orthogonalize_batched, resolve_method
from .metrics import retry_nonfinite

__all__ = ["GraphedGroups", "orthogonalize_groups"]

_SIDE_STREAMS: dict[str, list] = {}


def _side_streams(device: torch.device, count: int) -> list:
    pool = _SIDE_STREAMS.setdefault(str(device), [])
    while len(pool) < count:
        # High priority: the smaller groups' kernels take SMs as soon as the big group frees them.
        pool.append(torch.cuda.Stream(device=device, priority=-1))
    return pool[:count]


def _per_stack(stacks, per_stack_kwargs, kwargs) -> list[dict]:
    if not isinstance(stacks, Sequence) or isinstance(stacks, Tensor) or not stacks:
        raise ValueError("stacks must be a non-empty list of [..., m, n] tensors")
    for i, s in enumerate(stacks):
        if not isinstance(s, Tensor) or s.ndim < 2:
            raise ValueError(f"stacks[{i}] must be a tensor [..., m, n]; got {getattr(s, 'shape', type(s))}")
        if s.device != stacks[0].device:
            raise ValueError(f"stacks[{i}] is on {s.device} but stacks[0] on {stacks[0].device}; put them on one device")
    if per_stack_kwargs is None:
        return [dict(kwargs) for _ in stacks]
    if len(per_stack_kwargs) != len(stacks):
        raise ValueError(f"per_stack_kwargs has {len(per_stack_kwargs)} entries for {len(stacks)} stacks; pass one dict per stack")
    return [{**kwargs, **extra} for extra in per_stack_kwargs]


def _methods(method, count: int) -> list[str]:
    if isinstance(method, str):
        return [method] * count
    methods = list(method)
    if len(methods) != count:
        raise ValueError(f"method has {len(methods)} entries for {count} stacks; pass one name or one per stack")
    return methods


def orthogonalize_groups(
    stacks: Sequence[Tensor], method: str | Sequence[str] = "auto", per_stack_kwargs: Sequence[dict] | None = None,
    concurrent: bool = True, **kwargs,
) -> list[Tensor]:
    """``[orthogonalize_batched(s, method, **kwargs, **per_stack_kwargs[i]) for s in stacks]``,
    the stacks running concurrently on CUDA streams (off CUDA, or with ``concurrent=False``,
    one after the other). ``method`` is one name or one per stack; ``per_stack_kwargs`` (one
    dict per stack) overrides ``kwargs``, e.g. ``[schedule_for_shape(*s.shape[-2:]) for s in stacks]``."""
    options = _per_stack(stacks, per_stack_kwargs, kwargs)
    methods = _methods(method, len(stacks))
    device = stacks[0].device
    if not concurrent or device.type != "cuda" or len(stacks) == 1:
        return [orthogonalize_batched(s, m, **o) for s, m, o in zip(stacks, methods, options)]
    main = torch.cuda.current_stream(device)
    order = sorted(range(len(stacks)), key=lambda i: stacks[i].numel() * min(stacks[i].shape[-2:]), reverse=True)
    sides = _side_streams(device, len(stacks) - 1)
    outputs: list = [None] * len(stacks)
    for position, i in enumerate(order):
        stream = main if position == 0 else sides[position - 1]
        if stream is not main:
            stream.wait_stream(main)  # inputs were written on the current stream
        with torch.cuda.stream(stream):
            outputs[i] = orthogonalize_batched(stacks[i], methods[i], **options[i])
    capturing = torch.cuda.is_current_stream_capturing()
    for position, i in enumerate(order[1:]):
        main.wait_stream(sides[position])
        if not capturing:  # (a captured graph keeps its outputs in its own pool)
            # Allocated on a side stream but used on the current one from now on.
            outputs[i].record_stream(main)
    return outputs


class GraphedGroups:
    """``orthogonalize_groups`` for fixed shapes, captured once (all streams) and replayed.
    The outputs are the graph's static buffers: the next call overwrites them.

    ``adopt_inputs=True`` makes ``examples`` themselves the graph's input buffers (no copy): a
    caller that writes its next inputs into ``static_inputs`` and passes them back replays
    without copying anything in."""

    def __init__(self, examples: Sequence[Tensor], method: str | Sequence[str] = "auto", per_stack_kwargs=None,
                 warmup: int = 2, adopt_inputs: bool = False, **kwargs):
        options = _per_stack(examples, per_stack_kwargs, kwargs)
        if not examples[0].is_cuda:
            raise ValueError("GraphedGroups needs CUDA tensors; use orthogonalize_groups off the GPU")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the kernels must compile before capture), got {warmup}")
        self.check_finite = [bool(o.pop("check_finite", False)) for o in options]
        # Resolve 'auto' once, so that warm-up, capture and the fp32 retries agree.
        self.methods = [resolve_method(x, m, o) for x, m, o in zip(examples, _methods(method, len(examples)), options)]
        self.options = options
        self.static_inputs = [x.detach() if adopt_inputs else x.detach().clone() for x in examples]

        def step():
            return orthogonalize_groups(self.static_inputs, self.methods, per_stack_kwargs=self.options)

        device = examples[0].device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_outputs = step()

    def __call__(self, stacks: Sequence[Tensor]) -> list[Tensor]:
        if len(stacks) != len(self.static_inputs) or any(
            x.shape != s.shape or x.dtype != s.dtype or x.device != s.device for x, s in zip(stacks, self.static_inputs)
        ):
            raise ValueError(
                f"this graph was captured for {[tuple(s.shape) for s in self.static_inputs]}; got "
                f"{[tuple(getattr(x, 'shape', ())) for x in stacks]}: build another one"
            )
        for static, x in zip(self.static_inputs, stacks):
            if x.data_ptr() != static.data_ptr():  # inputs written into the buffers need no copy
                static.copy_(x)
        self.graph.replay()
        outputs = list(self.static_outputs)
        for i, x in enumerate(stacks):
            if self.check_finite[i]:
                fp32 = dict(self.options[i], compute_dtype=torch.float32, backend="torch")
                outputs[i] = retry_nonfinite(
                    outputs[i], x, lambda sub, m=self.methods[i], o=fp32: orthogonalize_batched(sub, m, **o)
                )
        return outputs
