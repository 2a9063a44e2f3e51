"""`--dmuon-overlap-step`, Megatron's side: the hooks in Megatron's DDP bucket groups that finish
the owner's Newton–Schulz of each group when the next forward first needs that group's params (and,
under 'backward', start it behind the group's grad reduce). The step itself, cut per need group, is
runtime/overlapped_step.py.

The order the forward needs params in is the order of Megatron's param all-gather chain: a chunk's
bucket groups last to first (buckets are built in backward order), chunk by chunk. Every Muon
matrix gets its group's place (``MatrixInfo.need``), so the owner step cuts its stacks per group
and launches them in that order (runtime/overlapped_step.py). The bucket group's
``start_param_sync`` (called by the forward pre-hook under ``--overlap-param-gather``, by the
optimizer step without it, and with ``force_sync`` whenever Megatron needs every param: hooks
disabled for evaluation or a checkpoint) first finishes the group on every owner part: wait for its
NS, apply it to the fp32 masters, copy them into the model's param buffer; only then does
Megatron's all-gather publish them. Megatron's own copy in the step skips the masters in flight.
"""
from __future__ import annotations

from typing import Dict

import torch

from .bucket_groups import extend_bucket_groups


def need_order(model_chunks) -> Dict[torch.nn.Parameter, int]:
    """{model param: the place of its bucket group in the next forward}: chunk by chunk, each
    chunk's dense then expert bucket groups last to first (Megatron's param all-gather chain)."""
    order, need = {}, 0
    for chunk in model_chunks:
        for groups in (chunk.bucket_groups, chunk.expert_parallel_bucket_groups):
            for bucket_group in reversed(groups):
                for bucket in bucket_group.buckets:
                    for p in bucket.params_list:
                        order[p] = need
                need += 1
    return order


class _OverlapStepState:
    """The (owner step, need) pairs a bucket group's params wait for, and under 'backward' the
    (owner part, need) pairs its grad reduce starts."""

    def __init__(self):
        self.waits = []
        self.starts = []


class _OverlapStepBucketGroup:
    state_name = "owner_step"
    owner_step: _OverlapStepState

    def start_param_sync(self, force_sync: bool = False):
        for inner, need in self.owner_step.waits:
            inner.finish_need_group(need)
        return super().start_param_sync(force_sync=force_sync)

    def start_grad_sync(self, force_all_reduce=False):
        """'backward': Megatron launches this group's grad reduce (in the last micro-batch's
        backward, once all its grads are ready); the owners start its Muon work behind it."""
        out = super().start_grad_sync(force_all_reduce=force_all_reduce)
        for part, need in self.owner_step.starts:
            part.launch_early(need, self.grad_reduce_handle)
        return out


def install_overlap_step(model_chunks, parts, infos: dict) -> None:
    """Connect every owner part to the bucket groups of its matrices: the group's param sync
    finishes them; the part copies the masters of a finished group into the model's params."""
    for chunk in model_chunks:
        extend_bucket_groups(chunk, _OverlapStepBucketGroup, lambda group: _OverlapStepState())
    if any(part.optimizer.overlap_mode.starts_in_backward for part in parts) and any(
            getattr(bucket, "params_with_extra_main_grads", None) for chunk in model_chunks
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups for bucket in group.buckets):
        raise ValueError("--dmuon-overlap-step backward reads each group's reduced grads in the grad buffer; params "
                         "that accumulate grads in a separate higher-precision main_grad get theirs copied back "
                         "only at the step: use --dmuon-overlap-step on")
    for part in parts:
        inner = part.optimizer
        inner.on_applied = part.copy_applied_masters
        # the split layout: every rank takes part in every group's exchange (it may home or forward
        # pieces of matrices it holds none of), so every split matrix's group waits on every rank
        split = [m for m, info in infos.items() if info.name in inner.split_matrices]
        for model_param in dict.fromkeys(part.model_params() + split):
            info = infos.get(model_param)
            if info is None:
                continue
            chunk = next(c for c in model_chunks if model_param in c.param_to_bucket_group)
            state = chunk.param_to_bucket_group[model_param].owner_step
            if (inner, info.need) not in state.waits:
                state.waits.append((inner, info.need))
            if inner.overlap_mode.starts_in_backward and (part, info.need) not in state.starts:
                state.starts.append((part, info.need))


def finish_parts(parts) -> None:
    """Every part's groups in flight, finished (before anything reads the masters or params)."""
    for part in parts:
        part.optimizer.finish_overlapped()
