"""`--optimizer dmuon` for megatron-core: owner-centric distributed Muon on Megatron's own buffers.

Data path per step: grads accumulate in DDP's owner-aligned buffers -> reduce-scatter (= reduce to
the owner, whole matrices) -> the owner runs Muon with batched NS on what it owns, AdamW on its
element-wise shard -> Megatron's param all-gather publishes (overlapped with the next forward
when overlap_param_gather is on). Grad-norm, clipping, zero counting and the lr/wd schedule are
Megatron's own (we only swap the inner optimizer and the layout).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
from typing import List, Optional

import torch

from . import checkpoint as ckpt
from . import checkpoint_switch
from ..kernels.autotune import measured_method
from ..planning.dp_shards import shard_range
from ..planning.ns_choice import plan_ns_choices
from ..planning.params import is_muon_param
from ..runtime.owner_step import MatrixInfo, MuonSettings, OwnerMuonAdamW
from ..kernels.metrics import NONFINITE_METRICS
from .checks import check_dmuon_config, check_model_parallel_config  # noqa: F401 (public API)
from .config import MODES, DMuonConfig, megatron_muon_fields  # noqa: F401 (MODES: public API)
from .layout import split_rule
from .publish import publish_layouts, register_masters

def _muon_adam_groups(param_groups, infos):
    """Split each Megatron param group (lr/wd multipliers intact) into a Muon and an AdamW group."""
    out = []
    for g in param_groups:
        muon = [p for p in g["params"] if p in infos]
        adam = [p for p in g["params"] if p not in infos]
        for params, use_muon in ((muon, True), (adam, False)):
            out.append({**g, "params": params, "use_muon": use_muon})
    return out


def _init_state_fn(opt, config=None):
    """Megatron's init_state_fn hook: every state tensor, for every param, now (see init_state)."""
    opt.init_state()


def _matrix_infos(model_chunks, muon) -> dict:
    """{model param: MatrixInfo} for every Muon matrix of the chunks: the views of their plans'
    records, with the NS each piece's stack runs (``planning.ns_choice.plan_ns_choices`` over
    every chunk's records: one optimizer stacks them together). Names are unique across chunks
    (virtual pipeline)."""
    params = [(idx, param, name, chunk.dmuon_plan.record(name)) for idx, chunk in enumerate(model_chunks)
              for param, name in chunk.param_names().items()]
    device = next(p for _, p, _, _ in params).device if params else torch.device("cpu")
    choices = plan_ns_choices([r for *_, r in params], precision=muon.ns_dtype, on_cuda=device.type == "cuda",
                              measured=measured_method(device) if device.type == "cuda" else None)
    return {param: MatrixInfo.from_record(record, name if len(model_chunks) == 1 else f"chunk{idx}/{name}", ns)
            for (idx, param, name, record), ns in zip(params, choices) if record.use_muon}


def _register_matrices(inner: OwnerMuonAdamW, model_groups, main_groups, infos) -> None:
    for model_group, main_group in zip(model_groups, main_groups):
        for model_param, main_param in zip(model_group, main_group):
            if model_param in infos:
                inner.register_matrix(main_param, infos[model_param])


def _master_pairs(opt):
    """[(model param, its fp32 master shard)] of a DistributedOptimizer (bf16 params: separate masters)."""
    return [(m, s) for mg, sg in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)
            for m, s in zip(mg, sg)]


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


