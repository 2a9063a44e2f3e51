"""DMuon's configuration: one typed, frozen schema, checked once, where a config is built.

Sections, one frozen dataclass each, a docstring under every field, every choice a ``Literal`` of
the layer that acts on it:

* ``DMuonConfig``: the run (mode, how matrices are cut, FP8 publish, ...), with the sections
* ``muon``: ``runtime.muon_settings.MuonSettings``, how the owners run Muon, and
* ``layout``: ``LayoutOptions``, how the DDP lays out buffers and places owners.

``DMuonConfig()`` equals what an empty command line gives (Megatron-LM's Muon defaults plus DMuon's
own), so the Python API, the trainer and a Megatron-LM launch share one set of defaults.

The command line is derived from the schema: ``DMUON_FLAGS`` has a row per ``--dmuon-*`` flag naming
the field it sets (megatron/flag_rows.py; argparse's choices are the field's Literal, its default the
field's), as Megatron-LM's ``--muon-*`` flags have theirs in megatron_lm_flags.py; megatron/flags.py
registers both on a parser. The check (``DMuonConfig.__post_init__``, in the flags' words) runs when a
config is built; nothing below this package checks it again. A config is built

* from flags: ``DMuonConfig.from_args(args)`` (once per run: ``config_of``);
* from fields: ``flags.dmuon_config_from_fields`` (a Megatron-Bridge OptimizerConfig);
* from code: ``DMuonConfig(...)``, and ``with_overrides(cfg, {...})`` for DMuonDDP's keyword options.

What each ``--dmuon-mode`` needs: modes.py.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import torch

from ..algorithms.coefficients import COEFFICIENT_SETS, get_coefficients
from ..algorithms.muon import LR_SCALE_MODES, MOMENTUM_DTYPES
from ..algorithms.dion3 import FRACTION_LR_MODES
from ..algorithms.flops import NS_METHODS
from ..algorithms.update_rule import UPDATE_RULES, UpdateRule
from ..kernels.autotune import CACHE_ENV
from ..planning.caches import default_plan_cache_path
from ..planning.split_layout import NS_TEAMS, NsTeams, shares_ns
from ..planning.owner_layout import BALANCE, DEFAULT_BALANCE, DP_LAYOUTS, Balance, BalanceMethod, DpLayout
from ..planning.owner_planning import OwnerPlanningOptions
from ..planning.overlap_mode import OVERLAP_STEP_MODES, OverlapMode
from ..planning.startup_budget import STARTUP_BUDGET_S
from ..planning.tp_cost import TP_METHODS
from ..runtime.muon_settings import ADAPTIVE_SCHEDULE, NS_LAUNCH_MODES, MuonSettings
from .config_checks import tensor_parallel_size
from .flag_rows import Bounds, Flag
from .modes import MODE_TRAITS, MODES, mode_traits, modes_training  # noqa: F401 (MODES: public API)
from .megatron_lm_flags import MEGATRON_MUON_FLAGS, megatron_muon_settings, muon_settings_from_flags
from .publish import PUBLISH_DTYPES, PublishDtype


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """How the DDP lays out buffers and places owners (the plan's inputs beyond the Muon settings)."""

    ranks_per_node: int = 0
    """> 0: two-level (intra-node, then inter-node) grad reduce / param publish with this many ranks
    per node, owners striped over the nodes."""
    balance: Balance = DEFAULT_BALANCE
    """How owners are placed (planning/owner_layout.py ``BalanceMethod``)."""
    dp_layout: DpLayout = "auto"
    """How matrices lie in the DP shards: 'whole' (owner_layout.py), 'split' (split_layout.py), 'auto'
    (the planner's cost model, per buffer, among the schemes the run can take)."""
    megabatch: bool = False
    """One bucket per buffer even with --overlap-grad-reduce: every same-shape group is reduced and
    published by the buffer's one collective (docs/dion3.md)."""
    max_bucket_padding: float = 0.02
    """Largest share of padding a bucket of owner-aligned shards may add before it grows."""
    profile: bool = False
    """Profile the owner step on this GPU at start-up (runtime/rank_profile.py) for a rank cost model,
    which the rank MILP plans on (balance 'milp' from the flags sets it)."""
    plan_budget_s: Optional[float] = None
    """Start-up seconds for the profile and the MILP together, on rank 0 (None: the MILP's own limit)."""
    plan_cache: Optional[str] = None
    """A plan cache file: a plan made for the same inputs is reused (planning/caches.py)."""
    milp_options: Optional[dict] = None
    """The MILPs' options (backend, time_limit_s, ...)."""
    elementwise: object = "auto"
    """(AdamW, Muon) work per element in the planner's units, 'auto' (the cluster config's) or None."""
    ns_teams: NsTeams = "off"
    """'auto': the split layout may share a large matrix's NS over a team of homes on several nodes, where the
    planner's cost model finds it better (planning/split_layout.py); 'off': one home per matrix."""
    cost_fn: Optional[Callable] = dataclasses.field(default=None, compare=False)
    """Planner input for experiments and tests: cost_fn(piece shape) -> NS cost of one piece (None:
    ``planning.ns_choice.owner_ns_cost`` under the run's Muon settings)."""
    cost_model_fn: Optional[Callable] = dataclasses.field(default=None, compare=False)
    """Planner input for experiments and tests: cost_model_fn(shapes, max_batch) -> a per-matrix
    ``planning.cost_model.CostModel`` or a ``RankCostModel``."""

    def planning_options(self, split_allowed: bool = True, overlapped_step: bool = False,
                         shared_ns: bool = False) -> OwnerPlanningOptions:
        """What rank 0's owner planning reads of these options (planning/owner_planning.py, same names)."""
        given = dict(split_allowed=split_allowed, overlapped_step=overlapped_step, shared_ns=shared_ns)
        return OwnerPlanningOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(OwnerPlanningOptions)
                                       if hasattr(self, f.name) and f.name not in given}, **given)


