"""FP8 publish on Megatron's own param all-gather (`--dmuon-publish-dtype fp8_e4m3|fp8_e5m2`).

Megatron's `_ParamAndGradBucketGroup.start_param_sync` all-gathers each bucket's `param_data` in
the model's dtype. The mixin below (given to DDP's bucket groups by megatron/bucket_groups.py, as
for two-level groups) sends one packed byte block per rank and bucket instead
(planning/fp8_blocks.py): every Muon matrix as FP8 bytes quantized by its owner from the fp32
master with a per-tensor scale (algorithms/fp8.py), plus that scale; the rest in the model's dtype.
Every rank, the owner included, decodes the gathered block into `param_data` in
`_post_param_sync`, which Megatron calls after the collective on every path: synchronous (the
optimizer step), overlapped (the forward pre-hook's `finish_param_sync`) and forced (hook
disable, checkpoint load). The forward therefore sees the owner's quantized values on every rank.
"""
from __future__ import annotations

from typing import Callable, Dict, Literal, Optional, get_args

import torch

from ..algorithms.fp8 import dequantize, fp8_dtype, quantize_per_tensor
from ..planning.fp8_blocks import PublishLayout, plan_publish
from ..planning.dp_shards import shard_range
from .bucket_groups import extend_bucket_groups
from .hierarchy import HandleGroup

# 'param': the model's dtype; else FP8 bytes of algorithms/fp8.py's dtypes
PublishDtype = Literal["param", "fp8_e4m3", "fp8_e5m2"]
PUBLISH_DTYPES: tuple = get_args(PublishDtype)


def check_publish_config(publish_dtype: str, model_params) -> None:
    """Start-up check of --dmuon-publish-dtype against the model (before any buffer exists; the
    config's own values are checked where it is built, megatron/config.py)."""
    if publish_dtype == "param":
        return
    wide = sorted({str(p.dtype) for p in model_params if p.requires_grad and p.dtype not in (torch.bfloat16, torch.float16)})
    if wide:
        raise ValueError(
            f"--dmuon-publish-dtype {publish_dtype} needs a --bf16 model (params here: {', '.join(wide)}): an fp32 "
            "param is its own optimizer master, which the FP8 decode would overwrite; add --bf16")


class _Masters:
    """{model param: its fp32 master shard} of the DMuon optimizers built on this DDP, read at
    publish time (checkpoint loads write the masters in place)."""

    def __init__(self):
        self.sources = []  # callables returning [(model_param, main_param)]

    def lookup(self) -> Dict[torch.Tensor, torch.Tensor]:
        return {m: s for source in self.sources for m, s in source()}


class _FP8PublishState:
    """One bucket group's FP8 publish: the packed-block layout and buffers of each bucket."""

    def __init__(self, bucket_group, plan, name_of: Dict[torch.Tensor, str], masters: _Masters):
        self.fp8 = fp8_dtype(plan.publish_dtype)
        self.masters = masters
        self.name_of = name_of
        self.pending = None
        self.last_scales = {}  # {matrix name: scale_inv (0-dim tensor) decoded in the last publish}
        world = bucket_group.intra_distributed_optimizer_instance_size
        self.layouts, self.blocks = [], []
        for bucket in bucket_group.buckets:
            params = []
            for p in bucket.params_list:
                start, end = bucket.param_to_index[p]
                params.append((start, end, plan.record(name_of[p]).use_muon, p))
            layout = plan_publish(bucket.param_data.numel(), world, params, bucket.param_data.element_size())
            self.layouts.append(layout)
            # the gathered blocks of every rank; this rank's block is a view of it (as Megatron's own)
            self.blocks.append(torch.zeros(layout.recv_bytes, dtype=torch.uint8, device=bucket.param_data.device))


