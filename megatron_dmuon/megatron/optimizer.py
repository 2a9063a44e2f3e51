"""`--optimizer dmuon` for megatron-core: owner-centric distributed Muon on Megatron's own buffers.

Data path per step: grads accumulate in DDP's owner-aligned buffers -> reduce-scatter (= reduce to
the owner, whole matrices) -> the owner runs Muon with batched NS on what it owns, AdamW on its
element-wise shard -> Megatron's param all-gather publishes (overlapped with the next forward
when overlap_param_gather is on). Grad-norm, clipping, zero counting and the lr/wd schedule are
Megatron's own (we only swap the inner optimizer and the layout).

``get_dmuon_optimizer`` hands each `--dmuon-mode` to its builder (owner_optimizer.py: `dmuon`;
baselines.py: `megatron_layerwise`, `gather_then_compute`); ``DMuonChainedOptimizer`` chains the
parts and holds what concerns the whole step: the non-finite guard (step_guards.py), clipping
folded into the owner step, the NS check's report and the checkpoint entry points.
"""
from __future__ import annotations

import copy
import math
from typing import List, Optional

import torch

from ..kernels.metrics import NONFINITE_METRICS
from ..planning.split_layout import exchange_bytes_sent, narrow_directions
from ..runtime.dp_exchange import node_of_dp_ranks
from .baselines import build_gather_then_compute_parts, build_megatron_layerwise
from .config_checks import check_dmuon_config, check_model_parallel_config  # noqa: F401 (public API)
from .config import MODES, DMuonConfig  # noqa: F401 (MODES: public API)
from .checkpoint import OwnerCheckpoints
from .overlap_hooks import finish_parts
from .owner_optimizer import DMuonDistributedOptimizer, build_owner_parts
from .publish import publish_layouts
from .step_guards import found_nonfinite, report_ns_check


def _chained(build_parts):
    """A builder of DMuonChainedOptimizer over the parts ``build_parts`` makes."""
    def build(config, model_chunks, cfg):
        return DMuonChainedOptimizer(build_parts(config, model_chunks, cfg),
                                     skip_nonfinite=cfg.skip_nonfinite, fold_clipping=cfg.fold_clipping)
    return build


# what the owner step takes from the plan (split pieces, NS and TP method per matrix): a config given
# to the optimizer must agree with the DDP's on these (layout options concern the DDP alone)
OPTIMIZER_PLAN_KEYS = ("mode", "split", "ns_method", "tp_method", "ns_steps", "coefficients")


def _planned_config(model_chunks, cfg: Optional[DMuonConfig]) -> DMuonConfig:
    """The DMuonConfig the chunks' plans were made from; a ``cfg`` given as well must agree on
    everything the plan decided (one config per run: pass it to build_dmuon_ddp(dmuon=...))."""
    plans = [getattr(chunk, "dmuon_plan", None) for chunk in model_chunks]
    if any(p is None for p in plans):
        return cfg or DMuonConfig()  # check_owner_aligned names the fix (gather_then_compute: plain DDP)
    planned = plans[0].config
    if cfg is None:
        return planned
    for plan in plans:
        if plan.publish_dtype != cfg.publish_dtype:
            raise ValueError(
                f"--dmuon-publish-dtype: the DDP was built with publish_dtype={plan.publish_dtype!r} but the "
                f"optimizer's DMuonConfig says {cfg.publish_dtype!r}; pass the same value to build_dmuon_ddp "
                "(build_dmuon_ddp(..., dmuon=config) with the optimizer's config)")
        differ = sorted(k for k, v in cfg.plan_summary().items()
                        if k in OPTIMIZER_PLAN_KEYS and plan.settings.get(k) != v)
        if differ:
            raise ValueError(
                f"DMuon: the optimizer's DMuonConfig differs from the one the DDP planned with in {', '.join(differ)}; "
                "pass the same config to build_dmuon_ddp(..., dmuon=config) and get_dmuon_optimizer(..., config)")
    return cfg


def get_dmuon_optimizer(config, model_chunks: List, dmuon: Optional[DMuonConfig] = None):
    """Build the DMuon optimizer for DDP-wrapped model chunks (like get_megatron_optimizer)."""
    cfg = _planned_config(model_chunks, dmuon)
    check_dmuon_config(config, model_chunks[0].ddp_config, cfg, model_chunks[0].config)
    if cfg.autotune_cache:
        from ..kernels.autotune import use_cache_file

        use_cache_file(cfg.autotune_cache)
    return OPTIMIZER_BUILDERS[cfg.mode](config, model_chunks, cfg)


def _import_chained_optimizer():
    from megatron.core.optimizer import ChainedOptimizer

    return ChainedOptimizer