@dataclasses.dataclass(frozen=True)
class DMuonConfig:
    """Everything DMuon's DDP plans with and its optimizer reads. Defaults = Megatron-LM's Muon
    defaults + DMuon's own (`--dmuon-ns-method auto`: the kernels' measured fastest NS per shape).
    Checked when built (``__post_init__``): a value DMuon cannot run raises a ValueError naming the
    flag and the fix."""

    mode: str = "dmuon"
    """What runs the matrices (modes.py ``MODES``): DMuon's owners, or a baseline."""
    muon: MuonSettings = dataclasses.field(default_factory=megatron_muon_settings)
    """How the owners run Muon."""
    split_qkv: bool = True
    """Orthogonalize Q, K and V apart (Megatron's default; per GQA group)."""
    split_per_head: bool = False
    """Orthogonalize every attention head apart."""
    split_glu: bool = False
    """Orthogonalize SwiGLU's gate and up apart."""
    autotune_cache: Optional[str] = None
    """The kernels' autotune JSON (None: $DMUON_AUTOTUNE_CACHE, else the default path)."""
    skip_nonfinite: bool = True
    """Skip a step whose gradients hold NaN/Inf on every rank (no loss scaler needed, e.g. bf16)."""
    publish_dtype: PublishDtype = "param"
    """How Megatron's param all-gather publishes Muon matrices: 'param' (the model's dtype), or
    owner-quantized FP8 bytes + a per-tensor scale (megatron/publish.py; the DDP plans with it)."""
    fold_clipping: bool = True
    """Clipping applied inside the owner step (the same coefficient and roundings as Megatron's
    separate pass; False: Megatron's pass, which the tests compare it with)."""
    layout: LayoutOptions = dataclasses.field(default_factory=LayoutOptions)
    """How the DDP lays out buffers and places owners."""

    def __post_init__(self):
        check_config(self)

    def split_layout_refusal(self) -> Optional[str]:
        """Why this config cannot run the split layout (planning/split_layout.py), naming the flag that
        needs whole matrices on their owner (None: it can; 'auto' then weighs it)."""
        m = self.muon
        if m.rule.by_rows:
            return f"does not run --dmuon-update {m.update} (its row statistics need each matrix whole on one rank)"
        if OverlapMode(m.overlap_step).starts_in_backward:
            return (f"does not run --dmuon-overlap-step {m.overlap_step} (its groups start in the backward's "
                    "grad-reduce hooks, where the exchange to the NS homes is not built; --dmuon-overlap-step on runs)")
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
                "megabatch": self.layout.megabatch, "dp_layout": self.layout.dp_layout,
                **({"ns_teams": self.layout.ns_teams} if self.layout.ns_teams != "off" else {})}

    def split_flags(self) -> dict:
        """``rule_for_megatron_param``'s split flags: how the optimizer cuts matrices before NS."""
        return dict(split_qkv=self.split_qkv, split_glu=self.split_glu, per_head=self.split_per_head)

    @classmethod
    def from_args(cls, args, given: Optional[dict] = None) -> "DMuonConfig":
        """The config of parsed flags (megatron/flags.py ``add_dmuon_args``); a value DMuon cannot honour
        raises a ValueError naming the flag and the fix. ``given``: the dests on the command line, where
        known (the main job): a flag given that the config does not read (``unread_flags``) is refused."""
        values = {"muon": muon_settings_from_flags(args, tensor_parallel_size(args), given), "layout": {}}
        for row in DMUON_FLAGS:
            if row.path:
                *section, name = row.path.split(".")
                (values[section[0]] if section else values)[name] = row.field_value(getattr(args, row.dest))
        muon, layout = values.pop("muon"), values.pop("layout")
        muon["fraction"] = args.dmuon_fraction if args.dmuon_fraction is not None else \
            UpdateRule(muon["update"]).default_fraction if muon["update"] in UPDATE_RULES else 1.0
        _row("--dmuon-plan-budget").check(args.dmuon_plan_budget)
        if layout["balance"] in BALANCE and BalanceMethod(layout["balance"]).profiles:
            layout.update(profile=True, plan_budget_s=args.dmuon_plan_budget, plan_cache=default_plan_cache_path())
        values["split_qkv"] = args.muon_split_qkv or args.dmuon_split_heads
        cfg = cls(muon=megatron_muon_settings(**muon), layout=LayoutOptions(**layout), **values)
        for dest, why in unread_flags(cfg).items():
            if given is not None and dest in given:
                raise ValueError(f"{given[dest]} has no effect {why}: drop it")
        return cfg


