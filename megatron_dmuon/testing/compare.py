"""Run DMuon on N gloo ranks and its single-process reference; compare them (tests and `dmuon-verify`)."""
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


REFERENCE = f"{WORKERS}:reference"


def reference_kwargs(dp: int, layouts=None, **kw) -> dict:
    return dict(dp=dp, layouts=layouts, **kw)


def run_reference(dp: int, layouts=None, **kw) -> dict:
    return run_distributed(REFERENCE, 1, kwargs=reference_kwargs(dp, layouts, **kw))[0]


def every_layout(results: List[dict]) -> List[str]:
    """The owner layouts of every pipeline stage and model chunk (each once), under global names:
    the reference then sums every param's DP replicas in its reduce-scatter's order."""
    return sorted({text for r in results for text in r["layouts"]})


def orthogonalized_once(results: List[dict], num_matrices: int, steps: int) -> bool:
    """Every Muon matrix orthogonalized exactly once per step: the world's count is the model's
    matrix count each step, every rank counted what its plans give it, and those sets of global
    names split the model's matrices with no name twice."""
    counted = results[0]["ns_counts"] == [num_matrices] * steps
    per_rank = all(r["local_ns_counts"] == [len(r["ns_owned"])] * steps for r in results)
    names = [n for r in results for n in r["ns_owned"]]
    return counted and per_rank and len(names) == len(set(names)) == num_matrices


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


def full_optimizer_state(results: List[dict]) -> Dict[str, Dict[str, torch.Tensor]]:
    """{global name: {state key: full tensor}} merged from every rank's optimizer pieces (DP slices,
    TP shards, PP stages, EP experts); raises if two holders of one element disagree."""
    from ..algorithms.tp_shards import merge_tp_shards

    flat: Dict[str, Dict[int, dict]] = {}
    for result in results:
        for name, pieces in result["optimizer_state"].items():
            for piece in pieces:
                by_tp = flat.setdefault(name, {})
                slot = by_tp.setdefault(piece["tp_rank"], {"meta": piece, "state": {}, "seen": {}})
                for key, t in piece["state"].items():
                    if key in ("step", "row_variance"):  # one per param / one per matrix row: whole
                        prev = slot["state"].get(key)
                        if prev is not None and not torch.equal(prev, t):
                            raise AssertionError(f"optimizer state {key} of {name} differs between ranks")
                        slot["state"][key] = t
                        continue
                    full = slot["state"].setdefault(key, torch.full((piece["numel"],), float("nan"), dtype=t.dtype))
                    seen = slot["seen"].setdefault(key, torch.zeros(piece["numel"], dtype=torch.bool))
                    part = full[piece["start"]:piece["end"]]
                    overlap = seen[piece["start"]:piece["end"]]
                    if overlap.any() and not torch.equal(part[overlap], t[overlap]):
                        raise AssertionError(f"optimizer state {key} of {name}: replicas differ")
                    part.copy_(t)
                    overlap.fill_(True)
    out = {}
    for name, by_tp in flat.items():
        first = by_tp[min(by_tp)]["meta"]
        keys = set.intersection(*(set(v["state"]) for v in by_tp.values()))
        out[name] = {}
        for key in keys:
            if key in ("step", "row_variance"):
                out[name][key] = by_tp[min(by_tp)]["state"][key]
                continue
            shards = [by_tp[r]["state"][key].view(by_tp[r]["meta"]["shape"]) for r in sorted(by_tp)]
            if first["tp_size"] == 1 or len(shards) == 1:
                out[name][key] = shards[0]
            else:
                out[name][key] = merge_tp_shards(shards, first["partition_dim"], first["stride"])
    return out


def state_diffs(a: Dict[str, Dict[str, torch.Tensor]], b: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Per (tensor, state key) ||a - b|| / ||b|| (0.0 when bit-identical); raises if the keys differ."""
    keys_a = {(n, k) for n, s in a.items() for k in s}
    keys_b = {(n, k) for n, s in b.items() for k in s}
    if keys_a != keys_b:
        raise AssertionError(f"optimizer state keys differ: {sorted(keys_a ^ keys_b)[:6]}")
    out = {}
    for n, k in sorted(keys_b):
        x, y = a[n][k].double(), b[n][k].double()
        out[f"{n}:{k}"] = 0.0 if torch.equal(x, y) else float((x - y).norm() / y.norm().clamp(min=1e-300))
    return out


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
