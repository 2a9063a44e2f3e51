"""Megatron-LM's own Muon flags (core_v0.19.0 and main, `--muon-*`) under `--optimizer dmuon`: the
table with Megatron's defaults (registered where a parser lacks them), how DMuon treats each flag,
Megatron's defaults as MuonSettings, and the mapping both ways (flags -> our schedule and NS
precision; a DMuonConfig -> the OptimizerConfig fields Megatron's own Muon runs it with).

A launch that switches `--optimizer muon` to `--optimizer dmuon` gets the same update rule
(`docs/megatron_lm.md` has the flag-by-flag table).
"""
from __future__ import annotations

import torch

from ..algorithms.coefficients import YOU, get_coefficients
from ..algorithms.eo_coefficients import EO_COEFFICIENT_TYPES, eo_schedule
from ..algorithms.muon import LR_SCALE_MODES
from ..runtime.owner_step import ADAPTIVE_SCHEDULE, MuonSettings
from .modes import mode_traits

# --muon-coefficient-type -> our schedule: every type Emerging-Optimizers 0.4.0 offers (NSCoeffT),
# its sets walked as its newton_schulz walks them (algorithms/eo_coefficients.py); 'custom' is refused.
MUON_COEFFICIENT_TYPES = EO_COEFFICIENT_TYPES
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
                                     help="Newton-Schulz coefficients (Emerging-Optimizers' types, its sets "
                                          "and step order)")),
    ("--muon-num-ns-steps", dict(type=int, default=5, help="Newton-Schulz steps")),
    # Megatron-LM main's default (core_v0.19.0's is blockwise, which DMuon refuses under TP > 1)
    ("--muon-tp-mode", dict(type=str, default="duplicated", choices=MUON_TP_MODES,
                            help="TP-sharded matrices: DMuon always orthogonalizes the whole matrix "
                                 "(duplicated/distributed); blockwise is refused under TP > 1 except for "
                                 "--dmuon-mode megatron_layerwise, which hands it to Megatron's own Muon")),
    ("--muon-use-syrk", dict(action="store_true",
                             help="Megatron's Triton SYRK kernel for the symmetric products of its NS (same "
                                  "math); DMuon's NS kernels compute their symmetric products as such already, "
                                  "so under --optimizer dmuon it changes nothing")),
    ("--muon-extra-scale-factor", dict(type=float, default=1.0, help="extra factor on the Muon update")),
    ("--muon-scalar-optimizer", dict(type=str, default="adam", choices=MUON_SCALAR_OPTIMIZERS,
                                     help="optimizer of embeddings, output layer, norms, biases")),
)

# How --optimizer dmuon treats every --muon-* flag of Megatron-LM's arguments.py (core_v0.19.0 and
# main of 2026-08-22); tests/megatron/test_megatron_lm.py fails on a tree's flag missing here. A
# --muon-* flag a newer tree adds is refused at start-up when set (``refuse_unknown_muon_flags``).
MUON_FLAG_HANDLING = {
    "--muon-momentum": "honoured",
    "--muon-no-split-qkv": "honoured (Q, K, V apart by default, per GQA group)",
    "--muon-nesterov": "honoured",
    "--muon-scale-mode": "honoured",
    "--muon-fp32-matmul-prec": "honoured: medium (bf16 NS), high (fp32); low refused",
    "--muon-coefficient-type": "honoured: simple, quintic, polar_express, cans, aol, deepseekv4, cubic5 (5 steps "
                               "only, as Emerging-Optimizers); custom refused (Megatron-LM passes no sets)",
    "--muon-num-ns-steps": "honoured",
    "--muon-tp-mode": "honoured: duplicated, distributed (whole-matrix NS); blockwise refused at TP > 1 "
                      "(except --dmuon-mode megatron_layerwise); other modes refused",
    "--muon-use-syrk": "accepted, changes nothing: a kernel choice of the same math (Megatron's needs "
                       "Emerging-Optimizers >= 0.4); DMuon's kernels are symmetric already",
    "--muon-extra-scale-factor": "honoured",
    "--muon-scalar-optimizer": "honoured: adam; lion refused",
}
# --muon-* flags a parser had that DMuon does not know: dest -> (flag, the parser's default)
UNKNOWN_MUON_FLAGS: dict = {}


def refuse_unknown_muon_flags(args) -> None:
    """A --muon-* flag DMuon does not know (a newer Megatron-LM tree's), set to other than its
    default, would be ignored silently: refuse it by name (Megatron's own Muon, under
    ``--dmuon-mode megatron_layerwise``, reads its flags itself)."""
    if mode_traits(getattr(args, "dmuon_mode", "dmuon")).megatron_muon:
        return
    for dest, (flag, default) in UNKNOWN_MUON_FLAGS.items():
        value = getattr(args, dest, default)
        if value != default:
            raise ValueError(
                f"{flag} {value!r} is a Megatron-LM Muon flag that --optimizer dmuon does not know (this "
                f"Megatron-LM tree is newer than DMuon's table, megatron/megatron_lm_flags.py MUON_FLAG_HANDLING), so "
                f"it would be ignored: drop the flag, or train with --optimizer muon")


