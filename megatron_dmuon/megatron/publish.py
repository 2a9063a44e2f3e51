"""FP8 publish on Megatron's own param all-gather (`--dmuon-publish-dtype fp8_e4m3|fp8_e5m2`).

Megatron's `_ParamAndGradBucketGroup.start_param_sync` all-gathers each bucket's `param_data` in
the model's dtype. The subclass below (swapped onto DDP's bucket groups, as megatron/hierarchy.py
does for two-level groups) sends one packed byte block per rank and bucket instead
(planning/fp8_blocks.py): every Muon matrix as FP8 bytes quantized by its owner from the fp32
master with a per-tensor scale (algorithms/fp8.py), plus that scale; the rest in the model's dtype.
Every rank, the owner included, decodes the gathered block into `param_data` in
`_post_param_sync`, which Megatron calls after the collective on every path: synchronous (the
optimizer step), overlapped (the forward pre-hook's `finish_param_sync`) and forced (hook
disable, checkpoint load). The forward therefore sees the owner's quantized values on every rank.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from ..algorithms.fp8 import dequantize, fp8_dtype, quantize_per_tensor
from ..planning.params import is_muon_param
from ..planning.fp8_blocks import PublishLayout, plan_publish
from .hierarchy import HandleGroup

PUBLISH_DTYPES = ("param", "fp8_e4m3", "fp8_e5m2")


def check_publish_config(publish_dtype: str, model_params, ranks_per_node: int = 0) -> None:
    """Start-up checks of --dmuon-publish-dtype (before any buffer exists)."""
    if publish_dtype not in PUBLISH_DTYPES:
        raise ValueError(f"--dmuon-publish-dtype {publish_dtype!r} unknown; valid: {', '.join(PUBLISH_DTYPES)}")
    if publish_dtype == "param":
        return
    if ranks_per_node:
        raise ValueError(f"--dmuon-publish-dtype {publish_dtype} is not implemented with the two-level publish: "
                         "drop --dmuon-ranks-per-node or use --dmuon-publish-dtype param")
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


def make_fp8_publish(bucket_group, publish_dtype: str, name_of: Dict[torch.Tensor, str], masters: _Masters) -> None:
    """Turn one of DDP's (distributed-optimizer) bucket groups into an FP8-publishing one."""
    if isinstance(bucket_group, _FP8PublishBucketGroup):
        return
    base = type(bucket_group)
    bucket_group.__class__ = type("FP8Publish" + base.__name__, (_FP8PublishBucketGroup, base), {})
    bucket_group.dmuon_fp8 = fp8_dtype(publish_dtype)
    bucket_group.dmuon_masters = masters
    bucket_group.dmuon_pending = None
    bucket_group.dmuon_last_scales = {}  # {matrix name: scale_inv (0-dim tensor) decoded in the last publish}
    world = bucket_group.intra_distributed_optimizer_instance_size
    bucket_group.dmuon_layouts, bucket_group.dmuon_blocks = [], []
    for bucket in bucket_group.buckets:
        params = []
        for p in bucket.params_list:
            start, end = bucket.param_to_index[p]
            params.append((start, end, is_muon_param(name_of[p], p), p))
        layout = plan_publish(bucket.param_data.numel(), world, params, bucket.param_data.element_size())
        bucket_group.dmuon_layouts.append(layout)
        # the gathered blocks of every rank; this rank's block is a view of it (as Megatron's own)
        bucket_group.dmuon_blocks.append(torch.zeros(layout.recv_bytes, dtype=torch.uint8,
                                                     device=bucket.param_data.device))
    bucket_group.dmuon_name_of = name_of


