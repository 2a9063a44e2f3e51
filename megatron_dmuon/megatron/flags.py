"""DMuon's command-line flags and their parse-time checks.

`add_dmuon_args(parser)` registers the schema's flags (megatron/config.py ``DMUON_FLAGS``, and
Megatron's `--muon-*` ones of megatron_lm_flags.py where the parser lacks them) on any argparse parser
(the trainer's, Megatron-LM's through `megatron_dmuon.megatron.install()`, the Bridge launcher's);
with `validate`, parsing itself rejects every combination DMuon cannot run (`validate_dmuon_args`:
the config is built, which checks it, then what it needs of the rest of the run), naming the flag
and the fix.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from ..kernels.autotune import CACHE_ENV, AutotuneCache
from .config import DMUON_FLAGS, DMuonConfig, remember_config
from .config_checks import check_dmuon_config
from .flag_rows import Bounds, argparse_kwargs
from .hierarchy import check_two_level_config
from .megatron_lm_flags import MEGATRON_MUON_FLAGS, MUON_FLAG_HANDLING, UNKNOWN_MUON_FLAGS, megatron_muon_fields
from .modes import mode_traits


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
    defaults = DMuonConfig()
    missing = [row for row in MEGATRON_MUON_FLAGS if not _has(parser, row.name)]
    if missing:
        group = parser.add_argument_group("Muon (Megatron-LM's flags; same meaning under --optimizer dmuon)")
        for row in missing:
            group.add_argument(row.name, **argparse_kwargs(row, defaults))
    g = parser.add_argument_group("DMuon (owner-centric distributed Muon; docs/megatron_lm.md)")
    for row in DMUON_FLAGS:
        g.add_argument(row.name, **argparse_kwargs(row, defaults))
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
# Megatron-LM's optimizer numbers every run reads (the schema's own are checked where the config is built)
TRAINING_NUMBERS = (
    ("lr", Bounds(0.0, low_open=True, fix="the peak learning rate, e.g. 3e-4")),
    ("min_lr", Bounds(0.0, fix="0 decays to zero")),
    ("weight_decay", Bounds(0.0, fix="0 turns weight decay off")),
    ("clip_grad", Bounds(0.0, fix="0 turns clipping off")),
    ("adam_beta1", Bounds(0.0, 1.0, high_open=True)),
    ("adam_beta2", Bounds(0.0, 1.0, high_open=True)),
    ("adam_eps", Bounds(0.0, low_open=True, fix="e.g. 1e-8")),
    ("decoupled_lr", Bounds(0.0, low_open=True, fix="the peak lr of the embedding and output layer; leave it unset "
                                                    "for --lr")),
    ("decoupled_min_lr", Bounds(0.0, fix="0 decays to zero")),
)


def check_training_numbers(args) -> None:
    """The optimizer numbers every run reads (Megatron-LM's flags, our example's): finite and in
    range, so that nothing is accepted that would silently ruin or disable a run (a flag the parser
    does not have, or left at None, is not checked)."""
    for name, bounds in TRAINING_NUMBERS:
        bounds.check(f"--{name.replace('_', '-')}", getattr(args, name, None))
        if name == "min_lr":
            lr, min_lr = getattr(args, "lr", None), getattr(args, "min_lr", None)
            if lr is not None and min_lr is not None and min_lr > lr:
                raise ValueError(f"--min-lr ({min_lr}) must not exceed --lr ({lr})")
    dlr, dmin = getattr(args, "decoupled_lr", None), getattr(args, "decoupled_min_lr", None)
    if dlr is not None and dmin is not None and dmin > dlr:
        raise ValueError(f"--decoupled-min-lr ({dmin}) must not exceed --decoupled-lr ({dlr})")


class _FlagAutotuneCache(AutotuneCache):
    env = f"${CACHE_ENV} (or --dmuon-autotune-cache)"  # where a user of the flags points it


def check_cache_paths(args) -> None:
    """The caches DMuon writes (autotune, owner plans, NS profile) must be writable files of their
    own: a directory, an uncreatable path or a file that is not that cache (json_store: refused and
    left untouched) fails now, naming the cache and where it is set, instead of at the first write
    in the middle of start-up."""
    from ..planning.caches import PlanCache, ProfileCache, default_plan_cache_path, default_profile_cache_path

    caches = [_FlagAutotuneCache(getattr(args, "dmuon_autotune_cache", None)), PlanCache(default_plan_cache_path()),
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


def validate_dmuon_args(args, given: Optional[dict] = None) -> Optional[DMuonConfig]:
    """Parse-time checks of `--optimizer dmuon` (nothing for other optimizers): the flags map onto
    a valid DMuonConfig (checked as it is built) and the parallel / precision / optimizer combination
    is one DMuon runs. ``given``: the flags on the command line, where known (``DMuonConfig.from_args``).
    Returns the config; raises ValueError naming the flag and the fix."""
    if getattr(args, "optimizer", "dmuon") != "dmuon":
        return None
    check_training_numbers(args)
    cfg = remember_config(args, DMuonConfig.from_args(args, given))  # the one parse of the run (config_of)
    view = _ArgsView(args, cfg)
    check_dmuon_config(view, view, cfg, model_config=view)
    for flag in ("use_torch_fsdp2", "use_megatron_fsdp", "use_mup"):
        if getattr(args, flag, False):
            raise ValueError(f"--optimizer dmuon does not support --{flag.replace('_', '-')}; drop the flag")
    if cfg.publish_dtype != "param" and not getattr(args, "bf16", False):
        raise ValueError(f"--dmuon-publish-dtype {cfg.publish_dtype} needs --bf16: an fp32 param is its own optimizer "
                         "master, which the FP8 decode would overwrite; add --bf16 or drop the flag")
    refuse_flags_the_mode_does_not_read(args)
    if mode_traits(cfg.mode).megatron_muon:  # Megatron's own Muon must have this rule's --muon-* fields
        megatron_muon_fields(cfg)
    check_cache_paths(args)
    # the data-parallel size is known here under torchrun (WORLD_SIZE); else only at DDP build
    check_two_level_config(view, _data_parallel_size(args) or max(cfg.layout.ranks_per_node, 1),
                           cfg.layout.ranks_per_node)
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

    args = _flag_defaults()
    known = {row.dest for row in MEGATRON_MUON_FLAGS}
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
    cfg = DMuonConfig.from_args(args)
    refuse_flags_the_mode_does_not_read(args)
    return cfg
