"""Single-process reference for DMuon: plain PyTorch autograd on the same megatron-core GPT,
the full (global) batch, and the pure update rules from `algorithms` — no DDP, no sharding,
no batching. Distributed runs must reproduce it.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch

from ..algorithms.adamw import adamw_step_
from ..algorithms.dion3 import piece_rows, row_direction, select_rows_
from ..algorithms.muon import muon_apply_, muon_direction, muon_momentum_
from ..algorithms.ns_dispatch import method_compute_dtype, orthogonalize
from ..algorithms.update_rule import UpdateRule
from ..planning.ns_choice import torch_path_method
from ..megatron.gpt import causal_batch
from ..planning.params import param_routing


def _grad_dtype(param: torch.Tensor) -> torch.dtype:
    """Megatron reduces grads in fp32 (grad_reduce_in_fp32), or in float64 for float64 models."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def orthogonalize_one(matrix: torch.Tensor, settings) -> torch.Tensor:
    """NS of one matrix with the settings' method and per-shape schedule (torch path)."""
    method = torch_path_method(settings.ns_method)
    return orthogonalize(matrix, method=method, **settings.ns_schedule(*matrix.shape[-2:]),
                         compute_dtype=method_compute_dtype(method, settings.ns_dtype), check_finite=False)


def is_muon_param(name: str, param: torch.Tensor) -> bool:
    """Whether Muon takes this model parameter (``planning.params.param_routing``, the package's one rule)."""
    return param_routing(name, param)[0]


def row_step_(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, variance: torch.Tensor, *, rule: str,
              lr: float, beta: float, beta2: float = 0.95, fraction: float = 1.0, weight_decay: float = 0.0, split=None,
              nesterov: bool = False, scale_mode: str = "shape_scaling", extra_scale: float = 1.0,
              fraction_lr: str = "none", orthogonalize_fn=None) -> None:
    """One NorMuon / Dion3 step of one matrix, one NS call per piece (a per-head stack: per head).
    ``orthogonalize_fn`` maps one ``[k, n]`` matrix to its NS output (default: standard NS). The
    rule's three stages (algorithms/dion3.py) composed for one matrix, as the reference runs them."""
    orth = orthogonalize_fn or (lambda m: orthogonalize(m, method="standard"))
    selections = select_rows_(momentum, grad, piece_rows(split, param.size(-2), param.device), rule=rule,
                              beta=beta, nesterov=nesterov, fraction=fraction)
    outs = [orth(s.values) if s.values.dim() == 2 else torch.stack([orth(h) for h in s.values]) for s in selections]
    direction, scale = row_direction(outs, selections, variance, shape=param.shape, beta2=beta2,
                                     scale_mode=scale_mode, extra_scale=extra_scale, fraction=fraction,
                                     fraction_lr=fraction_lr, dtype=param.dtype)
    muon_apply_(param, direction, lr, weight_decay, scale)


def param_weight_decay(name: str, param: torch.Tensor, wd: float) -> float:
    """Megatron's standard override: no weight decay on biases and 1-D params."""
    return 0.0 if (param.dim() == 1 or name.endswith(".bias")) else wd


def gloo_ring_order(chunk: int, world_size: int) -> List[int]:
    """Order in which gloo's reduce_scatter adds the ranks' values for output shard `chunk`
    (measured on torch 2.13: x[c-1] + x[c-2] + ... + x[c+1], then x[c] last)."""
    return [(chunk - k) % world_size for k in range(1, world_size)] + [chunk]


def _sum_over_ranks(values: List[torch.Tensor], chunk_of: Optional[torch.Tensor],
                    ranks_per_node: int = 0) -> torch.Tensor:
    d = len(values)
    if ranks_per_node:
        # two-level reduce: node partial sums, then across nodes (exact order for L, N <= 2,
        # where every stage adds two values)
        nodes = [_sum_over_ranks(values[k:k + ranks_per_node], None) for k in range(0, d, ranks_per_node)]
        return _sum_over_ranks(nodes, None)
    if chunk_of is None or d <= 2:
        out = values[0]
        for v in values[1:]:
            out = out + v
        return out
    flat = [v.reshape(-1) for v in values]
    out = torch.empty_like(flat[0])
    for c in range(d):
        mask = chunk_of.reshape(-1) == c
        if not bool(mask.any()):
            continue
        order = gloo_ring_order(c, d)
        acc = flat[order[0]][mask]
        for r in order[1:]:
            acc = acc + flat[r][mask]
        out[mask] = acc
    return out.view_as(values[0])


