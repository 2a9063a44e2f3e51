"""One source of DMuon configuration: `DMuonConfig`, its command-line flags and their checks.

`add_dmuon_args(parser)` registers the flags on any argparse parser (our example's, or
Megatron-LM's through `megatron_dmuon.megatron.install()`); `DMuonConfig.from_args(args)` turns
parsed flags into the config; `validate_dmuon_args(args)` rejects every combination DMuon cannot
run, at parse time, naming the flag and the fix. `DMuonConfig()` equals what an empty command
line gives, so the Python API, our example and a Megatron-LM launch share one set of defaults.

Megatron-LM's own Muon flags (core_v0.19.0, `--muon-*`) keep their meaning under
`--optimizer dmuon`: a launch that switches `--optimizer muon` to `--optimizer dmuon` gets the
same update rule (`docs/megatron_lm.md` has the flag-by-flag table). Where the parser lacks
them (our example), `add_dmuon_args` registers them with Megatron's defaults. `--dmuon-*` flags
add only what is DMuon's own.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Callable, Optional

import torch

from ..algorithms.coefficients import COEFFICIENT_SETS, YOU
from ..algorithms.muon import LR_SCALE_MODES
from ..kernels.autotune import CACHE_ENV
from ..planning.owner_layout import BALANCE
from ..planning.caches import default_plan_cache_path
from ..planning.startup_profile import STARTUP_BUDGET_S
from ..planning.tp_cost import TP_METHODS
from ..algorithms.flops import NS_METHODS
from ..runtime.owner_step import ADAPTIVE_SCHEDULE, NS_LAUNCH_MODES, MuonSettings
from ..runtime.row_update_step import UPDATE_RULES, tp_refusal
from ..algorithms.dion3 import FRACTION_LR_MODES
from .checks import check_dmuon_config
from .hierarchy import check_two_level_config
from .publish import PUBLISH_DTYPES

MODES = ("dmuon", "gather_then_compute", "megatron_layerwise")
# --dmuon-momentum-dtype: the owners' Muon momentum (bf16 halves the Muon state; docs/mixed_precision.md)
MOMENTUM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# --- Megatron-LM core_v0.19.0's Muon flags (megatron/training/arguments.py) and what they map to ---
# --muon-coefficient-type -> our schedule. Emerging-Optimizers 0.3: 'simple' = Keller's
# (3.4445, -4.7750, 2.0315) every step (ours 'keller'); 'quintic' = modded-nanogpt's 5 per-step sets
# (ours 'you'), cycled from the first set after step 5; 'polar_express' = the Polar Express
# polynomials (ours 'polar_express', up to 5 steps; see docs/megatron_lm.md for the rounding).
MUON_COEFFICIENT_TYPES = ("simple", "quintic", "polar_express")
# --muon-fp32-matmul-prec -> NS compute dtype. Megatron's 'medium' casts the normalized matrix to
# bf16 for the iterations; 'high' keeps fp32 (TF32 matmuls there; full fp32 here).
MUON_FP32_MATMUL_PREC = {"medium": torch.bfloat16, "high": torch.float32}
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_SCALAR_OPTIMIZERS = ("adam",)
# (flag, argparse kwargs) with Megatron's defaults; registered only where a parser lacks them.
MEGATRON_MUON_FLAGS = (
    ("--muon-momentum", dict(type=float, default=0.9, help="Muon momentum (Megatron's flag)")),
    ("--muon-no-split-qkv", dict(action="store_false", default=True, dest="muon_split_qkv",
                                 help="orthogonalize the fused QKV weight as one matrix (default: Q, K, V apart)")),
    ("--muon-nesterov", dict(action="store_true", help="Nesterov momentum")),
    ("--muon-scale-mode", dict(type=str, default="spectral", choices=LR_SCALE_MODES,
                               help="per-matrix lr scale: spectral sqrt(max(r,c)), shape_scaling "
                                    "sqrt(max(1,r/c)), unit_rms_norm sqrt(r/c), match_rms_adamw, none")),
    ("--muon-fp32-matmul-prec", dict(type=str, default="medium", choices=tuple(MUON_FP32_MATMUL_PREC),
                                     help="NS precision: medium = bf16, high = fp32")),
    ("--muon-coefficient-type", dict(type=str, default="quintic", choices=MUON_COEFFICIENT_TYPES,
                                     help="Newton-Schulz coefficients")),
    ("--muon-num-ns-steps", dict(type=int, default=5, help="Newton-Schulz steps")),
    # Megatron-LM main's default (core_v0.19.0's is blockwise, which DMuon refuses under TP > 1)
    ("--muon-tp-mode", dict(type=str, default="duplicated", choices=MUON_TP_MODES,
                            help="TP-sharded matrices: DMuon always orthogonalizes the whole matrix "
                                 "(duplicated/distributed); blockwise is refused under TP > 1 except for "
                                 "--dmuon-mode megatron_layerwise, which hands it to Megatron's own Muon")),
    ("--muon-use-syrk", dict(action="store_true",
                             help="Megatron's Triton SYRK Gram kernel (same math); DMuon's kernels choose "
                                  "their own symmetric products, so it changes nothing under --optimizer dmuon")),
    ("--muon-extra-scale-factor", dict(type=float, default=1.0, help="extra factor on the Muon update")),
    ("--muon-scalar-optimizer", dict(type=str, default="adam", choices=MUON_SCALAR_OPTIMIZERS,
                                     help="optimizer of embeddings, output layer, norms, biases")),
)

# How --optimizer dmuon treats every --muon-* flag of Megatron-LM's arguments.py (core_v0.19.0 and
# main of 2026-08-22); tests/test_megatron_lm_hook.py fails on a tree's flag missing here. A
# --muon-* flag a newer tree adds is refused at start-up when set (``refuse_unknown_muon_flags``).
MUON_FLAG_HANDLING = {
    "--muon-momentum": "honoured",
    "--muon-no-split-qkv": "honoured (Q, K, V apart by default, per GQA group)",
    "--muon-nesterov": "honoured",
    "--muon-scale-mode": "honoured",
    "--muon-fp32-matmul-prec": "honoured: medium (bf16 NS), high (fp32); low refused",
    "--muon-coefficient-type": "honoured: simple, quintic, polar_express (<= 5 steps); others refused",
    "--muon-num-ns-steps": "honoured",
    "--muon-tp-mode": "honoured: duplicated, distributed (whole-matrix NS); blockwise refused at TP > 1 "
                      "(except --dmuon-mode megatron_layerwise); other modes refused",
    "--muon-use-syrk": "accepted: a kernel choice of the same math; DMuon's kernels choose their own",
    "--muon-extra-scale-factor": "honoured",
    "--muon-scalar-optimizer": "honoured: adam; lion refused",
}
# --muon-* flags a parser had that DMuon does not know: dest -> (flag, the parser's default)
_UNKNOWN_MUON_FLAGS: dict = {}


def refuse_unknown_muon_flags(args) -> None:
    """A --muon-* flag DMuon does not know (a newer Megatron-LM tree's), set to other than its
    default, would be ignored silently: refuse it by name (Megatron's own Muon, under
    ``--dmuon-mode megatron_layerwise``, reads its flags itself)."""
    if getattr(args, "dmuon_mode", "dmuon") == "megatron_layerwise":
        return
    for dest, (flag, default) in _UNKNOWN_MUON_FLAGS.items():
        value = getattr(args, dest, default)
        if value != default:
            raise ValueError(
                f"{flag} {value!r} is a Megatron-LM Muon flag that --optimizer dmuon does not know (this "
                f"Megatron-LM tree is newer than DMuon's table, megatron/config.py MUON_FLAG_HANDLING), so "
                f"it would be ignored: drop the flag, or train with --optimizer muon")


def megatron_muon_settings(**overrides) -> MuonSettings:
    """MuonSettings of Megatron-LM's `--optimizer muon` defaults (what an empty command line gives)."""
    kw = dict(momentum=0.9, nesterov=False, coefficients="you", ns_steps=5, ns_dtype=torch.bfloat16,
              scale_mode="spectral", extra_scale=1.0, ns_method="auto")
    kw.update(overrides)
    return MuonSettings(**kw)


@dataclasses.dataclass
class LayoutOptions:
    """How the DDP lays out buffers and places owners (the plan's inputs beyond the Muon settings)."""

    ranks_per_node: int = 0  # > 0: two-level reduce/publish, node-striped owners (--dmuon-ranks-per-node)
    balance: str = "cost"  # owner placement (--dmuon-balance)
    # one bucket per buffer even with --overlap-grad-reduce: every same-shape group is reduced and
    # published by the buffer's one collective (--dmuon-megabatch; docs/dion3.md)
    megabatch: bool = False
    max_bucket_padding: float = 0.02
    # --dmuon-balance milp from the flags: profile the owner NS on this GPU, then the MILP, both
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
        if self.mode not in MODES:
            raise ValueError(f"--dmuon-mode {self.mode!r} unknown; valid: {', '.join(MODES)}")
        if self.publish_dtype not in PUBLISH_DTYPES:
            raise ValueError(f"--dmuon-publish-dtype {self.publish_dtype!r} unknown; valid: {', '.join(PUBLISH_DTYPES)}")
        if self.publish_dtype != "param" and self.mode != "dmuon":
            raise ValueError(f"--dmuon-publish-dtype {self.publish_dtype} needs --dmuon-mode dmuon (the owners quantize); "
                             f"--dmuon-mode {self.mode} publishes nothing of its own")
        self.muon.validate()
        if self.mode == "megatron_layerwise" and self.muon.update != "muon":
            raise ValueError(f"--dmuon-mode megatron_layerwise runs Megatron's own Muon; --dmuon-update "
                             f"{self.muon.update} needs --dmuon-mode dmuon (or gather_then_compute)")

    def plan_summary(self) -> dict:
        """What a plan records of the config it was made from (plain data; ``plan_matches``)."""
        m = self.muon
        return {"mode": self.mode, "split": self.split_flags(), "publish_dtype": self.publish_dtype,
                "ns_method": m.ns_method, "tp_method": m.tp_method, "ns_steps": m.ns_steps,
                "coefficients": m.coefficients if isinstance(m.coefficients, str) else [list(c) for c in m.coefficients],
                "ranks_per_node": self.layout.ranks_per_node, "balance": self.layout.balance,
                "megabatch": self.layout.megabatch}

    def split_flags(self) -> dict:
        """``rule_for_megatron_param``'s split flags: how the optimizer cuts matrices before NS."""
        return dict(split_qkv=self.split_qkv, split_glu=self.split_glu, per_head=self.split_per_head)

    @classmethod
    def from_args(cls, args) -> "DMuonConfig":
        """The config of parsed `add_dmuon_args` flags; a value DMuon cannot honour raises a
        ValueError naming the flag and the fix."""
        refuse_unknown_muon_flags(args)
        steps = args.muon_num_ns_steps
        coefficients = args.dmuon_coefficients or _coefficients_for(args.muon_coefficient_type, steps)
        if args.muon_fp32_matmul_prec not in MUON_FP32_MATMUL_PREC:
            raise ValueError(
                f"--muon-fp32-matmul-prec {args.muon_fp32_matmul_prec!r} is not a torch matmul precision "
                "(torch ignores it); pass medium (bf16 Newton-Schulz, the default) or high (fp32)")
        if args.muon_scalar_optimizer not in MUON_SCALAR_OPTIMIZERS:
            raise ValueError(
                f"--muon-scalar-optimizer {args.muon_scalar_optimizer} is not supported by --optimizer dmuon "
                "(its element-wise params take AdamW on their owner shard); drop the flag or pass adam")
        tp = max(getattr(args, "tensor_model_parallel_size", 1) or 1,
                 getattr(args, "expert_tensor_parallel_size", 1) or 1)
        if args.muon_tp_mode not in MUON_TP_MODES:
            raise ValueError(f"--muon-tp-mode {args.muon_tp_mode!r} unknown; valid: {', '.join(MUON_TP_MODES)}")
        if args.muon_tp_mode == "blockwise" and tp > 1 and args.dmuon_mode != "megatron_layerwise":
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
            momentum_dtype=MOMENTUM_DTYPES[getattr(args, "dmuon_momentum_dtype", "fp32")],
            ns_check_interval=getattr(args, "dmuon_ns_check_interval", 100),
            ns_check_bound=getattr(args, "dmuon_ns_check_bound", None),
            **update_kw)
        cfg = cls(mode=args.dmuon_mode, muon=muon,
                  split_qkv=args.muon_split_qkv or args.dmuon_split_heads,
                  split_per_head=args.dmuon_split_heads, split_glu=args.dmuon_split_glu,
                  autotune_cache=args.dmuon_autotune_cache,
                  skip_nonfinite=not getattr(args, "dmuon_no_skip_nonfinite", False),
                  publish_dtype=getattr(args, "dmuon_publish_dtype", "param"),
                  layout=_layout_options_from_args(args))
        cfg.validate()
        return cfg


