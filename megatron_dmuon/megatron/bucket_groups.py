"""The one place DMuon changes the class of Megatron's bucket groups.

Megatron's DDP builds its ``_ParamAndGradBucketGroup`` objects inside ``__init__``
(``partition_buckets``) and links them to each other and to the params (the param-gather chain,
``param_to_bucket_group``, the overlap hooks); it has no hook for the bucket-group class. Building
them again would copy Megatron's partition and linking code, so a feature that changes how a
bucket group communicates (two-level reduce/publish, FP8 publish) extends the objects Megatron
built: each becomes an instance of ``(feature mixin, Megatron's class)``, with the feature's state
under one attribute of the mixin's own (``two_level`` / ``owner_fp8``; docs/architecture.md).
"""
from __future__ import annotations

import functools
from typing import Callable


@functools.lru_cache(maxsize=None)
def _extended_class(mixin: type, base: type) -> type:
    return type(mixin.__name__.lstrip("_") + base.__name__, (mixin, base), {})


def extend_bucket_groups(ddp, mixin: type, state_of: Callable[[object], object]) -> None:
    """Give every dense and expert bucket group of ``ddp`` the behaviour of ``mixin``, with
    ``state_of(bucket_group)`` stored under ``mixin.state_name`` (each group once)."""
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        if isinstance(bucket_group, mixin):
            continue
        state = state_of(bucket_group)  # computed from Megatron's group as built, before the swap
        bucket_group.__class__ = _extended_class(mixin, type(bucket_group))
        setattr(bucket_group, mixin.state_name, state)