class DMuonChainedOptimizer(OwnerCheckpoints, _import_chained_optimizer()):
    """Megatron's ChainedOptimizer (dense and expert parts) plus the non-finite gradient guard.

    Without a loss scaler (bf16, fp32) Megatron never looks for NaN/Inf: one bad gradient would
    enter the Muon momentum for good. Here every rank checks its main-grad shards after the
    reduce-scatter, the flag is all-reduced over the optimizer's whole group, and a step with any
    non-finite gradient is skipped on every rank before any state changes (params, momentum,
    AdamW moments and step untouched), exactly as Megatron skips an fp16 overflow step: step()
    returns ``(False, None, None)`` and ``skipped_iterations`` counts it."""

    def __init__(self, chained_optimizers, skip_nonfinite: bool = True, fold_clipping: bool = True):
        super().__init__(chained_optimizers)
        # Gradient clipping of the DMuon parts is applied by their owner step (OwnerMuonAdamW.grad_scale:
        # inside the Muon momentum pass, and before AdamW) instead of by Megatron's separate pass over
        # every grad; the same coefficient and roundings. False: Megatron clips (the tests compare both).
        self.fold_clipping = fold_clipping
        self.skip_nonfinite = skip_nonfinite
        self.skipped_iterations = 0
        self._folded_clip = []  # the parts whose clipping this step() hands to their owner step
        self.metrics = None  # DMuon's metrics for TensorBoard / W&B (megatron/metrics.py), once enabled
        self.ns_check_reported_at = None  # the last step whose online NS check was reported (report_ns_check)

    def enable_metrics(self, model_chunks):
        """Record what DMuon's metrics need from now on (megatron/metrics.py: no device value read inside
        the step); returns the ``DMuonMetrics``, which reads and gathers them at each log interval."""
        from .metrics import DMuonMetrics

        if self.metrics is None:
            self.metrics = DMuonMetrics(self, comm_bytes_per_step(model_chunks))
        return self.metrics

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self._grad_norm_this_step = None
        found = super().prepare_grads()  # main grads copied (and Megatron's check with a loss scaler)
        if self.skip_nonfinite and not any(getattr(o, "grad_scaler", None) for o in self.chained_optimizers):
            grads = [p.grad for o in self.chained_optimizers for g in o.optimizer.param_groups for p in g["params"]]
            if self._norm_covers_every_grad_now():
                # Megatron's step computes the grad norm right after this anyway (all-reduced over
                # the same group): NaN/Inf in any grad makes it non-finite, so computing it here
                # and handing it on (get_grad_norm) replaces a separate pass over every grad.
                # (A finite grad whose square overflows float32, |g| > 1e19, also skips the step.)
                norm = self.get_grad_norm()
                found = not math.isfinite(norm)
                self._grad_norm_this_step = None if found else norm
            else:
                found = found_nonfinite(grads, self.get_grad_stats_parallel_group())
        return found

    def get_grad_norm(self):
        cached, self._grad_norm_this_step = getattr(self, "_grad_norm_this_step", None), None
        norm = cached if cached is not None else self._float64_grad_norm()
        for part, max_norm in self._folded_clip:  # Megatron's clip_grad_by_total_norm_fp32 rule
            coefficient = max_norm / (norm + 1.0e-6)
            part.optimizer.grad_scale = coefficient if coefficient < 1.0 else None
        return norm

    @torch.no_grad()
    def _float64_grad_norm(self) -> float:
        """Megatron's grad norm (the same grads, ``get_grads_for_grad_norm``, over the same groups)
        with every partial sum in float64. The owner plan decides which rank sums which grads; with
        Megatron's float32 partial sums the norm, and so the clip coefficient, depended on the plan in
        its last bits (a resume under another --dmuon-balance was not bit-identical). In float64 the
        plans differ by ~1e-16 relative, below the float32 rounding of the coefficient that scales
        the grads."""
        parts = self.chained_optimizers

        def squares(opts) -> torch.Tensor:
            grads = [g for o in opts for g in o.get_grads_for_grad_norm()]
            from .gpt import on_gpu

            device = grads[0].device if grads else (
                torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu"))
            # float64 partial sums without a float64 copy of every grad (torch's float64 norm off the GPU)
            from ..kernels.grad_norm import sum_of_squares_float64

            return sum_of_squares_float64(grads, device)

        def reduced(total, group):
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
            return float(total.item())

        if len(parts) == 1 or self.grads_states_parallel_group_is_shared():
            return reduced(squares(parts), self.get_grad_stats_parallel_group()) ** 0.5
        return math.sqrt(sum(reduced(squares([o]), o.get_grad_stats_parallel_group()) for o in parts))

    def _norm_covers_every_grad(self) -> bool:
        """Whether Megatron's main grad norm sees every grad: no param in a separately clipped
        grad-norm group (megatron-core >= 0.19 lets params opt out of the main norm)."""
        try:
            from megatron.core.optimizer.optimizer import _get_param_grad_norm_group
        except ImportError:
            return True
        return not any(_get_param_grad_norm_group(p) is not None for o in self.chained_optimizers
                       for g in o.optimizer.param_groups for p in g["params"])

    def _norm_covers_every_grad_now(self) -> bool:
        """``_norm_covers_every_grad()``, scanned once per step() (prepare_grads and the clipping
        both ask); outside step() scanned on every call."""
        cached = getattr(self, "_covers_this_step", None)
        return cached if cached is not None else self._norm_covers_every_grad()

    def _clipping_to_fold(self) -> list:
        """(part, max_norm) of every DMuon part whose clipping its owner step can apply: Megatron's
        main norm covers every grad and the grads are the plain main grads."""
        if not self.fold_clipping or not self._norm_covers_every_grad_now():
            return []
        return [(o, o.config.clip_grad) for o in self.chained_optimizers
                if isinstance(o, DMuonDistributedOptimizer) and o.config.clip_grad > 0.0
                and not getattr(o.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)]

    @torch.no_grad()
    def step(self):
        self._covers_this_step = self._norm_covers_every_grad()
        self._folded_clip = self._clipping_to_fold()
        configs = [(part, part.config) for part, _ in self._folded_clip]
        self._redo_early_groups_megatron_clips()
        try:
            # Megatron's step clips a part whose config asks for it: those parts get a config copy
            # without clipping for this step (their own step applies it; get_grad_norm hands it over)
            for part, config in configs:
                part.config = copy.copy(config)  # (not dataclasses.replace: no __post_init__ checks again)
                part.config.clip_grad = 0.0
            if self.metrics is not None:
                self.metrics.begin_step()
            out = super().step()
            if self.metrics is not None:
                self.metrics.end_step()
        finally:
            for part, config in configs:
                part.config = config
                part.optimizer.grad_scale = None  # unused when the step was skipped
            self._folded_clip, self._covers_this_step = [], None
        if not out[0]:
            self.skipped_iterations += 1
            for part in self.chained_optimizers:  # --dmuon-overlap-step backward: undo what the backward started
                if isinstance(part, DMuonDistributedOptimizer):
                    part.optimizer.cancel_early()
        self.ns_check_reported_at = report_ns_check(self, self.ns_check_reported_at)
        return out

    def _redo_early_groups_megatron_clips(self) -> None:
        """--dmuon-overlap-step backward starts each group's Muon work speculatively, unclipped. A part
        whose clipping its owner step applies redoes those groups itself when clipping fires
        (OwnerMuonAdamW.step); a part Megatron clips (scaling the grads in place) redoes them always."""
        folded = {id(part) for part, _ in self._folded_clip}
        for part in self.chained_optimizers:
            if isinstance(part, DMuonDistributedOptimizer) and part.config.clip_grad > 0.0 and id(part) not in folded:
                part.optimizer.cancel_early_for_clipping()

    def finish_overlapped_step(self) -> None:
        """--dmuon-overlap-step: finish every group still in flight (masters applied and copied into
        the model's params), for a reader outside the forward (a finiteness check, an export)."""
        finish_parts([p for p in self.chained_optimizers if isinstance(p, DMuonDistributedOptimizer)])

    # Checkpoints (OwnerCheckpoints): one structure for all parts (a load may split dense/expert
    # params differently); the gather_then_compute baseline (not a DistributedOptimizer) keeps Megatron's
    def _checkpoint_parts(self):
        parts = self.chained_optimizers
        return parts if all(isinstance(p, DMuonDistributedOptimizer) for p in parts) else None

    def dmuon_stats(self) -> dict:
        """Counters for the job's log: skipped steps, NS outputs recomputed in fp32 (non-finite
        ones, and those the online NS check found out of bounds on this rank), and the NS path
        each matrix shape ran on this rank (what 'auto' resolved to), and the backward start's counts."""
        return {"skipped_iterations": self.skipped_iterations,
                "ns_fp32_retries": sum(o.optimizer.stats["ns_fp32_retries_total"] for o in self.chained_optimizers),
                "ns_check_recomputed": sum(o.optimizer.ns_check.recomputed_total for o in self.chained_optimizers),
                # NS calls that ran the torch path because a kernel failed (process-wide; warned on stderr)
                "ns_kernel_fallbacks": NONFINITE_METRICS["kernel_fallbacks"],
                "ns_paths": {k: v for o in self.chained_optimizers for k, v in sorted(o.optimizer.ns_paths.items())},
                # --dmuon-overlap-step backward: bucket groups started in a backward, and those its clipping redid
                "overlap_groups_early": sum(o.optimizer.stats["overlap_groups_early"] for o in self.chained_optimizers),
                "overlap_redos": sum(o.optimizer.stats["overlap_redos"] for o in self.chained_optimizers)}


# each --dmuon-mode's optimizer (megatron_layerwise: Megatron's own; what each mode needs: modes.py)
OPTIMIZER_BUILDERS = {"dmuon": _chained(build_owner_parts),
                      "gather_then_compute": _chained(build_gather_then_compute_parts),
                      "megatron_layerwise": build_megatron_layerwise}


def _split_exchange_bytes(chunk) -> float:
    """Bytes this rank sends per step in the split layout's exchange (planning/split_layout.py), over
    its chunk's buffers (dense: its DP rank; expert: its expert-DP rank)."""
    plan = getattr(chunk, "dmuon_plan", None)
    if plan is None:
        return 0.0
    groups = {kind: buffers[0].data_parallel_group
              for kind, buffers in (("dense", chunk.buffers), ("expert", chunk.expert_parallel_buffers)) if buffers}
    # the directions that come back as 16-bit bits: on CUDA, by the runtime's rule (OwnerMuonAdamW._narrow_directions)
    param = next(chunk.parameters(), None)
    ns_bytes = plan.config.muon.ns_dtype.itemsize if plan.config is not None else 4
    total = 0.0
    for name, layout in plan.layouts.items():
        group = groups.get(name.split("/")[0])
        if group is not None and layout.scheme == "split":  # (the exchange's routes: runtime/dp_exchange.py)
            narrow = (narrow_directions(set(layout.owners) - set(layout.teams), layout.tp_size, ns_bytes)
                      if param is not None and param.is_cuda else ())
            total += exchange_bytes_sent(layout, node_of_dp_ranks(group), narrow=narrow)[group.rank()]
    return total


def comm_bytes_per_step(model_chunks, all_reduce: bool = False) -> dict:
    """Bytes each rank sends per step for grad reduction and param publish (ring algorithms);
    ``all_reduce``: grads all-reduced (Megatron's plain DDP: the gather_then_compute baseline).

    reduce-scatter / all-gather of n elements: (D-1)/D * n per rank; all-reduce: 2(D-1)/D * n.
    With two-level groups (N nodes x L ranks) the split is also reported: intra-node
    (L-1)/L * n and inter-node (N-1)/N * n/L per rank, for each direction.
    """
    reduce_b = publish_b = inter_b = instances_b = exchange_b = 0.0
    padded = unpadded = 0
    for chunk in model_chunks:
        topo = getattr(chunk, "node_topology", None)
        packed = publish_layouts(chunk)  # FP8 publish: bytes of the packed blocks
        # --num-distributed-optimizer-instances N: each rank's reduced shard is all-reduced across the N
        instances = getattr(chunk.ddp_config, "num_distributed_optimizer_instances", 1)
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            d = buffer.data_parallel_world_size
            for bucket in buffer.buckets:
                n = bucket.grad_data.numel()
                padded += n
                unpadded += bucket.numel_unpadded
                gbytes = bucket.grad_data.element_size()
                if all_reduce:
                    reduce_b += 2 * (d - 1) / d * n * gbytes
                    continue
                pbytes = bucket.param_data.element_size() if bucket.param_data is not None else gbytes
                instances_b += 2 * (instances - 1) / instances * n / d * gbytes
                if topo is None:
                    reduce_b += (d - 1) / d * n * gbytes
                    layout = packed.get(id(bucket))
                    publish_b += (d - 1) / d * (layout.recv_bytes if layout is not None else n * pbytes)
                else:
                    L, N = topo.ranks_per_node, topo.num_nodes
                    intra, inter = (L - 1) / L * n, (N - 1) / N * n / L
                    reduce_b += (intra + inter) * gbytes
                    publish_b += (intra + inter) * pbytes
                    inter_b += inter * (gbytes + pbytes)
        exchange_b += _split_exchange_bytes(chunk)
    out = {"reduce_bytes": reduce_b + instances_b, "publish_bytes": publish_b,
           "split_exchange_bytes": exchange_b, "total_bytes": reduce_b + instances_b + publish_b + exchange_b,
           "buffer_numel": padded, "buffer_numel_unpadded": unpadded}
    if instances_b:
        out["inter_instance_bytes"] = instances_b
    if any(getattr(c, "node_topology", None) is not None for c in model_chunks):
        out["inter_node_bytes"] = inter_b
    return out