# Dion3's share of rows when --dmuon-fraction is not given (microsoft/dion's NorDion2 default)
DEFAULT_DION3_FRACTION = 0.25


def _update_settings_from_args(args, tp_size: int) -> dict:
    """MuonSettings fields of --dmuon-update and its options; refused combinations name the flag."""
    update = getattr(args, "dmuon_update", "muon")
    fraction = getattr(args, "dmuon_fraction", None)
    if fraction is not None and update != "dion3":
        raise ValueError(f"--dmuon-fraction {fraction} applies to --dmuon-update dion3 only (got --dmuon-update "
                         f"{update}): drop --dmuon-fraction or pass --dmuon-update dion3")
    if update != "muon" and tp_size > 1:
        raise ValueError(tp_refusal(update))
    return dict(update=update, fraction=DEFAULT_DION3_FRACTION if fraction is None and update == "dion3"
                else (1.0 if fraction is None else fraction),
                row_beta2=getattr(args, "dmuon_normuon_beta2", 0.95),
                fraction_lr=getattr(args, "dmuon_fraction_lr", "none"))


def _coefficients_for(coefficient_type: str, steps: int):
    if coefficient_type == "simple":
        return "keller"
    if coefficient_type == "quintic":
        # Emerging-Optimizers cycles its 5 sets; ours ('you') would repeat the last one
        return "you" if steps <= len(YOU) else tuple(YOU[i % len(YOU)] for i in range(steps))
    if coefficient_type == "polar_express":
        if steps > 5:
            raise ValueError(
                f"--muon-coefficient-type polar_express with --muon-num-ns-steps {steps}: Megatron continues "
                "with three further Polar Express sets that DMuon does not have; use <= 5 steps, or "
                "--dmuon-coefficients polar_express (ours: the fifth set repeats)")
        return "polar_express"
    raise ValueError(
        f"--muon-coefficient-type {coefficient_type!r} is not available under --optimizer dmuon; valid: "
        f"{', '.join(MUON_COEFFICIENT_TYPES)}, or DMuon's own --dmuon-coefficients "
        f"{{{','.join(COEFFICIENT_SETS + (ADAPTIVE_SCHEDULE,))}}}")


