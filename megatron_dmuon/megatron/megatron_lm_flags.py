"""Megatron-LM's own Muon flags (core_v0.19.0 and main, `--muon-*`) under `--optimizer dmuon`: their
rows (``MEGATRON_MUON_FLAGS``, Megatron's defaults, registered where a parser lacks them), how DMuon
treats each flag, and the mapping both ways: the flags -> ``MuonSettings`` fields, our schedule and NS
precision (``muon_settings_from_flags``, every refusal by the flag's name); a DMuonConfig -> the
OptimizerConfig fields Megatron's own Muon runs it with (``megatron_muon_fields``).

A launch that switches `--optimizer muon` to `--optimizer dmuon` gets the same update rule
(`docs/megatron_lm.md` has the flag-by-flag table).
"""
from __future__ import annotations

import torch

from ..algorithms.coefficients import YOU, get_coefficients
from ..algorithms.eo_coefficients import EO_COEFFICIENT_TYPES, FIXED_STEPS, UNRUNNABLE_TYPES, eo_schedule
from ..runtime.owner_step import ADAPTIVE_SCHEDULE, MuonSettings
from .flag_rows import Bounds, Flag
from .modes import mode_traits

# --muon-coefficient-type -> our schedule: every type Emerging-Optimizers 0.4.0 offers (NSCoeffT),
# its sets walked as its newton_schulz walks them (algorithms/eo_coefficients.py); 'custom' is refused.
MUON_COEFFICIENT_TYPES = EO_COEFFICIENT_TYPES
# --muon-fp32-matmul-prec -> NS compute dtype. Megatron's 'medium' casts the normalized matrix to
# bf16 for the iterations; 'high' keeps fp32 (TF32 matmuls there; full fp32 here).
MUON_FP32_MATMUL_PREC = {"medium": torch.bfloat16, "high": torch.float32}
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_SCALAR_OPTIMIZERS = ("adam",)
# Megatron's --muon-* flags with Megatron's defaults (the MuonSettings fields' own, where a row sets
# one); registered only where a parser lacks them. A row without a field is read by
# ``muon_settings_from_flags``.
MEGATRON_MUON_FLAGS = (
    Flag("--muon-momentum", "muon.momentum", "Muon momentum (Megatron's flag)",
         bounds=Bounds(0.0, 1.0, high_open=True, fix="0.95 with --muon-nesterov is the usual choice")),
    Flag("--muon-no-split-qkv", "split_qkv", "orthogonalize the fused QKV weight as one matrix (default: Q, K, V apart)",
         action="store_false", dest_name="muon_split_qkv"),
    Flag("--muon-nesterov", "muon.nesterov", "Nesterov momentum"),
    Flag("--muon-scale-mode", "muon.scale_mode", "per-matrix lr scale: spectral sqrt(max(r,c)), shape_scaling "
                                                 "sqrt(max(1,r/c)), unit_rms_norm sqrt(r/c), match_rms_adamw, none",
         type=str),
    Flag("--muon-fp32-matmul-prec", "muon.ns_dtype", "NS precision: medium = bf16, high = fp32",
         words=MUON_FP32_MATMUL_PREC, type=str),
    Flag("--muon-coefficient-type", None, "Newton-Schulz coefficients (Emerging-Optimizers' types, its sets and step "
                                          "order)", default="quintic", choices=MUON_COEFFICIENT_TYPES, type=str),
    Flag("--muon-num-ns-steps", "muon.ns_steps", "Newton-Schulz steps", bounds=Bounds(1, fix="Megatron's default is 5")),
    # Megatron-LM main's default (core_v0.19.0's is blockwise, which DMuon refuses under TP > 1)
    Flag("--muon-tp-mode", None, "TP-sharded matrices: DMuon always orthogonalizes the whole matrix "
                                 "(duplicated/distributed); blockwise is refused under TP > 1 except for "
                                 "--dmuon-mode megatron_layerwise, which hands it to Megatron's own Muon",
         default="duplicated", choices=MUON_TP_MODES, type=str),
    Flag("--muon-use-syrk", None, "Megatron's Triton SYRK kernel for the symmetric products of its NS (same math); "
                                  "DMuon's NS kernels compute their symmetric products as such already, so under "
                                  "--optimizer dmuon it changes nothing", action="store_true"),
    # Megatron-LM PR #6683 (LayerShardedMuon, --use-layer-sharding-muon): knobs of its NS homes in the TP x GTP
    # domain, read only there; DMuon batches every owner's same-shape stack and runs its shape groups on streams
    # of their own already, so under --optimizer dmuon they change nothing
    Flag("--muon-ns-batch-size", None, "Megatron's LayerShardedMuon (PR #6683): same-shape matrices per batched NS; "
                                       "DMuon batches whole same-shape stacks already, so under --optimizer dmuon it "
                                       "changes nothing", default=1, type=int),
    Flag("--muon-no-concurrent-groups", None, "Megatron's LayerShardedMuon (PR #6683): its param groups on one "
                                              "stream; under --optimizer dmuon it changes nothing",
         action="store_false", dest_name="muon_concurrent_groups"),
    Flag("--muon-extra-scale-factor", "muon.extra_scale", "extra factor on the Muon update",
         bounds=Bounds(0.0, low_open=True, fix="0 would freeze every Muon matrix and a negative factor ascends the "
                                               "loss; 0.2 with --muon-scale-mode spectral matches AdamW's update size")),
    Flag("--muon-scalar-optimizer", None, "optimizer of embeddings, output layer, norms, biases", default="adam",
         choices=MUON_SCALAR_OPTIMIZERS, type=str),
)