def reduce_chunks_from_layout(owner_layouts, named_shapes: Dict[str, torch.Size]) -> Dict[str, torch.Tensor]:
    """Per-element reduce-scatter shard index of every param, from DMuon's OwnerLayouts."""
    out = {}
    for layout in owner_layouts:
        for name, (start, end, b) in layout.param_ranges.items():
            bucket = layout.buckets[b]
            idx = torch.arange(start, end) - bucket.start
            out[name] = (idx // bucket.shard_size).view(named_shapes[name])
    return out


class ProjectRules:
    """The update through the project's rule functions (``algorithms``): the same functions the
    owner step calls, but one matrix at a time, unbatched, on the unsharded model."""

    def __init__(self, named, *, lr, weight_decay, adam_betas=(0.9, 0.999), adam_eps=1e-8,
                 muon_settings=None, split_rule_for: Optional[Callable] = None):
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, adam_betas, adam_eps
        self.s, self.split_rule_for = muon_settings, split_rule_for
        self.state: Dict[str, dict] = {n: {} for n, _ in named}

    @torch.no_grad()
    def step(self, named, grads) -> None:
        s, lr = self.s, self.lr
        for n, p in named:
            g, st = grads[n], self.state[n]
            wd = param_weight_decay(n, p, self.weight_decay)
            if is_muon_param(n, p) and UpdateRule(getattr(s, "update", UpdateRule().name)).by_rows:
                self._row_rule_step(n, p, g, st, wd)
            elif is_muon_param(n, p):
                st.setdefault("momentum", torch.zeros_like(p))
                update = muon_momentum_(st["momentum"], g, s.momentum, s.nesterov)
                rule = self.split_rule_for(n, tuple(p.shape)) if self.split_rule_for is not None else None
                pieces = rule.pieces(update) if rule is not None else [update]
                # one NS call per matrix (every head of a per-head stack alone): no batching
                outs = [orthogonalize_one(m, s) if m.dim() == 2 else torch.stack([orthogonalize_one(h, s) for h in m])
                        for m in pieces]
                direction, scale = muon_direction(outs, rule, shape=p.shape, scale_mode=s.scale_mode,
                                                  extra_scale=s.extra_scale, dtype=p.dtype)
                muon_apply_(p, direction, lr, wd, scale)
            else:
                st.setdefault("exp_avg", torch.zeros_like(p))
                st.setdefault("exp_avg_sq", torch.zeros_like(p))
                st["step"] = st.get("step", 0) + 1
                adamw_step_(p, g, st["exp_avg"], st["exp_avg_sq"], st["step"], lr=lr,
                            beta1=self.betas[0], beta2=self.betas[1], eps=self.eps, weight_decay=wd)


    def _row_rule_step(self, n, p, g, st, wd) -> None:
        """NorMuon / Dion3 of one matrix through ``row_step_``: one NS call per piece (per head)."""
        s = self.s
        row_step_(p, g, st.setdefault("momentum", torch.zeros_like(p)),
                  st.setdefault("row_variance", p.new_zeros(p.shape[0])), rule=s.update, lr=self.lr, beta=s.momentum,
                  beta2=s.row_beta2, fraction=s.fraction, weight_decay=wd, nesterov=s.nesterov,
                  split=self.split_rule_for(n, tuple(p.shape)) if self.split_rule_for is not None else None,
                  scale_mode=s.scale_mode, extra_scale=s.extra_scale, fraction_lr=s.fraction_lr,
                  orthogonalize_fn=lambda m: orthogonalize_one(m, s))


class TorchOptimRules:
    """The update through ``torch.optim.Muon`` (hidden matrices) + ``torch.optim.AdamW`` (the rest),
    with Megatron's no-weight-decay rule for biases and vectors: shares no code with the project.
    torch.optim.Muon runs Keller's 5-step NS in bf16 with ``adjust_lr_fn='original'``."""

    def __init__(self, named, *, lr, weight_decay, adam_betas=(0.9, 0.999), adam_eps=1e-8,
                 momentum=0.95, nesterov=True, adjust_lr_fn="original"):
        muon = [p for n, p in named if is_muon_param(n, p)]
        decay = [p for n, p in named if not is_muon_param(n, p) and param_weight_decay(n, p, 1.0)]
        no_decay = [p for n, p in named if not is_muon_param(n, p) and not param_weight_decay(n, p, 1.0)]
        self.optimizers = [torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                            nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)]
        adam_groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.optimizers.append(torch.optim.AdamW(adam_groups, lr=lr, betas=adam_betas, eps=adam_eps))

    @torch.no_grad()
    def step(self, named, grads) -> None:
        for n, p in named:
            p.grad = grads[n].to(p.dtype)
        for opt in self.optimizers:
            opt.step()