def megatron_muon_fields(cfg: DMuonConfig, tp_mode: str = "duplicated") -> dict:
    """OptimizerConfig `muon_*` fields under which Megatron's own Muon runs the rule of `cfg`
    (the `megatron_layerwise` baseline; `tp_mode` is Megatron's --muon-tp-mode, which DMuon itself
    does not need): the inverse of `DMuonConfig.from_args`."""
    m = cfg.muon
    names = {"keller": "simple", "you": "quintic", "polar_express": "polar_express"}
    cycled = tuple(YOU[i % len(YOU)] for i in range(m.ns_steps))
    coefficient_type = "quintic" if m.coefficients == cycled else names.get(m.coefficients) \
        if isinstance(m.coefficients, str) else None
    precision = {dtype: name for name, dtype in MUON_FP32_MATMUL_PREC.items()}.get(m.ns_dtype)
    if coefficient_type is None or precision is None or cfg.split_per_head or cfg.split_glu:
        raise ValueError(
            "--dmuon-mode megatron_layerwise runs Megatron's own Muon, which has no equivalent of "
            f"coefficients={m.coefficients!r}, ns_dtype={m.ns_dtype}, --dmuon-split-heads or --dmuon-split-glu")
    return dict(muon_momentum=m.momentum, muon_nesterov=m.nesterov, muon_split_qkv=cfg.split_qkv,
                muon_scale_mode=m.scale_mode, muon_extra_scale_factor=m.extra_scale,
                muon_coefficient_type=coefficient_type, muon_num_ns_steps=m.ns_steps,
                muon_fp32_matmul_prec=precision, muon_tp_mode=tp_mode, muon_scalar_optimizer="adam")


