"""Run DMuon on N gloo ranks and its single-process reference; compare them (tests and `dmuon verify`)."""
from __future__ import annotations

from typing import Dict, List

import torch

from .global_params import merge_ranks
from .multiproc import run_distributed

WORKERS = "megatron_dmuon.testing.workers"


def run_dmuon(world_size: int, **kw) -> List[dict]:
    return run_distributed(f"{WORKERS}:dmuon_train", world_size, kwargs=kw)


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1, **_) -> int:
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not a multiple of tp x pp = {tp * pp}")
    return world_size // (tp * pp)


def run_reference(dp: int, layouts=None, **kw) -> dict:
    return run_distributed(f"{WORKERS}:reference", 1, kwargs=dict(dp=dp, layouts=layouts, **kw))[0]


def full_params(results: List[dict]) -> Dict[str, torch.Tensor]:
    """Every parameter of the whole model, merged from all ranks' TP shards, PP stages and EP
    experts (raises if two DP replicas differ)."""
    return merge_ranks([r["shards"] for r in results])


def rel_diffs(params: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Per tensor ||a - b|| / ||b||."""
    if set(params) != set(ref):
        raise AssertionError(f"parameter names differ: {sorted(set(params) ^ set(ref))[:6]}")
    return {n: float((params[n].double().cpu() - p.double().cpu()).norm() / p.double().norm().clamp(min=1e-300))
            for n, p in ref.items()}


def merge_reduced_grads(results: List[dict], shapes: Dict[str, torch.Size]) -> List[Dict[str, torch.Tensor]]:
    """Full reduced gradients per step from every rank's ``reduced_grads`` pieces; raises if the
    pieces do not cover a parameter exactly once."""
    steps = len(results[0]["reduced_grads"])
    out = []
    for step in range(steps):
        full = {n: torch.full((int(torch.Size(s).numel()),), float("nan"), dtype=torch.float64) for n, s in shapes.items()}
        covered = {n: 0 for n in shapes}
        for r in results:
            for name, pieces in r["reduced_grads"][step].items():
                for start, end, values in pieces:
                    full[name][start:end] = values.double()
                    covered[name] += end - start
        for n, s in shapes.items():
            if covered[n] != int(torch.Size(s).numel()):
                raise AssertionError(f"step {step}: reduced grad of {n} covered {covered[n]} of {torch.Size(s).numel()} elements")
        out.append({n: v.view(shapes[n]) for n, v in full.items()})
    return out
