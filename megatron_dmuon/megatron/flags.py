"""DMuon's command-line flags and their parse-time checks.

`add_dmuon_args(parser)` registers the `--dmuon-*` flags (and Megatron's `--muon-*` ones where the
parser lacks them, megatron_lm_flags.py) on any argparse parser (the trainer's, or Megatron-LM's
through `megatron_dmuon.megatron.install()`); with `validate`, parsing itself rejects every
combination DMuon cannot run (`validate_dmuon_args`), naming the flag and the fix.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

from ..algorithms.coefficients import COEFFICIENT_SETS
from ..algorithms.dion3 import FRACTION_LR_MODES
from ..algorithms.flops import NS_METHODS
from ..kernels.autotune import CACHE_ENV
from ..planning.owner_layout import BALANCE, DP_LAYOUTS
from ..planning.startup_budget import STARTUP_BUDGET_S
from ..planning.tp_cost import TP_METHODS
from ..planning.overlap_mode import OVERLAP_STEP_MODES
from ..runtime.owner_step import ADAPTIVE_SCHEDULE, NS_LAUNCH_MODES
from ..runtime.row_update_step import UPDATE_RULES
from .config_checks import check_dmuon_config
from .config import DEFAULT_DION3_FRACTION, MOMENTUM_DTYPES, DMuonConfig, remember_config
from .modes import MODE_TRAITS, MODES, mode_traits
from .hierarchy import check_two_level_config
from .megatron_lm_flags import UNKNOWN_MUON_FLAGS, MEGATRON_MUON_FLAGS, MUON_FLAG_HANDLING, megatron_muon_fields
from .publish import PUBLISH_DTYPES


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
    UNKNOWN_MUON_FLAGS.clear()
    UNKNOWN_MUON_FLAGS.update({action.dest: (flag, action.default)
                                for flag, action in parser._option_string_actions.items()
                                if flag.startswith("--muon-") and flag not in MUON_FLAG_HANDLING})
    missing = [(flag, kw) for flag, kw in MEGATRON_MUON_FLAGS if not _has(parser, flag)]
    if missing:
        group = parser.add_argument_group("Muon (Megatron-LM's flags; same meaning under --optimizer dmuon)")
        for flag, kw in missing:
            group.add_argument(flag, **kw)
    g = parser.add_argument_group("DMuon (owner-centric distributed Muon; docs/megatron_lm.md)")
    g.add_argument("--dmuon-mode", default="dmuon", choices=MODES,
                   help="; ".join(f"{t.name}: {t.help}" for t in MODE_TRAITS.values()))
    g.add_argument("--dmuon-ns-method", default="auto", choices=NS_METHODS,
                   help="Newton-Schulz variant: standard, gram (in the small Gram space; a 16-bit "
                        "--muon-fp32-matmul-prec runs it in fp16, where it is stable, not bf16), auto (the "
                        "kernels' measured fastest per shape; standard off CUDA)")
    g.add_argument("--dmuon-coefficients", default=None, choices=COEFFICIENT_SETS + (ADAPTIVE_SCHEDULE,),
                   help="DMuon's NS schedule instead of --muon-coefficient-type (adaptive: per shape, "
                        "the tighter ||(XX^T)^2||^(1/4) normalisation with 4 designed steps for aspect >= 2, "
                        "5 for nearer-square matrices; polar_express: DMuon's own, the published sets at full "
                        "precision, not Megatron's --muon-coefficient-type polar_express)")
    g.add_argument("--dmuon-ns-launch", default="eager", choices=NS_LAUNCH_MODES,
                   help="GPU: the owner's per-shape NS calls one by one, on concurrent streams, or as one CUDA graph")
    g.add_argument("--dmuon-overlap-step", default="off", choices=OVERLAP_STEP_MODES,
                   help="on: each bucket group's Newton-Schulz runs on a side stream after optimizer.step() returns "
                        "and finishes when the next forward first needs its params (needs --overlap-param-gather); "
                        "sync: the same per-bucket-group stacks inside the step (bit-identical to on, for checking); "
                        "backward: on, and each group's momentum and NS start in the last backward when its grad "
                        "reduce is launched, redone in the step when clipping fires (needs --overlap-grad-reduce; "
                        "CPU-verified only)")
    g.add_argument("--dmuon-tp-method", default="auto", choices=TP_METHODS,
                   help="TP-sharded matrices: gather to the TP owner, distributed Gram NS, or auto (cost model)")
    g.add_argument("--dmuon-balance", default="cost", choices=BALANCE,
                   help="owner assignment: cost (greedy on predicted NS time), milp (the owner step profiled on this "
                        "GPU, then an MILP on that rank cost model; both cached), numel_lpt, megatron_lpt (max·min², Megatron main's layer-sharded "
                        "Muon) or round_robin (baselines)")
    g.add_argument("--dmuon-dp-layout", default="auto", choices=DP_LAYOUTS,
                   help="how Muon matrices lie in the DP shards: whole (each inside its owner's shard; pads the "
                        "shards once DP nears the matrix count), split (Megatron's own equal shards cut matrices, "
                        "each keeps its pieces' state and one NS home per matrix; AdamW's bytes at any DP), auto "
                        "(the planner's cost model picks per buffer; docs/dmuon_dp.md)")
    g.add_argument("--dmuon-plan-budget", type=float, default=STARTUP_BUDGET_S, metavar="SECONDS",
                   help="--dmuon-balance milp: start-up seconds for the rank profile + the MILP on rank 0 "
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
    _number_check(args, "decoupled_lr", 0.0, low_open=True,
                  fix="the peak lr of the embedding and output layer; leave it unset for --lr")
    _number_check(args, "decoupled_min_lr", 0.0, fix="0 decays to zero")
    dlr, dmin = getattr(args, "decoupled_lr", None), getattr(args, "decoupled_min_lr", None)
    if dlr is not None and dmin is not None and dmin > dlr:
        raise ValueError(f"--decoupled-min-lr ({dmin}) must not exceed --decoupled-lr ({dlr})")


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
    """The caches DMuon writes (autotune, owner plans, NS profile) must be writable files of their
    own: a directory, an uncreatable path or a file that is not that cache (json_store: refused and
    left untouched) fails now, naming the cache and where it is set, instead of at the first write
    in the middle of start-up."""
    from ..kernels.autotune import AutotuneCache
    from ..planning.caches import PlanCache, ProfileCache, default_plan_cache_path, default_profile_cache_path

    caches = [AutotuneCache(getattr(args, "dmuon_autotune_cache", None)), PlanCache(default_plan_cache_path()),
              ProfileCache(default_profile_cache_path())]
    for cache in caches:
        cache.check_writable()


class _ArgsView:
    """Parsed args seen as OptimizerConfig / DDP config / model config (Megatron-LM's flags have
    those fields' names). A flag the parser does not have reads as the value DMuon needs: the
    program sets it itself, as our example does; other missing flags read as None (off)."""

    def __init__(self, args, cfg: DMuonConfig):
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        self._args = args
        self._derived = dict(
            use_distributed_optimizer=get("use_distributed_optimizer", not mode_traits(cfg.mode).all_reduces),
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
    cfg = remember_config(args, DMuonConfig.from_args(args))  # the one parse of the run (config_of)
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
    refuse_flags_the_mode_does_not_read(args)
    if mode_traits(cfg.mode).megatron_muon:  # Megatron's own Muon must have this rule's --muon-* fields
        megatron_muon_fields(cfg)
    check_cache_paths(args)
    # the data-parallel size is known here under torchrun (WORLD_SIZE); else only at DDP build
    check_two_level_config(view, _data_parallel_size(args) or max(args.dmuon_ranks_per_node, 1),
                           args.dmuon_ranks_per_node)
    return cfg


def _flag_defaults() -> argparse.Namespace:
    """Every DMuon and Megatron Muon flag at its default (an empty command line)."""
    saved = dict(UNKNOWN_MUON_FLAGS)  # (add_dmuon_args resets the table for its own parser)
    try:
        return add_dmuon_args(argparse.ArgumentParser(add_help=False), validate=False).parse_args([])
    finally:
        UNKNOWN_MUON_FLAGS.clear()
        UNKNOWN_MUON_FLAGS.update(saved)


def refuse_flags_the_mode_does_not_read(args) -> None:
    """ValueError naming a --dmuon-* flag the chosen --dmuon-mode does not read (modes.py
    ``dmuon_flags``) set to other than its default, or than what the mode runs anyway (``runs_as``): the
    run would silently not do what it asks."""
    traits = mode_traits(args.dmuon_mode)
    if traits.dmuon_flags is None:
        return
    runs_as = dict(traits.runs_as)
    for dest, default in sorted(vars(_flag_defaults()).items()):
        value = getattr(args, dest, default)
        if dest.startswith("dmuon_") and dest not in traits.dmuon_flags \
                and value not in (default, runs_as.get(dest, default)):
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag}{'' if isinstance(value, bool) else f' {value}'} has no effect under --dmuon-mode "
                             f"{traits.name} ({traits.help}, which does not read it): drop it, or use --dmuon-mode dmuon")


def dmuon_config_from_fields(optimizer_config, tensor_parallel_size: int = 1, **options) -> DMuonConfig:
    """DMuon's config for a megatron-core ``OptimizerConfig`` that carries Megatron's ``muon_*``
    fields (Megatron-Bridge's recipes set them): each keeps the meaning its ``--muon-*`` flag has,
    as under Megatron-LM's hook. ``options`` are DMuon's own, named as their flag without
    ``--dmuon-`` (``ns_launch="graph"``, ``balance="milp"``); unset ones take the flags' defaults.
    A ``muon_*`` field DMuon does not know, set to other than its default, is refused by name."""
    import dataclasses

    from .megatron_lm_flags import megatron_flag_defaults

    args = _flag_defaults()
    known = megatron_flag_defaults()
    for field in dataclasses.fields(optimizer_config):
        if not field.name.startswith("muon_"):
            continue
        value = getattr(optimizer_config, field.name)
        if field.name in known:
            setattr(args, field.name, value)
        elif value != field.default:
            raise ValueError(f"--{field.name.replace('_', '-')} {value!r} is a Muon setting --optimizer dmuon does "
                             "not know (megatron/megatron_lm_flags.py MUON_FLAG_HANDLING), so it would be ignored: "
                             "leave it at its default, or train with Megatron's own Muon")
    for name, value in options.items():
        if not hasattr(args, f"dmuon_{name}"):
            valid = sorted(k[len("dmuon_"):] for k in vars(args) if k.startswith("dmuon_"))
            raise TypeError(f"unknown DMuon option {name!r}; valid: {', '.join(valid)}")
        setattr(args, f"dmuon_{name}", value)
    args.optimizer, args.tensor_model_parallel_size = "dmuon", tensor_parallel_size
    check_muon_numbers(args)
    cfg = DMuonConfig.from_args(args)
    refuse_flags_the_mode_does_not_read(args)
    return cfg
