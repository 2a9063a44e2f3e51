"""`dmuon-check`: do all DP replicas hold identical parameters? (per-bucket checksums)

After every step each DP rank holds the whole model, published by the owners; a replica that
silently diverged (a missed publish after a resume, Megatron PR #6920; a rank-divergent update)
trains on a different model from then on. ``check_replicas`` checksums every parameter of every
bucket bit-exactly (integer sums over the raw bits, so the check itself is exact and
deterministic), gathers one small vector per bucket over the bucket's DP group and reports the
first parameter that differs, on every rank.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of the raw bits of ``t`` (a plain sum and a position-weighted sum)."""
    flat = t.detach().contiguous().view(-1)
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


@dataclasses.dataclass
class ReplicaReport:
    ok: bool
    buckets: int
    params: int
    first_mismatch: Optional[dict] = None

    def __str__(self) -> str:
        if self.ok:
            return f"all DP replicas hold identical parameters ({self.params} params in {self.buckets} buckets)"
        m = self.first_mismatch
        return (f"DP replicas differ: first mismatch in {m['buffer']} bucket {m['bucket']}, parameter {m['param']}: "
                f"DP ranks {m['ranks']} differ from DP rank 0 (checked {self.buckets} buckets)")


@torch.no_grad()
def check_replicas(model_chunks) -> ReplicaReport:
    """Collective over every buffer's DP group; the same report on every rank."""
    from .checkpoint import unwrap

    buckets = params = 0
    first = None
    for ci, chunk in enumerate(model_chunks):
        if chunk.ddp_config.overlap_param_gather:  # the last publish may still wait in a forward hook
            chunk.start_param_sync(force_sync=True)
        names = {p: n for n, p in unwrap(chunk).named_parameters()}
        for kind, buffers in (("dense", chunk.buffers), ("expert", chunk.expert_parallel_buffers)):
            for bi, buffer in enumerate(buffers):
                group = buffer.data_parallel_group
                for ki, bucket in enumerate(buffer.buckets):
                    plist = list(bucket.params_list)
                    mine = torch.stack([tensor_checksum(p) for p in plist])
                    everyone = [torch.empty_like(mine) for _ in range(group.size())]
                    torch.distributed.all_gather(everyone, mine, group=group)
                    buckets += 1
                    params += len(plist)
                    if first is not None:
                        continue
                    differs = [r for r in range(1, len(everyone)) if not torch.equal(everyone[r], everyone[0])]
                    if differs:
                        row = next(i for i in range(len(plist))
                                   if any(not torch.equal(everyone[r][i], everyone[0][i]) for r in differs))
                        first = {"chunk": ci, "buffer": f"chunk {ci} {kind} buffer {bi}", "bucket": ki,
                                 "param": names.get(plist[row], f"#{row}"), "ranks": differs}
    return ReplicaReport(first is None, buckets, params, first)