def _row(name: str) -> Flag:
    return next(row for row in DMUON_FLAGS + MEGATRON_MUON_FLAGS if row.name == name)


# the number fields and the flags whose ranges they take
NUMBER_FIELDS = {"muon.momentum": "--muon-momentum", "muon.extra_scale": "--muon-extra-scale-factor",
                 "muon.ns_steps": "--muon-num-ns-steps", "muon.fraction": "--dmuon-fraction",
                 "muon.row_beta2": "--dmuon-normuon-beta2", "muon.ns_check_interval": "--dmuon-ns-check-interval",
                 "muon.ns_check_bound": "--dmuon-ns-check-bound", "layout.ranks_per_node": "--dmuon-ranks-per-node"}


# ------------------------------------------------------------------------------------ the flags
# DMuon's flags, in the order --help lists them (a field's choices and default are the field's)
DMUON_FLAGS = (
    Flag("--dmuon-mode", "mode", "; ".join(f"{t.name}: {t.help}" for t in MODE_TRAITS.values()), choices=MODES),
    Flag("--dmuon-ns-method", "muon.ns_method",
         "Newton-Schulz variant: standard, gram (in the small Gram space; a 16-bit --muon-fp32-matmul-prec runs it "
         "in fp16, where it is stable, not bf16), auto (the kernels' measured fastest per shape; standard off CUDA)"),
    Flag("--dmuon-coefficients", None,
         "DMuon's NS schedule instead of --muon-coefficient-type (adaptive: per shape, the tighter ||(XX^T)^2||^(1/4) "
         "normalisation with 4 designed steps for aspect >= 2, 5 for nearer-square matrices; polar_express: DMuon's "
         "own, the published sets at full precision, not Megatron's --muon-coefficient-type polar_express)",
         default=None, choices=COEFFICIENT_SETS + (ADAPTIVE_SCHEDULE,)),
    Flag("--dmuon-ns-launch", "muon.ns_launch",
         "GPU: the owner's per-shape NS calls one by one, on concurrent streams, or as one CUDA graph"),
    Flag("--dmuon-overlap-step", "muon.overlap_step",
         "on: each bucket group's Newton-Schulz runs on a side stream after optimizer.step() returns and finishes "
         "when the next forward first needs its params (needs --overlap-param-gather); sync: the same per-bucket-group "
         "stacks inside the step (bit-identical to on, for checking); backward: on, and each group's momentum and NS "
         "start in the last backward when its grad reduce is launched, redone in the step when clipping fires (needs "
         "--overlap-grad-reduce; CPU-verified only)"),
    Flag("--dmuon-tp-method", "muon.tp_method",
         "TP-sharded matrices: gather to the TP owner, distributed Gram NS, or auto (cost model)"),
    Flag("--dmuon-balance", "layout.balance",
         "owner assignment: cost (greedy on predicted NS time), milp (the owner step profiled on this GPU, then an MILP "
         "on that rank cost model; both cached), numel_lpt, megatron_lpt (max·min², Megatron main's layer-sharded "
         "Muon) or round_robin (baselines)"),
    Flag("--dmuon-dp-layout", "layout.dp_layout",
         "how Muon matrices lie in the DP shards: whole (each inside its owner's shard; pads the shards once DP nears "
         "the matrix count), split (Megatron's own equal shards cut matrices, each keeps its pieces' state and one NS "
         "home per matrix; AdamW's bytes at any DP), auto (the planner's cost model picks per buffer; "
         "docs/dmuon_dp.md)"),
    Flag("--dmuon-ns-teams", "layout.ns_teams",
         "split layout: auto lets one large matrix's NS be shared by a team of homes on several nodes (each gathers "
         "its block from its own nodes; distributed Gram NS; the planner's cost model picks the matrices and team "
         "sizes; needs "
         "--dmuon-ns-method gram or auto and a synchronous step), off keeps one home per matrix (docs/dmuon_dp.md)"),
    Flag("--dmuon-plan-budget", None,
         "--dmuon-balance milp: start-up seconds for the rank profile + the MILP on rank 0 (the best plan found by "
         "then is used; cached plans cost nothing)",
         default=STARTUP_BUDGET_S, type=float, metavar="SECONDS",
         bounds=Bounds(0.0, low_open=True, fix=f"default {STARTUP_BUDGET_S:g} s")),
    Flag("--dmuon-ranks-per-node", "layout.ranks_per_node",
         "> 0: two-level (intra-node, then inter-node) grad reduce / param publish with this many ranks per node "
         "(pass the GPUs per node)", bounds=Bounds(0, fix="0 turns the two-level reduce/publish off")),
    Flag("--dmuon-update", "muon.update",
         "the owners' update rule: muon; normuon (row-normalized Muon); dion3 (top --dmuon-fraction rows by L1 norm, "
         "error feedback, NorMuon normalization); docs/dion3.md"),
    Flag("--dmuon-fraction", None,
         f"--dmuon-update dion3: share of each matrix's rows orthogonalized per step, in (0, 1] (default "
         f"{MuonSettings(update='dion3').rule.default_fraction}; 1 = NorMuon)",
         default=None, type=float, metavar="F",
         bounds=Bounds(0.0, 1.0, low_open=True, fix="the share of rows Dion3 orthogonalizes")),
    Flag("--dmuon-fraction-lr", "muon.fraction_lr",
         "dion3: lr factor for the fraction: none (NorDion2's) or inverse_sqrt (1/sqrt(F))"),
    Flag("--dmuon-normuon-beta2", "muon.row_beta2", "normuon/dion3: decay of the per-row second moment",
         bounds=Bounds(0.0, 1.0, high_open=True)),
    Flag("--dmuon-megabatch", "layout.megabatch",
         "one grad reduce-scatter and one param all-gather per buffer per step whatever the layer count (no "
         "per-bucket overlap with backward); owners run one batched NS per shape"),
    Flag("--dmuon-split-heads", "split_per_head", "orthogonalize every attention head apart"),
    Flag("--dmuon-split-glu", "split_glu", "orthogonalize SwiGLU gate and up apart"),
    Flag("--dmuon-autotune-cache", "autotune_cache",
         f"the kernels' autotune cache file (default ${CACHE_ENV}, else ~/.cache/megatron_dmuon/autotune.json)",
         metavar="PATH"),
    Flag("--dmuon-publish-dtype", "publish_dtype",
         "param all-gather of Muon matrices: the model's dtype, or FP8 bytes the owner quantizes from its fp32 master "
         "with a per-tensor scale (needs --bf16; docs/mixed_precision.md)"),
    Flag("--dmuon-momentum-dtype", "muon.momentum_dtype",
         "dtype of the owners' Muon momentum (bf16 halves it; accuracy cost in docs/mixed_precision.md)",
         words=MOMENTUM_DTYPES),
    Flag("--dmuon-ns-check-interval", "muon.ns_check_interval",
         "online NS quality: every STEPS optimizer steps each owner estimates top-eig(O^T O - I) of its NS outputs "
         "(random probes), recomputes those above --dmuon-ns-check-bound exactly (fp32) and logs the worst; 0: off",
         metavar="STEPS", bounds=Bounds(0, fix="0 turns the check off")),
    Flag("--dmuon-ns-check-bound", "muon.ns_check_bound",
         "the check's bound on top-eig(O^T O - I) (default: (1.25 x the largest singular value the NS schedule gives "
         "in exact arithmetic)^2 - 1, e.g. 1.05 for Megatron's quintic)", type=float, metavar="B",
         bounds=Bounds(0.0, low_open=True, fix="leave it unset for the per-schedule bound")),
    Flag("--dmuon-no-skip-nonfinite", "skip_nonfinite",
         "do not skip a step whose gradients hold NaN/Inf (skipped on every rank by default)", negates=True),
)


