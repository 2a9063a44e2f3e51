"""How the owners run Muon (``MuonSettings``): the update rule's settings, Megatron-LM's defaults,
and the NS resolver of a device (``planning.ns_choice.NSResolver``).

A section of DMuon's config (megatron/config.py ``DMuonConfig.muon``), which checks it once when the
config is built, in the words of its flags; the owner step reads it as given."""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional, Sequence, Union, get_args

import torch

from ..algorithms.coefficients import CoefficientSet, Coefficients
from ..algorithms.flops import NSMethod
from ..algorithms.muon import LRScaleMode
from ..algorithms.dion3 import FractionLR
from ..algorithms.ns_metrics import schedule_peak
from ..algorithms.update_rule import UpdateRule, UpdateRuleName
from ..kernels import measured_method
from ..planning.ns_choice import ADAPTIVE_SCHEDULE, AdaptiveSchedule, NSResolver, ns_schedule  # noqa: F401
from ..planning.overlap_mode import OverlapStep
from ..planning.tp_cost import TPMethod

# How the owner's per-shape NS calls are launched on CUDA: one after the other ('eager'), on
# concurrent streams ('streams'), or the whole set captured once as a CUDA graph and replayed
# every step ('graph': kills the launch overhead of many small matrices; the graph keeps its
# input/output buffers and memory pool alive, one graph per distinct set of stack shapes).
NSLaunch = Literal["eager", "streams", "graph"]
NS_LAUNCH_MODES = get_args(NSLaunch)


