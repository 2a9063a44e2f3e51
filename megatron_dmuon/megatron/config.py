"""DMuon's configuration schema: `DMuonConfig` (what the DDP plans with and the optimizer reads)
and its `LayoutOptions`. `DMuonConfig()` equals what an empty command line gives (Megatron-LM's Muon
defaults, megatron_lm_flags.py, plus DMuon's own), so the Python API, the trainer and a Megatron-LM
launch share one set of defaults. A config is built one of three ways:

* from flags: `DMuonConfig.from_args(args)` (parsed once per run: `config_of(args)`; the flags and
  their parse-time checks are flags.py's);
* from fields: `flags.dmuon_config_from_fields(optimizer_config, tp, **options)`, for a megatron-core
  OptimizerConfig carrying Megatron's `muon_*` fields (Megatron-Bridge's recipes);
* from code: `DMuonConfig(...)`, with `with_overrides(cfg, {...})` for DMuonDDP's keyword options.

What each `--dmuon-mode` needs: modes.py.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ..planning.caches import default_plan_cache_path
from ..planning.owner_layout import BALANCE, DP_LAYOUTS
from ..planning.overlap_mode import OverlapMode
from ..runtime.row_update_step import tp_refusal
from .config_checks import tensor_parallel_size
from .modes import MODES, mode_traits, modes_training  # noqa: F401 (MODES: public API)
from .megatron_lm_flags import (MUON_FP32_MATMUL_PREC, MUON_SCALAR_OPTIMIZERS, MUON_TP_MODES, megatron_muon_settings,
                                muon_coefficients_for, refuse_disagreeing_coefficients,
                                refuse_unknown_muon_flags)
from .publish import PUBLISH_DTYPES
from ..runtime.owner_step import MuonSettings

# --dmuon-momentum-dtype: the owners' Muon momentum (bf16 halves the Muon state; docs/mixed_precision.md)
MOMENTUM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass
class LayoutOptions:
    """How the DDP lays out buffers and places owners (the plan's inputs beyond the Muon settings)."""

    ranks_per_node: int = 0  # > 0: two-level reduce/publish, node-striped owners (--dmuon-ranks-per-node)
    balance: str = "cost"  # owner placement (--dmuon-balance)
    # how matrices lie in the DP shards (--dmuon-dp-layout): 'whole' (owner_layout.py), 'split'
    # (split_layout.py), 'auto' (the planner's cost model, per buffer, among the schemes the run can take)
    dp_layout: str = "auto"
    # one bucket per buffer even with --overlap-grad-reduce: every same-shape group is reduced and
    # published by the buffer's one collective (--dmuon-megabatch; docs/dion3.md)
    megabatch: bool = False
    max_bucket_padding: float = 0.02
    # --dmuon-balance milp from the flags: profile the owner step on this GPU (runtime/rank_profile.py),
    # then the MILP on that rank cost model (planning/rank_milp.py), both
    # inside plan_budget_s on rank 0; the plan is cached in plan_cache
    profile: bool = False
    plan_budget_s: Optional[float] = None
    plan_cache: Optional[str] = None
    milp_options: Optional[dict] = None
    elementwise: object = "auto"  # (AdamW, Muon) work per element, 'auto' (cluster config) or None
    # planner inputs for experiments and tests (not flags): cost_fn(shape) -> NS cost of one piece
    # (None: the owner step's NS FLOPs under the config's Muon settings); cost_model_fn(shapes,
    # max_batch) -> planning.cost_model.CostModel
    cost_fn: Optional[Callable] = dataclasses.field(default=None, compare=False)
    cost_model_fn: Optional[Callable] = dataclasses.field(default=None, compare=False)

    def validate(self) -> None:
        if self.ranks_per_node < 0:
            raise ValueError(f"--dmuon-ranks-per-node must be >= 0, got {self.ranks_per_node}")
        if self.balance not in BALANCE:
            raise ValueError(f"--dmuon-balance {self.balance!r} unknown; valid: {', '.join(BALANCE)}")
        if self.dp_layout not in DP_LAYOUTS:
            raise ValueError(f"--dmuon-dp-layout {self.dp_layout!r} unknown; valid: {', '.join(DP_LAYOUTS)}")
        if self.dp_layout == "split" and self.balance != "cost":
            raise ValueError(f"--dmuon-dp-layout split places NS homes by its own greedy; --dmuon-balance "
                             f"{self.balance} places whole matrices: drop one of the two flags")


@dataclasses.dataclass
class DMuonConfig:
    """Everything DMuon's optimizer reads. Defaults = Megatron-LM's Muon defaults + DMuon's own
    (`--dmuon-ns-method auto`: the kernels' measured fastest NS per shape)."""

    mode: str = "dmuon"
    muon: MuonSettings = dataclasses.field(default_factory=megatron_muon_settings)
    split_qkv: bool = True  # Megatron's default (--muon-no-split-qkv turns it off)
    split_per_head: bool = False
    split_glu: bool = False
    autotune_cache: Optional[str] = None  # the kernels' autotune JSON (else $DMUON_AUTOTUNE_CACHE)
    # a step whose gradients hold NaN/Inf is skipped on every rank (no loss scaler needed, e.g. bf16)
    skip_nonfinite: bool = True
    # how Megatron's param all-gather publishes Muon matrices: 'param' (the model's dtype), or
    # owner-quantized FP8 bytes + a per-tensor scale (megatron/publish.py; the DDP plans with it)
    publish_dtype: str = "param"
    # clipping applied inside the owner step (the same coefficient and roundings as Megatron's
    # separate pass; False: Megatron's pass, which the tests compare it with)
    fold_clipping: bool = True
    layout: LayoutOptions = dataclasses.field(default_factory=LayoutOptions)

    def validate(self) -> None:
        self.layout.validate()
        traits = mode_traits(self.mode)
        if self.publish_dtype not in PUBLISH_DTYPES:
            raise ValueError(f"--dmuon-publish-dtype {self.publish_dtype!r} unknown; valid: {', '.join(PUBLISH_DTYPES)}")
        if self.publish_dtype != "param" and not traits.owner_step:
            raise ValueError(f"--dmuon-publish-dtype {self.publish_dtype} needs --dmuon-mode dmuon (the owners quantize); "
                             f"--dmuon-mode {self.mode} publishes nothing of its own")
        self.muon.validate()
        if traits.updates is not None and self.muon.update not in traits.updates:
            first, *others = modes_training(self.muon.update)
            why = " runs Megatron's own Muon" if traits.megatron_muon else f" trains {', '.join(traits.updates)} only"
            raise ValueError(f"--dmuon-mode {self.mode}{why}; --dmuon-update {self.muon.update} needs --dmuon-mode "
                             f"{first}" + (f" (or {', '.join(others)})" if others else ""))
        refusal = self.split_layout_refusal()
        if self.layout.dp_layout == "split" and refusal:
            raise ValueError(f"--dmuon-dp-layout split {refusal}: drop one of the two flags (or pass "
                             "--dmuon-dp-layout auto, which keeps whole matrices for such runs)")

    def split_layout_refusal(self) -> Optional[str]:
        """Why this config cannot run the split layout (planning/split_layout.py), naming the flag that
        needs whole matrices on their owner (None: it can; 'auto' then weighs it)."""
        m = self.muon
        if m.update != "muon":
            return f"does not run --dmuon-update {m.update} (its row statistics need each matrix whole on one rank)"
        if OverlapMode(m.overlap_step).cuts_per_need_group:
            return f"does not run --dmuon-overlap-step {m.overlap_step} (its stacks are cut per bucket group)"
        if self.layout.ranks_per_node:
            return "does not run --dmuon-ranks-per-node (the two-level shard order is not Megatron's)"
        if self.publish_dtype != "param":
            return f"does not run --dmuon-publish-dtype {self.publish_dtype} (the owner quantizes whole matrices)"
        if not mode_traits(self.mode).owner_step:
            return f"is the owner step's layout; --dmuon-mode {self.mode} has none"
        return None

    def plan_summary(self) -> dict:
        """What a plan records of the config it was made from (plain data; ``plan_matches``)."""
        m = self.muon
        return {"mode": self.mode, "split": self.split_flags(), "publish_dtype": self.publish_dtype,
                "ns_method": m.ns_method, "tp_method": m.tp_method, "ns_steps": m.ns_steps,
                "coefficients": m.coefficients if isinstance(m.coefficients, str) else [list(c) for c in m.coefficients],
                "ranks_per_node": self.layout.ranks_per_node, "balance": self.layout.balance,
                "megabatch": self.layout.megabatch, "dp_layout": self.layout.dp_layout}

    def split_flags(self) -> dict:
        """``rule_for_megatron_param``'s split flags: how the optimizer cuts matrices before NS."""
        return dict(split_qkv=self.split_qkv, split_glu=self.split_glu, per_head=self.split_per_head)

    @classmethod
    def from_args(cls, args) -> "DMuonConfig":
        """The config of parsed `add_dmuon_args` flags; a value DMuon cannot honour raises a
        ValueError naming the flag and the fix."""
        refuse_unknown_muon_flags(args)
        steps = args.muon_num_ns_steps
        refuse_disagreeing_coefficients(args)
        coefficients = args.dmuon_coefficients or muon_coefficients_for(args.muon_coefficient_type, steps)
        if args.muon_fp32_matmul_prec not in MUON_FP32_MATMUL_PREC:
            raise ValueError(
                f"--muon-fp32-matmul-prec {args.muon_fp32_matmul_prec!r} is not a torch matmul precision "
                "(torch ignores it); pass medium (bf16 Newton-Schulz, the default) or high (fp32)")
        if args.muon_scalar_optimizer not in MUON_SCALAR_OPTIMIZERS:
            raise ValueError(
                f"--muon-scalar-optimizer {args.muon_scalar_optimizer} is not supported by --optimizer dmuon "
                "(its element-wise params take AdamW on their owner shard); drop the flag or pass adam")
        tp = tensor_parallel_size(args)
        if args.muon_tp_mode not in MUON_TP_MODES:
            raise ValueError(f"--muon-tp-mode {args.muon_tp_mode!r} unknown; valid: {', '.join(MUON_TP_MODES)}")
        if args.muon_tp_mode == "blockwise" and tp > 1 and not mode_traits(args.dmuon_mode).megatron_muon:
            raise ValueError(
                "--muon-tp-mode blockwise (core_v0.19.0's default) orthogonalizes every TP shard on its own, so "
                "the update depends on the TP size (it is not Muon); --optimizer dmuon orthogonalizes whole "
                "matrices: pass --muon-tp-mode duplicated (same math as Megatron's duplicated/distributed)")
        update_kw = _update_settings_from_args(args, tp)
        muon = megatron_muon_settings(
            momentum=args.muon_momentum, nesterov=args.muon_nesterov, coefficients=coefficients,
            ns_steps=steps, ns_dtype=MUON_FP32_MATMUL_PREC[args.muon_fp32_matmul_prec],
            scale_mode=args.muon_scale_mode, extra_scale=args.muon_extra_scale_factor,
            ns_method=args.dmuon_ns_method, ns_launch=args.dmuon_ns_launch, tp_method=args.dmuon_tp_method,
            overlap_step=args.dmuon_overlap_step,
            momentum_dtype=MOMENTUM_DTYPES[args.dmuon_momentum_dtype],
            ns_check_interval=args.dmuon_ns_check_interval,
            ns_check_bound=args.dmuon_ns_check_bound,
            **update_kw)
        cfg = cls(mode=args.dmuon_mode, muon=muon,
                  split_qkv=args.muon_split_qkv or args.dmuon_split_heads,
                  split_per_head=args.dmuon_split_heads, split_glu=args.dmuon_split_glu,
                  autotune_cache=args.dmuon_autotune_cache,
                  skip_nonfinite=not args.dmuon_no_skip_nonfinite,
                  publish_dtype=args.dmuon_publish_dtype,
                  layout=_layout_options_from_args(args))
        cfg.validate()
        return cfg


# Dion3's share of rows when --dmuon-fraction is not given (microsoft/dion's NorDion2 default)
DEFAULT_DION3_FRACTION = 0.25


def _update_settings_from_args(args, tp_size: int) -> dict:
    """MuonSettings fields of --dmuon-update and its options; refused combinations name the flag."""
    update = args.dmuon_update
    fraction = args.dmuon_fraction
    if fraction is not None and update != "dion3":
        raise ValueError(f"--dmuon-fraction {fraction} applies to --dmuon-update dion3 only (got --dmuon-update "
                         f"{update}): drop --dmuon-fraction or pass --dmuon-update dion3")
    if update != "muon" and tp_size > 1:
        raise ValueError(tp_refusal(update))
    return dict(update=update, fraction=DEFAULT_DION3_FRACTION if fraction is None and update == "dion3"
                else (1.0 if fraction is None else fraction),
                row_beta2=args.dmuon_normuon_beta2,
                fraction_lr=args.dmuon_fraction_lr)


def with_overrides(cfg: Optional[DMuonConfig], overrides: dict) -> DMuonConfig:
    """``cfg`` (default ``DMuonConfig()``) with keyword overrides of the Python API applied: layout
    options by name (``ranks_per_node``, ``balance``, ``megabatch``, ``cost_fn``, ...),
    ``publish_dtype``, and ``split`` (``split_flags()``'s dict). Validated; ``cfg`` is not changed."""
    cfg = cfg or DMuonConfig()
    if not overrides:
        cfg.validate()
        return cfg
    layout_fields = {f.name for f in dataclasses.fields(LayoutOptions)}
    layout, top = {}, {}
    for name, value in overrides.items():
        if name in layout_fields:
            layout[name] = value
        elif name == "publish_dtype":
            top[name] = value
        elif name == "split":
            top.update(split_qkv=value.get("split_qkv", False), split_glu=value.get("split_glu", False),
                       split_per_head=value.get("per_head", False))
        else:
            raise TypeError(f"DMuonDDP got an unknown option {name!r}: the layout options are "
                            f"{', '.join(sorted(layout_fields))}, plus publish_dtype and split")
    out = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, **layout), **top)
    out.validate()
    return out


