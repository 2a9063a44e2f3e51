"""The owner step: Muon on the matrices this rank owns (batched by shape), AdamW elsewhere.

`OwnerMuonAdamW` is the *inner* optimizer of the DMuon DistributedOptimizer. Megatron hands it
1-D fp32 main-param shards; the owner-aligned layout guarantees that every Muon matrix arrives
whole on exactly one rank, so its shard can be viewed as the full matrix. Matrices (or split
pieces: QKV blocks, heads) of equal shape are stacked and orthogonalized in ONE batched NS call.
It subclasses torch.optim.AdamW so element-wise params take torch's exact AdamW code path.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from ..algorithms.muon import muon_lr_scale, muon_momentum_

NS_METHODS = ("standard", "gram", "auto")
ADAPTIVE_SCHEDULE = "adaptive"
# How the owner's per-shape NS calls are launched on CUDA: one after the other ('eager'), on
# concurrent streams ('streams'), or the whole set captured once as a CUDA graph and replayed
# every step ('graph': kills the launch overhead of many small matrices; the graph keeps its
# input/output buffers and memory pool alive, one graph per distinct set of stack shapes).
NS_LAUNCH_MODES = ("eager", "streams", "graph")


@dataclasses.dataclass
class MuonSettings:
    momentum: float = 0.95
    nesterov: bool = True
    ns_method: str = "standard"  # 'standard' | 'gram' | 'auto' (kernels' autotuned choice)
    # a set of algorithms.get_coefficients, or 'adaptive': per shape, the published 5-step Polar
    # Express, and the 6-step POLAR_EXPRESS_6 for (near-)square matrices (algorithms.schedules.schedule_for_shape:
    # error <= 0.10 vs the polar factor on every Qwen2.5-7B shape; ns_steps is then not used)
    coefficients: str = "keller"
    ns_steps: int = 5
    ns_dtype: torch.dtype = torch.bfloat16
    scale_mode: str = "spectral"  # 'spectral' | 'match_rms_adamw' | 'none'
    extra_scale: float = 1.0
    ns_launch: str = "eager"  # NS_LAUNCH_MODES; off CUDA every mode runs eagerly

    def validate(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"dmuon momentum must be in [0, 1), got {self.momentum}")
        if self.ns_method not in NS_METHODS:
            raise ValueError(f"dmuon ns_method {self.ns_method!r} unknown; valid: {NS_METHODS}")
        if self.ns_steps < 1:
            raise ValueError(f"dmuon ns_steps must be >= 1, got {self.ns_steps}")
        if self.ns_launch not in NS_LAUNCH_MODES:
            raise ValueError(f"dmuon ns_launch {self.ns_launch!r} unknown (--dmuon-ns-launch); valid: {NS_LAUNCH_MODES}")
        if self.ns_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"dmuon ns_dtype must be a float dtype, got {self.ns_dtype}")
        if self.coefficients == ADAPTIVE_SCHEDULE:
            if self.ns_steps != 5:
                raise ValueError(
                    f"dmuon coefficients 'adaptive' choose the step count per shape (5, or 6 for square "
                    f"matrices); ns_steps={self.ns_steps} would be ignored: leave --dmuon-ns-steps at 5"
                )
        else:
            from ..algorithms.coefficients import get_coefficients

            get_coefficients(self.coefficients, self.ns_steps)  # raises a clear error if unknown
        muon_lr_scale(2, 1, self.scale_mode)  # raises if the mode is unknown

    def ns_schedule(self, rows: int, cols: int) -> dict:
        """``{'coefficients', 'steps'}`` of the NS call for a [rows, cols] matrix."""
        if self.coefficients == ADAPTIVE_SCHEDULE:
            from ..algorithms.schedules import schedule_for_shape

            return schedule_for_shape(rows, cols)
        return {"coefficients": self.coefficients, "steps": self.ns_steps}


@dataclasses.dataclass
class MatrixInfo:
    name: str
    shape: Tuple[int, int]
    split: Optional[object] = None  # algorithms.splitting.SplitRule, or None = whole matrix


def default_orthogonalizer(settings: MuonSettings) -> Callable[[torch.Tensor], torch.Tensor]:
    """Batched NS over a [B, m, n] stack: the kernels' fast path on CUDA, else the torch path."""
    method = settings.ns_method

    def orth(stack: torch.Tensor) -> torch.Tensor:
        kw = dict(settings.ns_schedule(stack.size(-2), stack.size(-1)), compute_dtype=settings.ns_dtype)
        if stack.is_cuda:
            try:
                from ..kernels import orthogonalize_batched
            except ImportError:
                orthogonalize_batched = None
            if orthogonalize_batched is not None:
                return orthogonalize_batched(stack, method=method, **kw)
        from ..algorithms.newton_schulz import orthogonalize

        return orthogonalize(stack, method="standard" if method == "auto" else method, check_finite=False, **kw)

    return orth