_LEGACY_LAYOUT_NAMES = {"startup_budget_s": "plan_budget_s"}


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
        name = _LEGACY_LAYOUT_NAMES.get(name, name)
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
    balance = getattr(args, "dmuon_balance", "cost")
    milp = balance == "milp"
    return LayoutOptions(ranks_per_node=getattr(args, "dmuon_ranks_per_node", 0), balance=balance,
                         megabatch=getattr(args, "dmuon_megabatch", False), profile=milp,
                         plan_budget_s=getattr(args, "dmuon_plan_budget", STARTUP_BUDGET_S) if milp else None,
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
    return _remember(args, DMuonConfig.from_args(args))


def _flags(args) -> dict:
    return {k: v for k, v in vars(args).items() if k.startswith(("dmuon_", "muon_"))}


def _remember(args, cfg: DMuonConfig) -> DMuonConfig:
    global _PARSED
    _PARSED = (args, cfg, _flags(args))
    return cfg


def config_from_args(cls, args, **overrides):
    """A megatron-core config dataclass (OptimizerConfig, DistributedDataParallelConfig) from parsed
    flags, field by field as Megatron-LM builds its own, then `overrides`."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw.update(overrides)
    return cls(**kw)


# ----------------------------------------------------------------------------------------- flags
def _has(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


def add_dmuon_args(parser: argparse.ArgumentParser, validate: bool = True) -> argparse.ArgumentParser:
    """Register DMuon's flags on `parser` (idempotent) and return it.

    An existing `--optimizer` gains the choice `dmuon`; Megatron's `--muon-*` flags are added only
    where the parser lacks them (with Megatron's defaults). With `validate`, parsing itself
    rejects bad combinations for `--optimizer dmuon` (`validate_dmuon_args`) via `parser.error`.
    """
    if _has(parser, "--dmuon-mode"):  # added already (idempotent)
        return parser
    optimizer = parser._option_string_actions.get("--optimizer")
    if optimizer is not None and optimizer.choices is not None and "dmuon" not in optimizer.choices:
        optimizer.choices = list(optimizer.choices) + ["dmuon"]
    _UNKNOWN_MUON_FLAGS.clear()
    _UNKNOWN_MUON_FLAGS.update({action.dest: (flag, action.default)
                                for flag, action in parser._option_string_actions.items()
                                if flag.startswith("--muon-") and flag not in MUON_FLAG_HANDLING})
    missing = [(flag, kw) for flag, kw in MEGATRON_MUON_FLAGS if not _has(parser, flag)]
    if missing:
        group = parser.add_argument_group("Muon (Megatron-LM's flags; same meaning under --optimizer dmuon)")
        for flag, kw in missing:
            group.add_argument(flag, **kw)
    g = parser.add_argument_group("DMuon (owner-centric distributed Muon; docs/megatron_lm.md)")
    g.add_argument("--dmuon-mode", default="dmuon", choices=MODES,
                   help="dmuon: owners (needs --use-distributed-optimizer); gather_then_compute: the "
                        "all-reduce baseline; megatron_layerwise: Megatron's own LayerWise Muon")
    g.add_argument("--dmuon-ns-method", default="auto", choices=NS_METHODS,
                   help="Newton-Schulz variant: standard, gram (in the small Gram space; a 16-bit "
                        "--muon-fp32-matmul-prec runs it in fp16, where it is stable, not bf16), auto (the "
                        "kernels' measured fastest per shape; standard off CUDA)")
    g.add_argument("--dmuon-coefficients", default=None, choices=COEFFICIENT_SETS + (ADAPTIVE_SCHEDULE,),
                   help="DMuon's NS schedule instead of --muon-coefficient-type (adaptive: per shape, "
                        "the tighter ||(XX^T)^2||^(1/4) normalisation with 4 designed steps for aspect >= 2, "
                        "5 for nearer-square matrices)")
    g.add_argument("--dmuon-ns-launch", default="eager", choices=NS_LAUNCH_MODES,
                   help="GPU: the owner's per-shape NS calls one by one, on concurrent streams, or as one CUDA graph")
    g.add_argument("--dmuon-tp-method", default="auto", choices=TP_METHODS,
                   help="TP-sharded matrices: gather to the TP owner, distributed Gram NS, or auto (cost model)")
    g.add_argument("--dmuon-balance", default="cost", choices=BALANCE,
                   help="owner assignment: cost (greedy on predicted NS time), milp (NS profiled on this GPU, "
                        "then an MILP; both cached), numel_lpt or round_robin (baselines)")
    g.add_argument("--dmuon-plan-budget", type=float, default=STARTUP_BUDGET_S, metavar="SECONDS",
                   help="--dmuon-balance milp: start-up seconds for NS profiling + the MILP on rank 0 "
                        "(the best plan found by then is used; cached plans cost nothing)")
    g.add_argument("--dmuon-ranks-per-node", type=int, default=0,
                   help="> 0: two-level (intra-node, then inter-node) grad reduce / param publish with "
                        "this many ranks per node (pass the GPUs per node)")
    g.add_argument("--dmuon-update", default="muon", choices=UPDATE_RULES,
                   help="the owners' update rule: muon; normuon (row-normalized Muon); dion3 (top "
                        "--dmuon-fraction rows by L1 norm, error feedback, NorMuon normalization); docs/dion3.md")
    g.add_argument("--dmuon-fraction", type=float, default=None, metavar="F",
                   help=f"--dmuon-update dion3: share of each matrix's rows orthogonalized per step, in (0, 1] "
                        f"(default {DEFAULT_DION3_FRACTION}; 1 = NorMuon)")
    g.add_argument("--dmuon-fraction-lr", default="none", choices=FRACTION_LR_MODES,
                   help="dion3: lr factor for the fraction: none (NorDion2's) or inverse_sqrt (1/sqrt(F))")
    g.add_argument("--dmuon-normuon-beta2", type=float, default=0.95,
                   help="normuon/dion3: decay of the per-row second moment")
    g.add_argument("--dmuon-megabatch", action="store_true",
                   help="one grad reduce-scatter and one param all-gather per buffer per step whatever the layer "
                        "count (no per-bucket overlap with backward); owners run one batched NS per shape")
    g.add_argument("--dmuon-split-heads", action="store_true", help="orthogonalize every attention head apart")
    g.add_argument("--dmuon-split-glu", action="store_true", help="orthogonalize SwiGLU gate and up apart")
    g.add_argument("--dmuon-autotune-cache", default=None, metavar="PATH",
                   help=f"the kernels' autotune cache file (default ${CACHE_ENV}, else ~/.cache/megatron_dmuon/autotune.json)")
    g.add_argument("--dmuon-publish-dtype", default="param", choices=PUBLISH_DTYPES,
                   help="param all-gather of Muon matrices: the model's dtype, or FP8 bytes the owner quantizes "
                        "from its fp32 master with a per-tensor scale (needs --bf16; docs/mixed_precision.md)")
    g.add_argument("--dmuon-momentum-dtype", default="fp32", choices=tuple(MOMENTUM_DTYPES),
                   help="dtype of the owners' Muon momentum (bf16 halves it; accuracy cost in docs/mixed_precision.md)")
    g.add_argument("--dmuon-ns-check-interval", type=int, default=100, metavar="STEPS",
                   help="online NS quality: every STEPS optimizer steps each owner estimates top-eig(O^T O - I) of its "
                        "NS outputs (random probes), recomputes those above --dmuon-ns-check-bound exactly (fp32) "
                        "and logs the worst; 0: off")
    g.add_argument("--dmuon-ns-check-bound", type=float, default=None, metavar="B",
                   help="the check's bound on top-eig(O^T O - I) (default: (1.25 x the largest singular value the "
                        "NS schedule gives in exact arithmetic)^2 - 1, e.g. 1.05 for Megatron's quintic)")
    g.add_argument("--dmuon-no-skip-nonfinite", action="store_true",
                   help="do not skip a step whose gradients hold NaN/Inf (skipped on every rank by default)")
    if validate:
        _validate_on_parse(parser)
    return parser


def _validate_on_parse(parser: argparse.ArgumentParser) -> None:
    parse_known_args = parser.parse_known_args  # argparse's parse_args goes through this one

    def checked(*a, **kw):
        args, rest = parse_known_args(*a, **kw)
        try:
            validate_dmuon_args(args)
        except ValueError as e:
            if os.environ.get("RANK", "0") != "0":  # every rank fails alike: one of them says why
                raise SystemExit(2) from None
            parser.error(str(e))
        return args, rest

    parser.parse_known_args = checked


# ---------------------------------------------------------------------------------------- checks
def _number_check(args, name: str, low: float, high: float = math.inf, low_open: bool = False,
                  high_open: bool = False, fix: str = "") -> None:
    """ValueError naming ``--name`` if the parsed value is NaN, infinite or outside its range (a
    flag the parser does not have, or left at None, is not checked)."""
    value = getattr(args, name, None)
    if value is None or isinstance(value, bool):
        return
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if math.isfinite(value) and above and below:
        return
    if isinstance(value, int) and not math.isfinite(high):
        raise ValueError(f"--{name.replace('_', '-')} {value} must be an integer >= {low}" + (f"; {fix}" if fix else ""))
    interval = ("(" if low_open else "[") + f"{low:g}, " + (f"{high:g}" if math.isfinite(high) else "inf") + \
        (")" if high_open or not math.isfinite(high) else "]")
    raise ValueError(f"--{name.replace('_', '-')} {value} must be a finite number in {interval}" + (f"; {fix}" if fix else ""))


def check_training_numbers(args) -> None:
    """The optimizer numbers every run reads (Megatron-LM's flags, our example's): finite and in
    range, so that nothing is accepted that would silently ruin or disable a run."""
    _number_check(args, "lr", 0.0, low_open=True, fix="the peak learning rate, e.g. 3e-4")
    _number_check(args, "min_lr", 0.0, fix="0 decays to zero")
    lr, min_lr = getattr(args, "lr", None), getattr(args, "min_lr", None)
    if lr is not None and min_lr is not None and min_lr > lr:
        raise ValueError(f"--min-lr ({min_lr}) must not exceed --lr ({lr})")
    _number_check(args, "weight_decay", 0.0, fix="0 turns weight decay off")
    _number_check(args, "clip_grad", 0.0, fix="0 turns clipping off")
    for beta in ("adam_beta1", "adam_beta2"):
        _number_check(args, beta, 0.0, 1.0, high_open=True)
    _number_check(args, "adam_eps", 0.0, low_open=True, fix="e.g. 1e-8")


def check_muon_numbers(args) -> None:
    """Every --muon-* / --dmuon-* number of ``--optimizer dmuon``, in the flag's words."""
    _number_check(args, "muon_momentum", 0.0, 1.0, high_open=True, fix="0.95 with --muon-nesterov is the usual choice")
    _number_check(args, "muon_extra_scale_factor", 0.0, low_open=True,
                  fix="0 would freeze every Muon matrix and a negative factor ascends the loss; 0.2 with "
                      "--muon-scale-mode spectral matches AdamW's update size")
    _number_check(args, "muon_num_ns_steps", 1, fix="Megatron's default is 5")
    _number_check(args, "dmuon_plan_budget", 0.0, low_open=True, fix=f"default {STARTUP_BUDGET_S:g} s")
    _number_check(args, "dmuon_fraction", 0.0, 1.0, low_open=True, fix="the share of rows Dion3 orthogonalizes")
    _number_check(args, "dmuon_normuon_beta2", 0.0, 1.0, high_open=True)
    _number_check(args, "dmuon_ranks_per_node", 0, fix="0 turns the two-level reduce/publish off")
    _number_check(args, "dmuon_ns_check_interval", 0, fix="0 turns the check off")
    _number_check(args, "dmuon_ns_check_bound", 0.0, low_open=True, fix="leave it unset for the per-schedule bound")


def check_cache_paths(args) -> None:
    """The caches DMuon writes (autotune, owner plans, NS profile) must be writable files: a
    directory or an uncreatable path there fails now, naming the cache and where it is set, instead
    of at the first write in the middle of start-up."""
    from ..kernels.autotune import AutotuneCache
    from ..planning.caches import PlanCache, ProfileCache, default_plan_cache_path, default_profile_cache_path

    caches = [AutotuneCache(getattr(args, "dmuon_autotune_cache", None)), PlanCache(default_plan_cache_path()),
              ProfileCache(default_profile_cache_path())]
    for cache in caches:
        problem = cache.writable_problem()
        if problem:
            raise ValueError(f"the {cache.label} {cache.path} {problem}: point {cache.env} at a writable file path")


class _ArgsView:
    """Parsed args seen as OptimizerConfig / DDP config / model config (Megatron-LM's flags have
    those fields' names). A flag the parser does not have reads as the value DMuon needs: the
    program sets it itself, as our example does; other missing flags read as None (off)."""

    def __init__(self, args, cfg: DMuonConfig):
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        self._args = args
        self._derived = dict(
            use_distributed_optimizer=get("use_distributed_optimizer", cfg.mode != "gather_then_compute"),
            num_distributed_optimizer_instances=get("num_distributed_optimizer_instances", 1),
            fp8_param=get("fp8_param_gather", False),
            decoupled_weight_decay=get("decoupled_weight_decay", True),
        )

    def __getattr__(self, name):
        if name in self._derived:
            return self._derived[name]
        return getattr(self._args, name, None)


def _data_parallel_size(args) -> Optional[int]:
    if getattr(args, "data_parallel_size", None):
        return args.data_parallel_size
    world = int(os.environ.get("WORLD_SIZE", "0"))
    model = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model *= getattr(args, name, 1) or 1
    return world // model if world and world % model == 0 else None


def validate_dmuon_args(args) -> Optional[DMuonConfig]:
    """Parse-time checks of `--optimizer dmuon` (nothing for other optimizers): the flags map onto
    a valid DMuonConfig and the parallel / precision / optimizer combination is one DMuon runs.
    Returns the config; raises ValueError naming the flag and the fix."""
    if getattr(args, "optimizer", "dmuon") != "dmuon":
        return None
    check_training_numbers(args)
    check_muon_numbers(args)
    cfg = _remember(args, DMuonConfig.from_args(args))  # the one parse of the run (config_of)
    view = _ArgsView(args, cfg)
    check_dmuon_config(view, view, cfg, model_config=view)
    for flag in ("use_torch_fsdp2", "use_megatron_fsdp", "use_mup"):
        if getattr(args, flag, False):
            raise ValueError(f"--optimizer dmuon does not support --{flag.replace('_', '-')}; drop the flag")
    if cfg.publish_dtype != "param" and not getattr(args, "bf16", False):
        raise ValueError(f"--dmuon-publish-dtype {cfg.publish_dtype} needs --bf16: an fp32 param is its own optimizer "
                         "master, which the FP8 decode would overwrite; add --bf16 or drop the flag")
    if cfg.publish_dtype != "param" and getattr(args, "dmuon_ranks_per_node", 0):
        raise ValueError(f"--dmuon-publish-dtype {cfg.publish_dtype} is not implemented with the two-level publish: "
                         "drop --dmuon-ranks-per-node or use --dmuon-publish-dtype param")
    check_cache_paths(args)
    # the data-parallel size is known here under torchrun (WORLD_SIZE); else only at DDP build
    check_two_level_config(view, _data_parallel_size(args) or max(args.dmuon_ranks_per_node, 1),
                           args.dmuon_ranks_per_node)
    return cfg