@dataclasses.dataclass(frozen=True)
class MuonSettings:
    """How the owners run Muon. The rule's defaults are Megatron-LM's `--optimizer muon` (its
    argparse defaults: momentum 0.9 without Nesterov, the 'quintic' per-step coefficients, bf16 NS,
    the 'spectral' scale; megatron/megatron_lm_flags.py registers the same defaults as flags and a
    test pins the two together). Other rules are named presets: ``torch_muon()`` (torch.optim.Muon's,
    the reference tests'), the main job's recipe (megatron/train/args.py MAIN_JOB_MUON_DEFAULTS)."""

    momentum: float = 0.9
    """Momentum coefficient, in [0, 1)."""
    nesterov: bool = False
    """Nesterov momentum (the row rule Dion3 has no Nesterov form)."""
    ns_method: NSMethod = "standard"
    """The NS variant: 'standard', 'gram' (in the small Gram space), 'auto' (the kernels' measured
    fastest per shape, else the FLOP rule; standard off CUDA)."""
    coefficients: Union[CoefficientSet, AdaptiveSchedule, Sequence[Coefficients]] = "you"
    """The NS schedule: a set of ``algorithms.get_coefficients`` (a name, or (a, b, c) sets), or
    'adaptive': per shape, the quartic normalisation with 4 designed steps for wide/tall matrices
    (aspect >= 2) and 5 for the rest (``algorithms.schedules.schedule_for_shape``; ``ns_steps`` is
    then not used and must stay 5)."""
    ns_steps: int = 5
    """NS steps per orthogonalization (>= 1)."""
    ns_dtype: torch.dtype = torch.bfloat16
    """NS compute precision (Gram NS runs a bf16 request in fp16)."""
    scale_mode: LRScaleMode = "spectral"
    """Per-matrix lr scale (``algorithms.muon.LR_SCALE_MODES``, Megatron's names)."""
    extra_scale: float = 1.0
    """Extra factor on the Muon update (> 0)."""
    ns_launch: NSLaunch = "eager"
    """How the owner's per-shape NS calls are launched on CUDA (``NS_LAUNCH_MODES``); off CUDA every
    mode runs eagerly."""
    retry_nonfinite: bool = True
    """An NS output holding NaN/Inf (e.g. fp16 Gram overflow) is recomputed in float32 by the torch
    path and counted (kernels.metrics.NONFINITE_METRICS, OwnerMuonAdamW.stats['ns_fp32_retries'])."""
    tp_method: TPMethod = "auto"
    """TP-sharded matrices: 'gather' to the TP owner, 'distributed_gram' where it applies, or 'auto'
    (planning/tp_cost.py's time model picks per shape)."""
    momentum_dtype: torch.dtype = torch.float32
    """dtype of the momentum buffer (bf16 halves the Muon state; the update itself runs in fp32;
    the row rules keep theirs in the param dtype)."""
    update: UpdateRuleName = "muon"
    """The update rule (algorithms/update_rule.py): 'muon', or a row rule of algorithms/dion3.py
    ('normuon', 'dion3'; run by runtime/row_update_step.py)."""
    fraction: float = 1.0
    """Dion3's share of each matrix's rows orthogonalized per step, in (0, 1] (1 for the others)."""
    row_beta2: float = 0.95
    """The row rules' decay of the per-row second moment, in [0, 1)."""
    fraction_lr: FractionLR = "none"
    """Dion3's lr factor for the fraction: 'none' (NorDion2's) or 'inverse_sqrt' (1/sqrt(f))."""
    ns_check_interval: int = 100
    """Online NS quality: every ns_check_interval steps (0: never) each owner estimates, per NS
    output, the top eigenvalue of OᵀO − I (random probes); an output above ``ns_check_bound`` is
    recomputed by the exact float32 NS."""
    ns_check_bound: Optional[float] = None
    """The check's bound (> 0; None: (1.25 x the schedule's exact-arithmetic peak)² − 1)."""
    overlap_step: OverlapStep = "off"
    """planning/overlap_mode.py: 'off', or the Muon work cut per need group (MatrixInfo.need) and
    finished when the next forward needs it ('on', 'backward'), or inside the step ('sync': the same
    stacks and arithmetic, for checking 'on' bit for bit)."""

    @classmethod
    def torch_muon(cls, **overrides) -> "MuonSettings":
        """torch.optim.Muon's rule (momentum 0.95 with Nesterov, Keller's 5-step NS in bf16, its
        'original' lr adjustment = our 'shape_scaling'), then ``overrides``."""
        rule = dict(momentum=0.95, nesterov=True, coefficients="keller", scale_mode="shape_scaling")
        return cls(**{**rule, **overrides})

    @property
    def rule(self) -> UpdateRule:
        """What the update rule needs (``algorithms.update_rule.UpdateRule``)."""
        return UpdateRule(self.update)

    def ns_check_limit(self, rows: int, cols: int) -> float:
        """The largest estimate of top-eig(OᵀO − I) an NS output of a [rows, cols] matrix may have."""
        if self.ns_check_bound is not None:
            return self.ns_check_bound
        kw = self.ns_schedule(rows, cols)
        coefficients = kw["coefficients"] if isinstance(kw["coefficients"], str) else tuple(map(tuple, kw["coefficients"]))
        return _peak_limit(coefficients, kw["steps"])

    def ns_resolver(self, device, cache_path=None) -> NSResolver:
        """What every stack runs under these settings on ``device`` and what it costs
        (``planning.ns_choice.NSResolver``): on CUDA 'auto' reads the kernels' autotune cache (a
        planner on a machine without a GPU resolves for CUDA by the FLOP rule)."""
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        return NSResolver(self.ns_method, self.ns_dtype, self.coefficients, self.ns_steps, on_cuda,
                          measured_method(device, cache_path) if on_cuda else None)

    def ns_schedule(self, rows: int, cols: int) -> dict:
        """The NS keyword arguments for a [rows, cols] matrix: ``{'coefficients', 'steps'}`` (and
        ``'normalisation'`` for the adaptive schedule)."""
        return ns_schedule(self.coefficients, self.ns_steps, rows, cols)


NS_CHECK_MARGIN = 1.25  # an output's largest singular value may exceed its schedule's exact peak by 25%


@functools.lru_cache(maxsize=64)
def _peak_limit(coefficients, steps: int) -> float:
    return (NS_CHECK_MARGIN * schedule_peak(coefficients, steps)) ** 2 - 1.0