def _grad_scaler(config):
    """bf16/fp32 need no scaler; a constant --loss-scale is honoured as Megatron does (fp16 needs
    one: check_dmuon_config rejects fp16 with Megatron's dynamic scaler)."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    return ConstantGradScaler(config.loss_scale) if config.loss_scale else None


def get_dmuon_optimizer(config, model_chunks: List, dmuon: Optional[DMuonConfig] = None):
    """Build the DMuon optimizer for DDP-wrapped model chunks (like get_megatron_optimizer)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import _get_param_groups_and_buffers, get_standard_config_overrides

    cfg = _planned_config(model_chunks, dmuon)
    ddp_config = model_chunks[0].ddp_config
    check_dmuon_config(config, ddp_config, cfg, model_chunks[0].config)
    if cfg.autotune_cache:
        from ..kernels.autotune import use_cache_file

        use_cache_file(cfg.autotune_cache)
    if cfg.mode == "dmuon":
        DMuonDistributedOptimizer.check_owner_aligned(model_chunks)
    if cfg.mode == "megatron_layerwise":
        try:
            import emerging_optimizers  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "--dmuon-mode megatron_layerwise delegates to Megatron's LayerWiseDistributedOptimizer, "
                "which needs the emerging_optimizers package (Python >= 3.12): pip install emerging-optimizers"
            ) from e
        from megatron.core.optimizer import get_megatron_optimizer

        # as Megatron-LM's validate_args turns --optimizer muon --use-distributed-optimizer: the
        # LayerWise distributed optimizer (each matrix stepped whole by one DP rank), not DistOpt
        layer_wise = config.use_distributed_optimizer
        if layer_wise and not config.bf16:
            raise ValueError(
                "--dmuon-mode megatron_layerwise runs Megatron's LayerWise distributed Muon, which megatron-core "
                "0.19 builds for bf16 params only (its fp32 chain fails Megatron's own config check, as "
                "--optimizer muon --use-distributed-optimizer does in Megatron-LM): add --bf16")
        fields = megatron_muon_fields(cfg, getattr(config, "muon_tp_mode", "duplicated"))
        opt = get_megatron_optimizer(
            dataclasses.replace(config, optimizer="muon", use_distributed_optimizer=False,
                                use_layer_wise_distributed_optimizer=layer_wise, **fields),
            model_chunks)
        # what the job's summary and the benchmarks' tables name as this baseline's NS path
        opt.megatron_ns_path = (f"Megatron's standard NS ({fields['muon_coefficient_type']}, "
                                f"{fields['muon_num_ns_steps']} steps, fp32 matmul precision "
                                f"{fields['muon_fp32_matmul_prec']})")
        return opt

    if cfg.mode == "gather_then_compute":
        return _gather_then_compute_optimizer(config, model_chunks, cfg)

    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(None, model_chunks, False)
    tp_groups = {False: parallel_state.get_tensor_model_parallel_group(),
                 True: parallel_state.get_expert_tensor_parallel_group()}
    infos = _matrix_infos(model_chunks, cfg.muon)
    parts = []
    for expert in (False, True):
        param_groups, buffers = _get_param_groups_and_buffers(
            model_chunks, 0, config, get_standard_config_overrides(config),
            (lambda g, e=expert: g["is_expert_parallel"] == e), "expert_parallel_buffers" if expert else "buffers",
        )
        if not any(g["params"] for g in param_groups):
            continue
        inner = OwnerMuonAdamW(
            _muon_adam_groups(param_groups, infos),
            lr=config.lr, weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, muon=cfg.muon,
            tp_group=tp_groups[expert],
        )
        opt = DMuonDistributedOptimizer(
            inner, config, _grad_scaler(config), _init_state_fn,
            model_chunks=model_chunks,
            per_model_buffers=buffers,
            data_parallel_group=pgs["intra_expt_dp_group"] if expert else pgs["intra_dp_cp_group"],
            data_parallel_group_gloo=None,
            data_parallel_group_idx=(pgs["expt_tp_pp_with_egtp_remat_group"] if expert else pgs["mp_group"]).rank(),
            distributed_optimizer_instance_id=0,
        )
        _register_matrices(inner, opt.model_float16_groups, opt.shard_fp32_from_float16_groups, infos)
        _register_matrices(inner, opt.model_fp32_groups, opt.shard_fp32_groups, infos)
        # Megatron's get_megatron_optimizer sets these three after construction, as here
        opt.grad_stats_parallel_group = pgs["intra_dist_opt_group"]
        opt.tp_group = tp_groups[False]
        opt.expert_tp_group = tp_groups[True]
        inner.init_state()  # after register_matrix: every rank holds every state key from the start
        for chunk in model_chunks:  # an FP8 publish quantizes from these fp32 masters
            register_masters(chunk, lambda o=opt: _master_pairs(o))
        parts.append(opt)
    return DMuonChainedOptimizer(parts, skip_nonfinite=cfg.skip_nonfinite, fold_clipping=cfg.fold_clipping)