def reference_train(model, batches_per_step: Callable[[int], List[torch.Tensor]], steps: int, *,
                    lr: float, weight_decay: float, adam_betas=(0.9, 0.999), adam_eps=1e-8,
                    clip_grad: float = 0.0, muon_settings=None,
                    reduce_chunk_of: Optional[Dict[str, torch.Tensor]] = None,
                    ranks_per_node: int = 0, split_rule_for: Optional[Callable] = None,
                    rules: str = "project", replay_grads: Optional[List[Dict[str, torch.Tensor]]] = None,
                    after_step: Optional[Callable[[int, Dict[str, torch.Tensor]], None]] = None,
                    ) -> Dict[str, object]:
    """`batches_per_step(step)` returns the global batch as [dp rank][micro-batch] token blocks.

    `reduce_chunk_of[name]` (optional) gives, per element, the reduce-scatter shard it lands in;
    the cross-rank sum then follows gloo's ring order for that shard, so fp32 results can be
    compared bit-for-bit. Without it ranks are summed in rank order. `rules`: 'project'
    (ProjectRules) or 'torch_optim' (TorchOptimRules; Muon settings then are torch's defaults).

    `replay_grads[step][name]` (the replay oracle): step with the distributed run's reduced
    gradients instead of this run's own sums; the largest relative gap between the two is
    returned as `max_grad_gap`. Summation-order rounding then cannot fail the parameter check
    (which stays bitwise), while a wrong reduction still shows as a large gap.

    `after_step(step, params by name)`: called after each update (e.g. a QK-clip of the weights).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = named[0][1].device
    if rules == "project":
        updater = ProjectRules(named, lr=lr, weight_decay=weight_decay, adam_betas=adam_betas, adam_eps=adam_eps,
                               muon_settings=muon_settings, split_rule_for=split_rule_for)
    elif rules == "torch_optim":
        updater = TorchOptimRules(named, lr=lr, weight_decay=weight_decay, adam_betas=adam_betas, adam_eps=adam_eps)
    else:
        raise ValueError(f"rules must be 'project' or 'torch_optim', got {rules!r}")
    losses, grad_norms, grad_gap = [], [], 0.0
    for step in range(steps):
        for _, p in named:
            p.grad = None
        per_rank = batches_per_step(step)  # [dp][grad_accum] micro-batches
        dp = len(per_rank)
        total_loss, n_micro = 0.0, 0
        rank_grads = []
        # Same float order as Megatron DDP: each rank accumulates loss/num_micro grads in fp32,
        # scales by 1/dp, then the ranks' grads are summed in rank order.
        for rank_micro in per_rank:
            for _, p in named:
                p.grad = None
            for tokens in rank_micro:
                batch = causal_batch(tokens.to(device))
                loss_mask = batch.pop("loss_mask")
                out = model(**batch)
                out = out if out.dtype == torch.float64 else out.float()
                loss = (out.view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum().clamp(min=1)
                (loss / len(rank_micro)).backward()
                total_loss += loss.item()
                n_micro += 1
            rank_grads.append({n: p.grad.detach().to(_grad_dtype(p)) * (1.0 / dp) for n, p in named})
        grads = {n: _sum_over_ranks([g[n] for g in rank_grads], None if reduce_chunk_of is None
                                    else reduce_chunk_of[n], ranks_per_node) for n, _ in named}
        if replay_grads is not None:
            replayed = {n: replay_grads[step][n].view_as(grads[n]).to(device=grads[n].device, dtype=grads[n].dtype)
                        for n, _ in named}
            grad_gap = max([grad_gap] + [float((replayed[n] - grads[n]).norm() / grads[n].norm().clamp(min=1e-30))
                                         for n, _ in named])
            grads = replayed
        losses.append(total_loss / n_micro)
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        grad_norms.append(norm)
        if clip_grad > 0:
            coeff = clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                grads = {n: g * coeff for n, g in grads.items()}
        updater.step(named, grads)
        if after_step is not None:
            with torch.no_grad():
                after_step(step, dict(named))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},  # frozen too
            "grad_norms": grad_norms,
            "max_grad_gap": grad_gap}
