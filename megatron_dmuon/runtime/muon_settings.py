"""How the owners run Muon (``MuonSettings``): the update rule's settings, Megatron-LM's defaults,
their checks, and the NS resolver of a device (``planning.ns_choice.NSResolver``)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..algorithms.coefficients import get_coefficients
from ..algorithms.flops import NS_METHODS
from ..algorithms.muon import muon_lr_scale
from ..algorithms.ns_metrics import schedule_peak
from ..kernels import measured_method
from ..planning.ns_choice import ADAPTIVE_SCHEDULE, NSResolver, ns_schedule
from ..planning.tp_cost import TP_METHODS
from ..planning.overlap_mode import OverlapMode
from .row_update_step import validate_update_settings

# How the owner's per-shape NS calls are launched on CUDA: one after the other ('eager'), on
# concurrent streams ('streams'), or the whole set captured once as a CUDA graph and replayed
# every step ('graph': kills the launch overhead of many small matrices; the graph keeps its
# input/output buffers and memory pool alive, one graph per distinct set of stack shapes).
NS_LAUNCH_MODES = ("eager", "streams", "graph")


@dataclasses.dataclass
class MuonSettings:
    """How the owners run Muon. The rule's defaults are Megatron-LM's `--optimizer muon` (its
    argparse defaults: momentum 0.9 without Nesterov, the 'quintic' per-step coefficients, bf16 NS,
    the 'spectral' scale; megatron/megatron_lm_flags.py registers the same defaults as flags and a
    test pins the two together). Other rules are named presets: ``torch_muon()`` (torch.optim.Muon's,
    the reference tests'), the main job's recipe (megatron/train/args.py MAIN_JOB_MUON_DEFAULTS)."""
    momentum: float = 0.9
    nesterov: bool = False
    ns_method: str = "standard"  # 'standard' | 'gram' | 'auto' (kernels' autotuned choice)
    # a set of algorithms.get_coefficients, or 'adaptive': per shape, the quartic normalisation with
    # 4 designed steps for wide/tall matrices (aspect >= 2) and 5 for the rest
    # (algorithms.schedules.schedule_for_shape; ns_steps is then not used)
    coefficients: str = "you"
    ns_steps: int = 5
    ns_dtype: torch.dtype = torch.bfloat16
    scale_mode: str = "spectral"  # algorithms.muon.LR_SCALE_MODES (Megatron's --muon-scale-mode names)
    extra_scale: float = 1.0
    ns_launch: str = "eager"  # NS_LAUNCH_MODES; off CUDA every mode runs eagerly
    # an NS output holding NaN/Inf (e.g. fp16 Gram overflow) is recomputed in float32 by the torch
    # path and counted (kernels.metrics.NONFINITE_METRICS, OwnerMuonAdamW.stats['ns_fp32_retries'])
    retry_nonfinite: bool = True
    # TP-sharded matrices: 'gather' to the TP owner, 'distributed_gram' where it applies, or 'auto'
    # (planning/tp_cost.py's time model picks per shape)
    tp_method: str = "auto"
    # dtype of the momentum buffer (bf16 halves the Muon state; the update itself runs in fp32)
    momentum_dtype: torch.dtype = torch.float32
    # the update rule: 'muon', or a row rule of algorithms/dion3.py ('normuon', 'dion3'; run by
    # runtime/row_update_step.py); row_beta2: NorMuon's second-moment decay; fraction and
    # fraction_lr: Dion3's selected share of rows and its lr factor
    update: str = "muon"
    fraction: float = 1.0
    row_beta2: float = 0.95
    fraction_lr: str = "none"
    # online NS quality: every ns_check_interval steps (0: never) each owner estimates, per NS
    # output, the top eigenvalue of OᵀO − I (random probes); an output above ns_check_bound (None:
    # (1.25 x the schedule's exact-arithmetic peak)² − 1) is recomputed by the exact float32 NS
    ns_check_interval: int = 100
    ns_check_bound: Optional[float] = None
    # OVERLAP_STEP_MODES (their meaning: planning/overlap_mode.py): 'off', or the Muon work cut per
    # need group (MatrixInfo.need) and finished when the next forward needs it ('on', 'backward'),
    # or inside the step ('sync': the same stacks and arithmetic, for checking 'on' bit for bit)
    overlap_step: str = "off"

    @classmethod
    def torch_muon(cls, **overrides) -> "MuonSettings":
        """torch.optim.Muon's rule (momentum 0.95 with Nesterov, Keller's 5-step NS in bf16, its
        'original' lr adjustment = our 'shape_scaling'), then ``overrides``."""
        rule = dict(momentum=0.95, nesterov=True, coefficients="keller", scale_mode="shape_scaling")
        return cls(**{**rule, **overrides})

    def validate(self) -> None:
        validate_update_settings(self)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"--muon-momentum {self.momentum} must be in [0, 1) (MuonSettings.momentum)")
        if self.ns_method not in NS_METHODS:
            raise ValueError(f"--dmuon-ns-method {self.ns_method!r} unknown; valid: {', '.join(NS_METHODS)}")
        if self.ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps {self.ns_steps} must be >= 1 (MuonSettings.ns_steps)")
        overlap = OverlapMode(self.overlap_step)  # (an unknown mode: its ValueError names the flag)
        if overlap.cuts_per_need_group and self.update != "muon":
            raise ValueError(f"--dmuon-overlap-step {self.overlap_step} runs the Muon rule only; --dmuon-update "
                             f"{self.update} steps inside optimizer.step(): drop --dmuon-overlap-step")
        if self.ns_launch not in NS_LAUNCH_MODES:
            raise ValueError(f"dmuon ns_launch {self.ns_launch!r} unknown (--dmuon-ns-launch); valid: {NS_LAUNCH_MODES}")
        if self.tp_method not in TP_METHODS:
            raise ValueError(f"dmuon tp_method {self.tp_method!r} unknown (--dmuon-tp-method); valid: {TP_METHODS}")
        if self.ns_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"dmuon ns_dtype must be a float dtype, got {self.ns_dtype}")
        if self.momentum_dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"dmuon momentum_dtype must be float32 or bfloat16 (--dmuon-momentum-dtype), got {self.momentum_dtype}")
        if self.coefficients == ADAPTIVE_SCHEDULE:
            if self.ns_steps != 5:
                raise ValueError(
                    f"--dmuon-coefficients adaptive chooses the step count per shape (4 for aspect >= 2, else 5); "
                    f"--muon-num-ns-steps {self.ns_steps} would be ignored: leave --muon-num-ns-steps at 5"
                )
        else:
            get_coefficients(self.coefficients, self.ns_steps)  # raises a clear error if unknown
        muon_lr_scale(2, 1, self.scale_mode)  # raises if the mode is unknown
        if isinstance(self.ns_check_interval, bool) or not isinstance(self.ns_check_interval, int) \
                or self.ns_check_interval < 0:
            raise ValueError(f"--dmuon-ns-check-interval {self.ns_check_interval!r} must be an integer >= 0 (0 turns "
                             "the check off; MuonSettings.ns_check_interval)")
        if self.ns_check_bound is not None and not (0 < self.ns_check_bound < float("inf")):
            raise ValueError(f"--dmuon-ns-check-bound {self.ns_check_bound!r} must be a finite number > 0 "
                             "(MuonSettings.ns_check_bound)")

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