class _FP8PublishBucketGroup:
    dmuon_layouts: list
    dmuon_blocks: list
    dmuon_fp8: torch.dtype
    dmuon_masters: _Masters
    dmuon_pending: Optional[list]

    def _dmuon_pack(self, masters) -> None:
        me = self.intra_distributed_optimizer_instance_rank
        for bucket, layout, recv in zip(self.buckets, self.dmuon_layouts, self.dmuon_blocks):
            block = recv[me * layout.block_bytes:(me + 1) * layout.block_bytes]
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
                        f"DMuon FP8 publish: no fp32 master for {self.dmuon_name_of[run.key]} on its owner; build the "
                        "optimizer with get_dmuon_optimizer(...) on this DDP before the first publish")
                q, scale_inv = quantize_per_tensor(master.view(-1), self.dmuon_fp8)
                block[run.offset:run.offset + n].copy_(q.view(torch.uint8))
                scales[run.scale_slot] = scale_inv

    def _dmuon_unpack(self) -> None:
        for bucket, layout, recv in zip(self.buckets, self.dmuon_layouts, self.dmuon_blocks):
            flat = bucket.param_data.view(-1)
            for r, runs in enumerate(layout.runs):
                block = recv[r * layout.block_bytes:(r + 1) * layout.block_bytes]
                scales = block[:4 * sum(run.scale_slot >= 0 for run in runs)].view(torch.float32)
                for run in runs:
                    n = run.end - run.start
                    if run.scale_slot < 0:
                        nbytes = n * flat.element_size()
                        flat[run.start:run.end].copy_(block[run.offset:run.offset + nbytes].view(flat.dtype))
                        continue
                    q = block[run.offset:run.offset + n].view(self.dmuon_fp8)
                    scale_inv = scales[run.scale_slot]
                    flat[run.start:run.end].copy_(dequantize(q, scale_inv, flat.dtype))
                    # a view into the received block (no host sync); valid until the next publish
                    self.dmuon_last_scales[self.dmuon_name_of[run.key]] = scale_inv

    def start_param_sync(self, force_sync: bool = False):
        if force_sync and self.param_gather_handle is not None:
            return super().start_param_sync(force_sync=True)  # waits; _post_param_sync decodes
        assert self.param_gather_handle is None
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        with torch.no_grad():
            self._dmuon_pack(self.dmuon_masters.lookup())
            me = self.intra_distributed_optimizer_instance_rank
            handles = []
            for layout, recv in zip(self.dmuon_layouts, self.dmuon_blocks):
                block = recv[me * layout.block_bytes:(me + 1) * layout.block_bytes]
                handles.append(torch.distributed.all_gather_into_tensor(
                    recv, block, group=self.intra_distributed_optimizer_instance_group, async_op=async_op))
        self.dmuon_pending = True
        self.param_gather_handle = HandleGroup(handles) if async_op else None
        if force_sync and self.ddp_config.overlap_param_gather:
            self._post_param_sync()
        self.param_gather_dispatched = True

    def _post_param_sync(self):
        if self.dmuon_pending:
            with torch.no_grad():
                self._dmuon_unpack()
            self.dmuon_pending = None
        super()._post_param_sync()


def install_fp8_publish(ddp, publish_dtype: str) -> None:
    """Swap every dense and expert bucket group of a DMuon DDP to FP8 publish."""
    ddp.dmuon_publish_dtype = publish_dtype
    ddp.dmuon_masters = _Masters()
    if publish_dtype == "param":
        return
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        make_fp8_publish(bucket_group, publish_dtype, ddp.dmuon_param_names, ddp.dmuon_masters)


def register_masters(ddp, pairs: Callable[[], list]) -> None:
    """The optimizer tells the publisher where the fp32 masters are (``pairs() -> [(model, main)]``)."""
    ddp.dmuon_masters.sources.append(pairs)


def publish_layouts(ddp) -> Dict[int, PublishLayout]:
    """{id(bucket): PublishLayout} of an FP8-publishing DDP (empty for the model-dtype publish)."""
    out = {}
    for bucket_group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for bucket, layout in zip(bucket_group.buckets, getattr(bucket_group, "dmuon_layouts", ())):
            out[id(bucket)] = layout
    return out