class OwnerMuonAdamW(torch.optim.AdamW):
    """Param groups with ``use_muon=True`` get Muon; the others get torch's AdamW."""

    def __init__(self, params, *, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8,
                 muon: Optional[MuonSettings] = None, orthogonalizer=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.muon = muon or MuonSettings()
        self.muon.validate()
        if orthogonalizer is not None and self.muon.ns_launch != "eager":
            raise ValueError(
                f"dmuon ns_launch={self.muon.ns_launch!r} runs the kernels' own group launcher; it cannot "
                "wrap a custom orthogonalizer: pass ns_launch='eager' with it"
            )
        self.orthogonalizer = orthogonalizer or default_orthogonalizer(self.muon)
        self._graphs: Dict[tuple, object] = {}  # ns_launch='graph': one GraphedGroups per stack-shape set
        self.matrix_info: Dict[torch.Tensor, MatrixInfo] = {}
        self.stats = defaultdict(int)  # ns_matrices / ns_calls of the last step; ns_matrices_total

    def register_matrix(self, main_param: torch.Tensor, info: MatrixInfo) -> None:
        rows, cols = info.shape
        if main_param.numel() != rows * cols:
            raise RuntimeError(
                f"DMuon: rank holds {main_param.numel()} elements of matrix {info.name} "
                f"{tuple(info.shape)}; the owner-aligned layout must deliver whole matrices"
            )
        self.matrix_info[main_param] = info

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        all_groups = self.param_groups
        adam_groups = [g for g in all_groups if not g.get("use_muon", False)]
        try:
            self.param_groups = adam_groups
            if any(p.grad is not None for g in adam_groups for p in g["params"]):
                super().step()
        finally:
            self.param_groups = all_groups
        self._muon_step([g for g in all_groups if g.get("use_muon", False)])
        return loss

    def _muon_step(self, groups) -> None:
        s = self.muon
        self.stats["ns_calls"] = 0
        work = []  # (param, group, info, update pieces)
        for group in groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                info = self.matrix_info.get(p)
                if info is None:
                    raise RuntimeError("DMuon: a Muon param has no registered matrix shape")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                grad = p.grad.view(info.shape)
                buf = state["momentum_buffer"].view(info.shape)
                update = muon_momentum_(buf, grad, s.momentum, s.nesterov)
                pieces = info.split.pieces(update) if info.split is not None else [update]
                work.append((p, group, info, pieces))
        # one batched NS call per distinct piece shape
        by_shape: Dict[Tuple[int, int], List[Tuple[int, int, Optional[int]]]] = defaultdict(list)
        for wi, (_, _, _, pieces) in enumerate(work):
            for pi, piece in enumerate(pieces):
                if piece.dim() == 2:
                    by_shape[tuple(piece.shape)].append((wi, pi, None))
                else:
                    for k in range(piece.shape[0]):
                        by_shape[tuple(piece.shape[-2:])].append((wi, pi, k))
        results = [[None] * len(w[3]) for w in work]
        groups_refs = list(by_shape.values())

        def stack_of(refs):
            return torch.stack([work[wi][3][pi] if k is None else work[wi][3][pi][k] for wi, pi, k in refs])

        self.stats["ns_calls"] += len(groups_refs)
        on_cuda = bool(work) and work[0][0].is_cuda
        for refs, orth in zip(groups_refs, self._orthogonalize_all(groups_refs, stack_of, on_cuda)):
            for j, (wi, pi, k) in enumerate(refs):
                if k is None:
                    results[wi][pi] = orth[j]
                else:
                    if results[wi][pi] is None:
                        results[wi][pi] = torch.empty_like(work[wi][3][pi])
                    results[wi][pi][k] = orth[j]
        for wi, (p, group, info, pieces) in enumerate(work):
            lr, wd = group["lr"], group["weight_decay"]
            if info.split is None:
                scale = muon_lr_scale(*info.shape, mode=s.scale_mode, extra=s.extra_scale)
                update = results[wi][0].to(p.dtype)
            else:
                scaled = [r.to(p.dtype) * muon_lr_scale(*r.shape[-2:], mode=s.scale_mode, extra=s.extra_scale)
                          for r in results[wi]]
                like = self.state[p]["momentum_buffer"].view(info.shape)  # shape/device only
                update, scale = info.split.assemble(scaled, like=like), 1.0
            p.mul_(1 - lr * wd)
            p.add_(update.reshape(p.shape), alpha=-lr * scale)
        self.stats["ns_matrices"] = len(work)
        self.stats["ns_matrices_total"] += len(work)

    def _orthogonalize_all(self, groups_refs: list, stack_of, on_cuda: bool) -> Iterable[torch.Tensor]:
        """One NS result per same-shape group, launched as ``MuonSettings.ns_launch`` says.
        Eager stacks one group at a time (one input stack alive at once); streams and graph
        need every stack up front."""
        s = self.muon
        if s.ns_launch == "eager" or not on_cuda:
            return (self.orthogonalizer(stack_of(refs)) for refs in groups_refs)
        from ..kernels import GraphedGroups, orthogonalize_groups

        stacks = [stack_of(refs) for refs in groups_refs]
        per_stack = [s.ns_schedule(x.size(-2), x.size(-1)) for x in stacks]
        kw = dict(per_stack_kwargs=per_stack, compute_dtype=s.ns_dtype)
        if s.ns_launch == "streams":
            return orthogonalize_groups(stacks, s.ns_method, **kw)
        key = tuple((tuple(x.shape), x.dtype, str(x.device)) for x in stacks)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = GraphedGroups(stacks, s.ns_method, **kw)
        return graph(stacks)  # the graph's static outputs: consumed before the next step