class _FP8PublishBucketGroup:
    state_name = "owner_fp8"
    owner_fp8: _FP8PublishState

    def _pack(self, masters) -> None:
        me = self.intra_distributed_optimizer_instance_rank
        for bucket, layout, recv in zip(self.buckets, self.owner_fp8.layouts, self.owner_fp8.blocks):
            block = recv[slice(*shard_range(me, layout.block_bytes))]
            flat = bucket.param_data.view(-1)
            scales = block[:4 * sum(r.scale_slot >= 0 for r in layout.runs[me])].view(torch.float32)
            for run in layout.runs[me]:
                n = run.end - run.start
                if run.scale_slot < 0:
                    raw = flat[run.start:run.end].view(torch.uint8)
                    block[run.offset:run.offset + raw.numel()].copy_(raw)
                    continue
                master = masters.get(run.key)
                if master is None:
                    raise RuntimeError(
                        f"DMuon FP8 publish: no fp32 master for {self.owner_fp8.name_of[run.key]} on its owner; build the "
                        "optimizer with get_dmuon_optimizer(...) on this DDP before the first publish")
                q, scale_inv = quantize_per_tensor(master.view(-1), self.owner_fp8.fp8)
                block[run.offset:run.offset + n].copy_(q.view(torch.uint8))
                scales[run.scale_slot] = scale_inv

    def _unpack(self) -> None:
        for bucket, layout, recv in zip(self.buckets, self.owner_fp8.layouts, self.owner_fp8.blocks):
            flat = bucket.param_data.view(-1)
            for r, runs in enumerate(layout.runs):
                block = recv[slice(*shard_range(r, layout.block_bytes))]
                scales = block[:4 * sum(run.scale_slot >= 0 for run in runs)].view(torch.float32)
                for run in runs:
                    n = run.end - run.start
                    if run.scale_slot < 0:
                        nbytes = n * flat.element_size()
                        flat[run.start:run.end].copy_(block[run.offset:run.offset + nbytes].view(flat.dtype))
                        continue
                    q = block[run.offset:run.offset + n].view(self.owner_fp8.fp8)
                    scale_inv = scales[run.scale_slot]
                    flat[run.start:run.end].copy_(dequantize(q, scale_inv, flat.dtype))
                    # a view into the received block (no host sync); valid until the next publish
                    self.owner_fp8.last_scales[self.owner_fp8.name_of[run.key]] = scale_inv

    def start_param_sync(self, force_sync: bool = False):
        if force_sync and self.param_gather_handle is not None:
            return super().start_param_sync(force_sync=True)  # waits; _post_param_sync decodes
        assert self.param_gather_handle is None
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        with torch.no_grad():
            self._pack(self.owner_fp8.masters.lookup())
            me = self.intra_distributed_optimizer_instance_rank
            handles = []
            for layout, recv in zip(self.owner_fp8.layouts, self.owner_fp8.blocks):
                block = recv[slice(*shard_range(me, layout.block_bytes))]
                handles.append(torch.distributed.all_gather_into_tensor(
                    recv, block, group=self.intra_distributed_optimizer_instance_group, async_op=async_op))
        self.owner_fp8.pending = True
        self.param_gather_handle = HandleGroup(handles) if async_op else None
        if force_sync and self.ddp_config.overlap_param_gather:
            self._post_param_sync()
        self.param_gather_dispatched = True

    def _post_param_sync(self):
        if self.owner_fp8.pending:
            with torch.no_grad():
                self._unpack()
            self.owner_fp8.pending = None
        super()._post_param_sync()


def install_fp8_publish(ddp, plan) -> _Masters:
    """Extend every dense and expert bucket group of a DMuon DDP to FP8 publish (the plan's
    ``publish_dtype``; nothing for 'param'); returns the registry the optimizer fills with its
    fp32 masters (``register_masters``)."""
    masters = _Masters()
    if plan.publish_dtype != "param":
        name_of = ddp.param_names()
        extend_bucket_groups(ddp, _FP8PublishBucketGroup, lambda group: _FP8PublishState(group, plan, name_of, masters))
    return masters


def register_masters(ddp, pairs: Callable[[], list]) -> None:
    """The optimizer tells the publisher where the fp32 masters are (``pairs() -> [(model, main)]``)."""
    ddp.publish_masters.sources.append(pairs)


def publish_layouts(ddp) -> Dict[int, PublishLayout]:
    """{id(bucket): PublishLayout} of an FP8-publishing DDP (empty for the model-dtype publish)."""
    out = {}
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        state = getattr(bucket_group, "owner_fp8", None)
        for bucket, layout in zip(bucket_group.buckets, state.layouts if state is not None else ()):
            out[id(bucket)] = layout
    return out