def refuse_disagreeing_coefficients(args, type_given=None) -> None:
    """--dmuon-coefficients and --muon-coefficient-type both set, naming other Newton-Schulz sets: the
    DMuon flag would win without a word ([bad-input-5]: ``--muon-coefficient-type cans
    --dmuon-coefficients keller`` ran keller); refused by name. Same sets under both names are fine.
    ``type_given``: whether --muon-coefficient-type was on the command line (None: where it differs
    from Megatron's default, which is all a parser's result tells)."""
    ours, theirs, steps = args.dmuon_coefficients, args.muon_coefficient_type, args.muon_num_ns_steps
    if type_given is None:
        type_given = theirs != megatron_flag_defaults()["muon_coefficient_type"]
    if ours is None or not type_given:
        return
    try:
        same = ours != ADAPTIVE_SCHEDULE and get_coefficients(ours, steps) == get_coefficients(
            muon_coefficients_for(theirs, steps), steps)
    except ValueError:  # (a schedule that does not exist at these steps: its own check names it)
        return
    if not same:
        raise ValueError(f"--dmuon-coefficients {ours} and --muon-coefficient-type {theirs} name different "
                         f"Newton-Schulz coefficients at --muon-num-ns-steps {steps} (the first would be used without "
                         "a word): drop one of the two")


def megatron_flag_defaults() -> dict:
    """{dest: default} of Megatron's --muon-* flags, as the table registers them."""
    return {kw.get("dest", flag[2:].replace("-", "_")): kw.get("default") for flag, kw in MEGATRON_MUON_FLAGS}


def megatron_muon_settings(**overrides) -> MuonSettings:
    """MuonSettings of Megatron-LM's `--optimizer muon` defaults (MuonSettings' own, which are the
    table's: tests/megatron/test_megatron_lm.py pins them together) and DMuon's `--dmuon-ns-method auto`,
    then ``overrides``."""
    return MuonSettings(**{"ns_method": "auto", **overrides})


def muon_coefficients_for(coefficient_type: str, steps: int):
    """Our schedule for Megatron's --muon-coefficient-type at --muon-num-ns-steps: the sets
    Emerging-Optimizers' newton_schulz applies, step for step (names where ours are the same)."""
    schedule = eo_schedule(coefficient_type, steps)  # refuses 'custom' and cubic5 at other step counts
    if coefficient_type == "simple":
        return "keller"
    if coefficient_type == "quintic" and steps <= len(YOU):
        return "you"
    return schedule


def megatron_muon_fields(cfg, tp_mode: str = "duplicated") -> dict:
    """OptimizerConfig `muon_*` fields under which Megatron's own Muon runs the rule of `cfg`
    (the `megatron_layerwise` baseline; `tp_mode` is Megatron's --muon-tp-mode, which DMuon itself
    does not need): the inverse of `DMuonConfig.from_args`."""
    m = cfg.muon
    coefficient_type = _megatron_coefficient_type(m.coefficients, m.ns_steps)
    precision = {dtype: name for name, dtype in MUON_FP32_MATMUL_PREC.items()}.get(m.ns_dtype)
    # (named one by one: the message speaks of what was asked, not of defaults the user never passed)
    missing = [what for what, lacking in (
        (f"the Newton-Schulz coefficients {m.coefficients!r} at {m.ns_steps} steps (--dmuon-coefficients "
         "polar_express is DMuon's own variant; Megatron's is --muon-coefficient-type polar_express)",
         coefficient_type is None),
        (f"NS precision {m.ns_dtype} (--muon-fp32-matmul-prec medium or high)", precision is None),
        ("--dmuon-split-heads", cfg.split_per_head), ("--dmuon-split-glu", cfg.split_glu)) if lacking]
    if missing:
        raise ValueError("--dmuon-mode megatron_layerwise runs Megatron's own Muon, which has no equivalent of "
                         + "; ".join(missing) + ": drop it, or use --dmuon-mode dmuon")
    return dict(muon_momentum=m.momentum, muon_nesterov=m.nesterov, muon_split_qkv=cfg.split_qkv,
                muon_scale_mode=m.scale_mode, muon_extra_scale_factor=m.extra_scale,
                muon_coefficient_type=coefficient_type, muon_num_ns_steps=m.ns_steps,
                muon_fp32_matmul_prec=precision, muon_tp_mode=tp_mode, muon_scalar_optimizer="adam")


def _megatron_coefficient_type(coefficients, steps: int):
    """The --muon-coefficient-type whose sets at ``steps`` are ``coefficients``' (None: no type)."""
    if coefficients == ADAPTIVE_SCHEDULE:
        return None
    ours = get_coefficients(coefficients, steps)
    for coefficient_type in MUON_COEFFICIENT_TYPES:
        try:
            if get_coefficients(muon_coefficients_for(coefficient_type, steps), steps) == ours:
                return coefficient_type
        except ValueError:  # (cubic5 at another step count)
            continue
    return None