def unread_flags(cfg: DMuonConfig) -> dict:
    """{dest: why} of the flags ``cfg`` does not read (a value given for one is a mistake the user
    should hear of: the main job refuses it by name, ``from_args``)."""
    m = cfg.muon
    out = {}
    if not cfg.layout.profile:
        out["dmuon_plan_budget"] = "without --dmuon-balance milp (it bounds that balance's start-up profiling and MILP)"
    if not m.rule.by_rows:
        out["dmuon_normuon_beta2"] = f"under --dmuon-update {m.update} (the second-moment decay of --dmuon-update " \
                                     "normuon|dion3)"
    if not m.rule.selects_fraction:
        out["dmuon_fraction_lr"] = f"under --dmuon-update {m.update} (Dion3's lr factor: --dmuon-update dion3)"
    if not m.ns_check_interval:
        out["dmuon_ns_check_bound"] = "with --dmuon-ns-check-interval 0 (the check is off)"
    return out



# fields ``from_args`` sets from a flag itself (the flag's row has no path)
BUILT_FIELDS = {"layout.plan_budget_s": "--dmuon-plan-budget", "muon.coefficients": "--dmuon-coefficients"}
FIELD_IN_TEXT = re.compile(r"`((?:muon|layout)\.\w+|\w+)(?:=([\w.-]+))?`")