def _gather_then_compute_optimizer(config, model_chunks, cfg):
    """Baseline: all-reduced grads, every rank orthogonalizes every matrix (DP only)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import _get_param_groups_and_buffers, get_standard_config_overrides
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    infos = {}
    for chunk in model_chunks:
        for n, p in (chunk.module if hasattr(chunk, "module") else chunk).named_parameters():
            if is_muon_param(n, p):
                infos[p] = MatrixInfo(n, tuple(p.shape), split_rule(n, p.shape, chunk.config, cfg))
    param_groups, _ = _get_param_groups_and_buffers(
        model_chunks, 0, config, get_standard_config_overrides(config), lambda g: True, "buffers")
    inner = OwnerMuonAdamW(
        _muon_adam_groups(param_groups, infos),
        lr=config.lr, weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, muon=cfg.muon,
    )
    if config.bf16 or config.fp16:
        opt = Float16OptimizerWithFloat16Params(inner, config, _grad_scaler(config), _init_state_fn)
        _register_matrices(inner, opt.float16_groups, opt.fp32_from_float16_groups, infos)
        _register_matrices(inner, opt.fp32_from_fp32_groups, opt.fp32_from_fp32_groups, infos)
    else:
        opt = FP32Optimizer(inner, config, _init_state_fn)
        groups = [g["params"] for g in inner.param_groups]
        _register_matrices(inner, groups, groups, infos)
    opt.grad_stats_parallel_group = parallel_state.get_model_parallel_group()
    opt.tp_group = parallel_state.get_tensor_model_parallel_group()
    opt.expert_tp_group = opt.tp_group
    inner.init_state()
    return DMuonChainedOptimizer([opt], skip_nonfinite=cfg.skip_nonfinite, fold_clipping=cfg.fold_clipping)


def _import_distributed_optimizer():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def _import_chained_optimizer():
    from megatron.core.optimizer import ChainedOptimizer

    return ChainedOptimizer


@torch.no_grad()
def found_nonfinite(grads: List[torch.Tensor], group) -> bool:
    """Whether any gradient on any rank of ``group`` holds NaN/Inf (the same answer everywhere)."""
    from .gpt import on_gpu

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    by_dtype = {}
    for g in grads:
        if g is not None and g.numel():
            by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for (_, dev), gs in by_dtype.items():
        local = torch.zeros(1, dtype=torch.float32, device=dev)
        # Megatron's own check (multiplying by exactly 1.0 leaves the grads unchanged)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, local, torch.ones(1, device=dev))
        flag += local.to(device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


class DMuonChainedOptimizer(_import_chained_optimizer()):
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
        try:
            # Megatron's step clips a part whose config asks for it: those parts get a config copy
            # without clipping for this step (their own step applies it; get_grad_norm hands it over)
            for part, config in configs:
                part.config = copy.copy(config)  # (not dataclasses.replace: no __post_init__ checks again)
                part.config.clip_grad = 0.0
            out = super().step()
        finally:
            for part, config in configs:
                part.config = config
                part.optimizer.grad_scale = None  # unused when the step was skipped
            self._folded_clip, self._covers_this_step = [], None
        if not out[0]:
            self.skipped_iterations += 1
        self._report_ns_check()
        return out

    def _report_ns_check(self) -> None:
        """After a step of the online NS check (runtime/ns_check.py): every rank's findings are
        gathered (the same steps on every rank) and rank 0 logs the worst output and the repairs,
        with a warning the first time an output was recomputed."""
        checks = [o.optimizer.ns_check for o in self.chained_optimizers if isinstance(getattr(o, "optimizer", None), OwnerMuonAdamW)]
        if not checks or not checks[0].due() or getattr(self, "_ns_reported", None) == checks[0].steps:
            return
        self._ns_reported = checks[0].steps
        found = [c.last for c in checks if c.last]
        local = {"worst": max((f["worst"] for f in found), default=None),
                 "checked": sum(f["checked"] for f in found), "recomputed": sum(f["recomputed"] for f in found),
                 "recomputed_total": sum(c.recomputed_total for c in checks)}
        if local["worst"] is not None:
            top = max(found, key=lambda f: f["worst"])
            local.update(name=top["worst_name"], limit=top["worst_limit"])
        everyone = [local]
        if torch.distributed.is_initialized():
            everyone = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, local)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        ranked = [(r, f) for r, f in enumerate(everyone) if f["worst"] is not None]
        if not ranked:
            return
        rank, top = max(ranked, key=lambda rf: rf[1]["worst"])
        recomputed = sum(f["recomputed"] for f in everyone)
        total = sum(f["recomputed_total"] for f in everyone)
        sigma = math.sqrt(max(top["worst"] + 1.0, 0.0))
        print(f"> DMuon NS check at step {checks[0].steps}: {sum(f['checked'] for f in everyone)} NS outputs; the "
              f"worst has top-eig(O^T O - I) {top['worst']:.4f} (largest singular value {sigma:.4f}; bound "
              f"{top['limit']:.4f}), {top['name']} on rank {rank}; recomputed by the exact fp32 NS: {recomputed} "
              f"({total} in all)", flush=True)
        if recomputed and not getattr(DMuonChainedOptimizer, "_ns_warned", False):
            DMuonChainedOptimizer._ns_warned = True
            print("> WARNING: DMuon's NS check found NS outputs out of bounds and recomputed them exactly; the "
                  "fast NS path is not safe on this run's matrices (checked only every --dmuon-ns-check-interval "
                  "steps): pass --dmuon-ns-method standard, or --muon-fp32-matmul-prec high", flush=True)

    # Checkpoints: one structure for all parts (a load may split dense/expert params differently).
    # The gather_then_compute baseline (not a DistributedOptimizer) keeps Megatron's own code.
    def _owner_parts(self):
        parts = self.chained_optimizers
        return parts if all(isinstance(p, DMuonDistributedOptimizer) for p in parts) else None

    def state_dict(self):
        parts = self._owner_parts()
        return ckpt.optimizer_state_dict(parts) if parts else super().state_dict()

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, **kwargs):
        parts = self._owner_parts()
        if not parts:
            return super().sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        if is_loading:  # Megatron-LM's own load: the checkpoint it noted may be Megatron's Muon
            checkpoint_switch.prepare_noted_load(parts, model_sharded_state_dict)
        return ckpt.sharded_optimizer_state(parts, model_sharded_state_dict, is_loading,
                                            kwargs.get("metadata"), kwargs.get("sharding_type"))

    def load_state_dict(self, state_dict):
        parts = self._owner_parts()
        return checkpoint_switch.load_optimizer_state(parts, state_dict) if parts else super().load_state_dict(state_dict)

    def save_parameter_state(self, filename: str):
        parts = self._owner_parts()
        return ckpt.save_param_state_file(parts, filename) if parts else super().save_parameter_state(filename)

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False):
        parts = self._owner_parts()
        if not parts:
            return super().load_parameter_state(filename, update_legacy_format=update_legacy_format)
        return ckpt.load_param_state_file(parts, filename)

    def dmuon_stats(self) -> dict:
        """Counters for the job's log: skipped steps, NS outputs recomputed in fp32 (non-finite
        ones, and those the online NS check found out of bounds on this rank), and the NS path
        each matrix shape ran on this rank (what 'auto' resolved to)."""
        return {"skipped_iterations": self.skipped_iterations,
                "ns_fp32_retries": sum(o.optimizer.stats["ns_fp32_retries_total"] for o in self.chained_optimizers),
                "ns_check_recomputed": sum(o.optimizer.ns_check.recomputed_total for o in self.chained_optimizers),
                # NS calls that ran the torch path because a kernel failed (process-wide; warned on stderr)
                "ns_kernel_fallbacks": NONFINITE_METRICS["kernel_fallbacks"],
                "ns_paths": {k: v for o in self.chained_optimizers for k, v in sorted(o.optimizer.ns_paths.items())}}


class DMuonDistributedOptimizer(_import_distributed_optimizer()):
    """Megatron's DistributedOptimizer whose shards are owner-aligned and whose inner step is the
    owner step (OwnerMuonAdamW). Everything else (grad copy, norm/clip, zero count, publish via
    param all-gather, overlap hooks) is inherited unchanged; checkpoints use DMuon's per-parameter
    format (megatron/checkpoint.py)."""

    def __init__(self, *args, **kwargs):
        self.check_owner_aligned(kwargs["model_chunks"])  # before Megatron builds any state
        super().__init__(*args, **kwargs)
        self._pending_load = None

    @classmethod
    def _build_model_gbuf_range(cls, param_and_grad_buffer, bucket_index: int):
        """As Megatron's, but this rank's shard is `buffer.dmuon_shard_index` (the two-level
        reduce-scatter delivers shard l*N + k to node k, local rank l); flat runs use the DP rank."""
        from megatron.core.optimizer.distrib_optimizer import Range

        shard = getattr(param_and_grad_buffer, "dmuon_shard_index", None)
        if shard is None:
            return super()._build_model_gbuf_range(param_and_grad_buffer, bucket_index)
        world = param_and_grad_buffer.data_parallel_group.size()
        bucket = param_and_grad_buffer.buckets[bucket_index]
        size = bucket.grad_data.numel() // world
        local = Range(*shard_range(shard, size, bucket.offset))
        return {"param_map": cls._build_model_gbuf_param_range_map(
            param_and_grad_buffer.param_index_map, local, bucket.offset)}

    def prepare_grads(self) -> bool:
        for chunk in self.model_chunks:
            if not getattr(chunk, "grads_reduced", True):
                raise RuntimeError(
                    "DMuon: optimizer.step() before the gradients were reduced to their owners: call "
                    "ddp.finish_grad_sync() after backward (Megatron's schedules do it through "
                    "config.finalize_model_grads_func = finalize_model_grads)"
                )
        return super().prepare_grads()

    # ------------------------------------------------------------------------------ checkpoints
    # One part's entry points; DMuonChainedOptimizer calls the same functions with all its parts.
    def state_dict(self):
        return ckpt.optimizer_state_dict([self])

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           sharding_type: Optional[str] = None, metadata: Optional[dict] = None):
        if is_loading:
            checkpoint_switch.prepare_noted_load([self], model_sharded_state_dict)
        return ckpt.sharded_optimizer_state([self], model_sharded_state_dict, is_loading, metadata, sharding_type)

    def load_state_dict(self, state_dict):
        checkpoint_switch.load_optimizer_state([self], state_dict)

    def get_parameter_state_dp_zero(self, *args, **kwargs):
        return ckpt.param_state_dp_zero([self])

    def save_parameter_state(self, filename: str):
        ckpt.save_param_state_file([self], filename)

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False):
        ckpt.load_param_state_file([self], filename)

    def load_parameter_state_from_dp_zero(self, state_dict, *, update_legacy_format: bool = False):
        ckpt.load_param_state_dp_zero([self], state_dict)

    def _megatron_format_not_used(self, *args, **kwargs):
        raise NotImplementedError(
            "DMuon optimizer state uses its own per-parameter format: call sharded_state_dict()/load_state_dict() "
            "(dist_checkpointing) or save_parameter_state()/load_parameter_state() (torch format)")

    get_parameter_state_dp_reshardable = _megatron_format_not_used
    load_parameter_state_from_dp_reshardable = _megatron_format_not_used
    load_parameter_state_from_fully_reshardable = _megatron_format_not_used
    load_parameter_state_from_fs_model_space = _megatron_format_not_used
    sharded_param_state_dp_reshardable = _megatron_format_not_used
    sharded_param_state_fully_reshardable = _megatron_format_not_used
    sharded_param_state_fs_model_space = _megatron_format_not_used
    sharded_param_state_dp_zero = _megatron_format_not_used

    @staticmethod
    def check_owner_aligned(model_chunks) -> None:
        for chunk in model_chunks:
            if getattr(chunk, "dmuon_plan", None) is None:
                raise ValueError(
                    "DMuon: the model chunk was wrapped with a plain DistributedDataParallel; wrap it "
                    "with megatron_dmuon.megatron.layout.build_dmuon_ddp(...) so buckets are owner-aligned"
                )


def comm_bytes_per_step(model_chunks, mode: str) -> dict:
    """Bytes each rank sends per step for grad reduction and param publish (ring algorithms).

    reduce-scatter / all-gather of n elements: (D-1)/D * n per rank; all-reduce: 2(D-1)/D * n.
    With two-level groups (N nodes x L ranks) the split is also reported: intra-node
    (L-1)/L * n and inter-node (N-1)/N * n/L per rank, for each direction.
    """
    reduce_b = publish_b = inter_b = 0.0
    padded = unpadded = 0
    for chunk in model_chunks:
        topo = getattr(chunk, "node_topology", None)
        packed = publish_layouts(chunk)  # FP8 publish: bytes of the packed blocks
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            d = buffer.data_parallel_world_size
            for bucket in buffer.buckets:
                n = bucket.grad_data.numel()
                padded += n
                unpadded += bucket.numel_unpadded
                gbytes = bucket.grad_data.element_size()
                if mode == "gather_then_compute":
                    reduce_b += 2 * (d - 1) / d * n * gbytes
                    continue
                pbytes = bucket.param_data.element_size() if bucket.param_data is not None else gbytes
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
    out = {"reduce_bytes": reduce_b, "publish_bytes": publish_b, "total_bytes": reduce_b + publish_b,
           "buffer_numel": padded, "buffer_numel_unpadded": unpadded}
    if any(getattr(c, "node_topology", None) is not None for c in model_chunks):
        out["inter_node_bytes"] = inter_b
    return out