# How --optimizer dmuon treats every --muon-* flag of Megatron-LM's arguments.py (core_v0.19.0, main of
# 2026-08-22, and PR #6683's head c10c099); tests/megatron/test_megatron_lm.py fails on a tree's flag missing here. A
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
    "--muon-ns-batch-size": "accepted, changes nothing: Megatron's LayerShardedMuon batching (PR #6683, read only "
                            "with --use-layer-sharding-muon); DMuon batches every same-shape stack already",
    "--muon-no-concurrent-groups": "accepted, changes nothing: Megatron's LayerShardedMuon streams (PR #6683); "
                                   "DMuon runs its shape groups on streams of their own already",
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


def muon_settings_from_flags(args, tensor_parallel: int, given=None) -> dict:
    """The ``MuonSettings`` fields of Megatron's --muon-* flags (and of --dmuon-coefficients, DMuon's NS
    schedule instead of --muon-coefficient-type); a value DMuon cannot honour raises a ValueError
    naming the flag and the fix. ``given``: the dests on the command line where known (the main job;
    None: a flag at other than its default counts as given)."""
    refuse_unknown_muon_flags(args)
    refuse_disagreeing_coefficients(args, given)
    coefficients = args.dmuon_coefficients or muon_coefficients_for(args.muon_coefficient_type, args.muon_num_ns_steps)
    if args.muon_fp32_matmul_prec not in MUON_FP32_MATMUL_PREC:
        raise ValueError(
            f"--muon-fp32-matmul-prec {args.muon_fp32_matmul_prec!r} is not a torch matmul precision "
            "(torch ignores it); pass medium (bf16 Newton-Schulz, the default) or high (fp32)")
    if args.muon_scalar_optimizer not in MUON_SCALAR_OPTIMIZERS:
        raise ValueError(
            f"--muon-scalar-optimizer {args.muon_scalar_optimizer} is not supported by --optimizer dmuon "
            "(its element-wise params take AdamW on their owner shard); drop the flag or pass adam")
    if args.muon_tp_mode not in MUON_TP_MODES:
        raise ValueError(f"--muon-tp-mode {args.muon_tp_mode!r} unknown; valid: {', '.join(MUON_TP_MODES)}")
    if args.muon_tp_mode == "blockwise" and tensor_parallel > 1 and not mode_traits(args.dmuon_mode).megatron_muon:
        raise ValueError(
            "--muon-tp-mode blockwise (core_v0.19.0's default) orthogonalizes every TP shard on its own, so "
            "the update depends on the TP size (it is not Muon); --optimizer dmuon orthogonalizes whole "
            "matrices: pass --muon-tp-mode duplicated (same math as Megatron's duplicated/distributed)")
    fields = {row.path.split(".", 1)[1]: row.field_value(getattr(args, row.dest)) for row in MEGATRON_MUON_FLAGS
              if row.path and row.path.startswith("muon.")}
    return dict(fields, coefficients=coefficients)


def refuse_disagreeing_coefficients(args, given=None) -> None:
    """--dmuon-coefficients and --muon-coefficient-type both set, naming other Newton-Schulz sets: the
    DMuon flag would win without a word ([bad-input-5]: ``--muon-coefficient-type cans
    --dmuon-coefficients keller`` ran keller); refused by name. Same sets under both names are fine.
    ``given``: the dests on the command line (None: --muon-coefficient-type counts as given where it
    differs from Megatron's default, which is all a parser's result tells)."""
    ours, theirs, steps = args.dmuon_coefficients, args.muon_coefficient_type, args.muon_num_ns_steps
    row = next(r for r in MEGATRON_MUON_FLAGS if r.dest == "muon_coefficient_type")
    type_given = row.dest in given if given is not None else theirs != row.default
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


def megatron_muon_settings(**overrides) -> MuonSettings:
    """MuonSettings of Megatron-LM's `--optimizer muon` defaults (MuonSettings' own, which the table
    registers: tests/megatron/test_megatron_lm.py pins them together) and DMuon's `--dmuon-ns-method auto`,
    then ``overrides``."""
    return MuonSettings(**{"ns_method": "auto", **overrides})


def muon_coefficients_for(coefficient_type: str, steps: int):
    """Our schedule for Megatron's --muon-coefficient-type at --muon-num-ns-steps: the sets
    Emerging-Optimizers' newton_schulz applies, step for step (names where ours are the same).
    A type with no rule to match is refused by the flag's name ('custom'; cubic5 at other step counts)."""
    if coefficient_type in UNRUNNABLE_TYPES:
        raise ValueError(f"--muon-coefficient-type {coefficient_type}: {UNRUNNABLE_TYPES[coefficient_type]}; pass "
                         f"one of {', '.join(EO_COEFFICIENT_TYPES)}")
    if coefficient_type not in EO_COEFFICIENT_TYPES:
        raise ValueError(f"--muon-coefficient-type {coefficient_type!r} is not an Emerging-Optimizers coefficient "
                         f"type; valid: {', '.join(EO_COEFFICIENT_TYPES)}")
    fixed = FIXED_STEPS.get(coefficient_type)
    if fixed is not None and steps != fixed:
        raise ValueError(f"--muon-coefficient-type {coefficient_type} is a fixed {fixed}-step schedule (Emerging-"
                         f"Optimizers refuses --muon-num-ns-steps {steps} at the first step): pass "
                         f"--muon-num-ns-steps {fixed}")
    schedule = eo_schedule(coefficient_type, steps)
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


def megatron_ns_path(fields: dict) -> str:
    """In words, the NS Megatron's own Muon runs with ``megatron_muon_fields``' ``fields``."""
    return (f"Megatron's standard NS ({fields['muon_coefficient_type']}, {fields['muon_num_ns_steps']} steps, "
            f"fp32 matmul precision {fields['muon_fp32_matmul_prec']})")


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
