"""Count the bytes the gradient/parameter buffers really put on the wire (test infrastructure).

Wraps torch.distributed's collectives (and the aliases megatron-core's buffers bind at import)
and records every call on a DDP bucket buffer, with the size of its group, as bytes a ring
algorithm sends per rank: reduce-scatter / all-gather (D-1)/D of the full buffer, all-reduce
2(D-1)/D, all-to-all the part of the input that leaves the rank. Lets a test hold
`comm_bytes_per_step` (the model the reports use) against what Megatron actually launched.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist


def _storage(t):
    return t.untyped_storage().data_ptr()


@contextlib.contextmanager
def count_bucket_bytes(model_chunks):
    """Yields {'reduce': bytes, 'publish': bytes, 'all_to_all': bytes} filled while active."""
    buffers = [b for c in model_chunks for b in c.buffers + c.expert_parallel_buffers]
    grad_ptrs = {_storage(b.grad_data) for b in buffers}
    param_ptrs = {_storage(b.param_data) for b in buffers if b.param_data is not None}
    # an FP8 publish gathers packed byte blocks (megatron/publish.py) instead of param_data
    param_ptrs |= {_storage(block) for c in model_chunks for g in c.bucket_groups + c.expert_parallel_bucket_groups
                   for block in (g.owner_fp8.blocks if hasattr(g, "owner_fp8") else ())}
    counts = defaultdict(float)

    def size(group):
        return dist.get_world_size(group)

    def nbytes(t):
        return t.numel() * t.element_size()

    def reduce_scatter(output, input, *a, group=None, **k):
        if _storage(input) in grad_ptrs:
            d = size(group)
            counts["reduce"] += (d - 1) / d * nbytes(input)
        return originals["reduce_scatter_tensor"](output, input, *a, group=group, **k)

    def all_gather(output, input, *a, group=None, **k):
        if _storage(output) in param_ptrs:
            d = size(group)
            counts["publish"] += (d - 1) / d * nbytes(output)
        return originals["all_gather_into_tensor"](output, input, *a, group=group, **k)

    def all_reduce(tensor, *a, group=None, **k):
        if _storage(tensor) in grad_ptrs:
            d = size(group)
            counts["reduce"] += 2 * (d - 1) / d * nbytes(tensor)
        return originals["all_reduce"](tensor, *a, group=group, **k)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **k):
        d, me = size(group), dist.get_rank(group)
        if input_split_sizes:
            kept = input_split_sizes[me]
        else:
            kept = input.numel() // d
        counts["all_to_all"] += (input.numel() - kept) * input.element_size()
        return originals["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, group=group, **k)

    wrappers = {"reduce_scatter_tensor": reduce_scatter, "all_gather_into_tensor": all_gather,
                "all_reduce": all_reduce, "all_to_all_single": all_to_all_single}
    originals = {name: getattr(dist, name) for name in wrappers}
    with _patched(wrappers, {"dist_reduce_scatter_func": reduce_scatter, "dist_all_gather_func": all_gather}):
        yield counts


@contextlib.contextmanager
def _patched(collectives: dict, buffer_aliases: dict):
    """torch.distributed's functions and megatron-core's buffer aliases of them replaced while
    active (``{name: replacement}`` each), restored after."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    saved = [(dist, name, getattr(dist, name)) for name in collectives]
    saved += [(pgb, name, getattr(pgb, name)) for name in buffer_aliases]
    try:
        for name, fn in collectives.items():
            setattr(dist, name, fn)
        for name, fn in buffer_aliases.items():
            setattr(pgb, name, fn)
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


# every torch.distributed entry point a DMuon step can reach (collectives and the object helpers
# built on them); megatron-core's buffers also bind reduce-scatter / all-gather under their own names
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "all_gather",
               "reduce_scatter", "broadcast", "reduce", "all_to_all", "all_gather_object", "broadcast_object_list",
               "barrier", "_reduce_scatter_base", "_all_gather_base")


@contextlib.contextmanager
def count_collective_calls():
    """Yields {torch.distributed function name: calls} counted while active, whatever the tensor
    (grad buffers, grad-norm and NaN-flag all-reduces, TP exchanges); nested helper calls (an
    object all-gather running an all-gather) count once, at the outermost call."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    counts = defaultdict(int)
    depth = [0]

    def counted(name, fn):
        def call(*a, **k):
            if depth[0] == 0:
                counts[name] += 1
            depth[0] += 1
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
        return call

    collectives = {name: counted(name, getattr(dist, name)) for name in COLLECTIVES if hasattr(dist, name)}
    aliases = {alias: counted(name, getattr(pgb, alias)) for alias, name in
               (("dist_reduce_scatter_func", "reduce_scatter_tensor"), ("dist_all_gather_func", "all_gather_into_tensor"))}
    with _patched(collectives, aliases):
        yield counts