def in_flag_words(text: str) -> str:
    """``text`` from a layer below megatron/ (which names config fields, in backticks: `layout.balance`,
    `layout.balance=cost`) in the words of the flags that set them (``--dmuon-balance cost``), for a
    user of the command line; a field no flag sets is left as written."""
    flags = {**{row.path: row.name for row in DMUON_FLAGS if row.path}, **NUMBER_FIELDS, **BUILT_FIELDS}

    def word(match):
        flag = flags.get(match.group(1))
        if flag is None:
            return match.group(0)
        return flag if match.group(2) is None else f"{flag} {match.group(2)}"

    return FIELD_IN_TEXT.sub(word, text)


# --------------------------------------------------------------------------- the one check
def _choice(flag: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(f"{flag} {value!r} unknown; valid: {', '.join(valid)}")


def check_config(cfg: DMuonConfig) -> None:
    """Every value of ``cfg`` DMuon runs, checked once (``DMuonConfig.__post_init__``); a ValueError
    names the flag and the fix."""
    m, layout = cfg.muon, cfg.layout
    for path, flag in NUMBER_FIELDS.items():
        section, name = path.split(".")
        _row(flag).check(getattr(getattr(cfg, section), name))
    interval = m.ns_check_interval
    if isinstance(interval, bool) or not isinstance(interval, int):
        raise ValueError(f"--dmuon-ns-check-interval {interval!r} must be an integer >= 0 (0 turns the check off)")
    _check_layout(layout)
    traits = mode_traits(cfg.mode)
    _choice("--dmuon-publish-dtype", cfg.publish_dtype, PUBLISH_DTYPES)
    if cfg.publish_dtype != "param" and not traits.owner_step:
        raise ValueError(f"--dmuon-publish-dtype {cfg.publish_dtype} needs --dmuon-mode dmuon (the owners quantize); "
                         f"--dmuon-mode {cfg.mode} publishes nothing of its own")
    if cfg.publish_dtype != "param" and layout.ranks_per_node:
        raise ValueError(f"--dmuon-publish-dtype {cfg.publish_dtype} is not implemented with the two-level publish: "
                         "drop --dmuon-ranks-per-node or use --dmuon-publish-dtype param")
    _check_muon(m)
    if layout.ns_teams != "off" and not shares_ns(m.ns_method, False):
        raise ValueError(f"--dmuon-ns-teams {layout.ns_teams}: a team runs distributed Gram NS; --dmuon-ns-method "
                         f"{m.ns_method} asks for another: pass --dmuon-ns-method gram or auto, or drop --dmuon-ns-teams")
    if layout.ns_teams != "off" and OverlapMode(m.overlap_step).cuts_per_need_group:
        raise ValueError(f"--dmuon-ns-teams {layout.ns_teams} runs in the synchronous step only; --dmuon-overlap-step "
                         f"{m.overlap_step} overlaps it: drop one of the two flags")
    if traits.updates is not None and m.update not in traits.updates:
        first, *others = modes_training(m.update)
        why = " runs Megatron's own Muon" if traits.megatron_muon else f" trains {', '.join(traits.updates)} only"
        raise ValueError(f"--dmuon-mode {cfg.mode}{why}; --dmuon-update {m.update} needs --dmuon-mode "
                         f"{first}" + (f" (or {', '.join(others)})" if others else ""))
    refusal = cfg.split_layout_refusal()
    if layout.dp_layout == "split" and refusal:
        raise ValueError(f"--dmuon-dp-layout split {refusal}: drop one of the two flags (or pass "
                         "--dmuon-dp-layout auto, which keeps whole matrices for such runs)")


def _check_layout(layout: LayoutOptions) -> None:
    _choice("--dmuon-balance", layout.balance, BALANCE)
    _choice("--dmuon-dp-layout", layout.dp_layout, DP_LAYOUTS)
    _choice("--dmuon-ns-teams", layout.ns_teams, NS_TEAMS)
    if layout.ns_teams != "off" and layout.dp_layout == "whole":
        raise ValueError(f"--dmuon-ns-teams {layout.ns_teams} shares NS homes of the split layout; --dmuon-dp-layout "
                         "whole has none: drop one of the two flags")
    if layout.dp_layout == "split" and layout.balance != DEFAULT_BALANCE:
        raise ValueError(f"--dmuon-dp-layout split places NS homes by its own greedy; --dmuon-balance "
                         f"{layout.balance} places whole matrices: drop one of the two flags")


def _check_muon(m: MuonSettings) -> None:
    """The Muon settings' values, in the words of their flags."""
    _choice("--dmuon-update", m.update, UPDATE_RULES)
    rule = m.rule
    if not rule.selects_fraction and m.fraction != 1.0:
        raise ValueError(f"--dmuon-fraction {m.fraction} applies to --dmuon-update dion3 only (got --dmuon-update "
                         f"{m.update}): drop --dmuon-fraction or pass --dmuon-update dion3")
    _choice("--dmuon-fraction-lr", m.fraction_lr, FRACTION_LR_MODES)
    if rule.by_rows and m.momentum_dtype == torch.bfloat16:
        raise ValueError(f"--dmuon-momentum-dtype bf16 is built for --dmuon-update muon only (the {m.update} "
                         "owner step keeps its momentum in the param dtype): drop --dmuon-momentum-dtype bf16")
    if rule.selects_fraction and m.nesterov:
        raise ValueError(f"--dmuon-update {m.update} has no Nesterov form (momentum M + G with error feedback): "
                         "drop --muon-nesterov (the trainer, dmuon-train, defaults to Nesterov: pass "
                         "--muon-no-nesterov; MuonSettings.nesterov=False)")
    _choice("--dmuon-ns-method", m.ns_method, NS_METHODS)
    _choice("--dmuon-overlap-step", m.overlap_step, OVERLAP_STEP_MODES)
    if OverlapMode(m.overlap_step).cuts_per_need_group and rule.by_rows:
        raise ValueError(f"--dmuon-overlap-step {m.overlap_step} runs the Muon rule only; --dmuon-update "
                         f"{m.update} steps inside optimizer.step(): drop --dmuon-overlap-step")
    _choice("--dmuon-ns-launch", m.ns_launch, NS_LAUNCH_MODES)
    _choice("--dmuon-tp-method", m.tp_method, TP_METHODS)
    if m.ns_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"dmuon ns_dtype must be a float dtype (--muon-fp32-matmul-prec), got {m.ns_dtype}")
    if m.momentum_dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise ValueError(f"dmuon momentum_dtype must be float32 or bfloat16 (--dmuon-momentum-dtype), got {m.momentum_dtype}")
    if m.coefficients == ADAPTIVE_SCHEDULE:
        if m.ns_steps != 5:
            raise ValueError(f"--dmuon-coefficients adaptive chooses the step count per shape (4 for aspect >= 2, else "
                             f"5); --muon-num-ns-steps {m.ns_steps} would be ignored: leave --muon-num-ns-steps at 5")
    else:
        get_coefficients(m.coefficients, m.ns_steps)  # a clear error if unknown
    _choice("--muon-scale-mode", m.scale_mode, LR_SCALE_MODES)


# ---------------------------------------------------------------------- configs from configs
def with_overrides(cfg: Optional[DMuonConfig], overrides: dict) -> DMuonConfig:
    """``cfg`` (default ``DMuonConfig()``) with keyword overrides of the Python API applied: layout
    options by name (``ranks_per_node``, ``balance``, ``megabatch``, ``cost_fn``, ...),
    ``publish_dtype``, and ``split`` (``split_flags()``'s dict). A new config (checked as it is built);
    ``cfg`` is not changed."""
    cfg = cfg or DMuonConfig()
    if not overrides:
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
    return dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, **layout), **top)


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