def _layout_options_from_args(args) -> LayoutOptions:
    balance = args.dmuon_balance
    milp = balance == "milp"
    return LayoutOptions(ranks_per_node=args.dmuon_ranks_per_node, balance=balance,
                         dp_layout=getattr(args, "dmuon_dp_layout", "auto"),
                         megabatch=args.dmuon_megabatch, profile=milp,
                         plan_budget_s=args.dmuon_plan_budget if milp else None,
                         plan_cache=default_plan_cache_path() if milp else None)


# (args, config, flags) of this process's run: the one parse of its flags. Kept beside the args, not
# on them: Megatron-LM and the main job save, print and serialise vars(args)
_PARSED: Optional[tuple] = None


def config_of(args) -> DMuonConfig:
    """This run's DMuonConfig: parsed from the flags once (``validate_dmuon_args`` at parse time,
    or the first reader), so the DDP, the optimizer and the job read one object. Parsed again
    only for other args, or if a flag changed since (Megatron-LM may fill args in after validation)."""
    if _PARSED is not None and _PARSED[0] is args and _PARSED[2] == _flags(args):
        return _PARSED[1]
    return remember_config(args, DMuonConfig.from_args(args))


def _flags(args) -> dict:
    return {k: v for k, v in vars(args).items() if k.startswith(("dmuon_", "muon_"))}


def remember_config(args, cfg: DMuonConfig) -> DMuonConfig:
    global _PARSED
    _PARSED = (args, cfg, _flags(args))
    return cfg


def config_from_args(cls, args, **overrides):
    """A megatron-core config dataclass (OptimizerConfig, DistributedDataParallelConfig) from parsed
    flags, field by field as Megatron-LM builds its own, then `overrides`."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw.update(overrides)
    return cls(**kw)
