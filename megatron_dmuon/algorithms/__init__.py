"""Pure tensor math: Newton–Schulz variants and schedules, Muon/AdamW rules, parameter splitting, FLOP model.

No process groups and no megatron imports here.

``newton_schulz`` and ``gram_newton_schulz`` are deliberately not re-exported: their names are
also submodule names, and a package attribute holding the function would shadow the module
(breaking ``import megatron_dmuon.algorithms.newton_schulz as m`` and ``mock.patch`` paths).
Import them from their modules, or call ``orthogonalize(x, method=...)``.
"""
from .adamw import adamw_step_
from .coefficients import COEFFICIENT_SETS, get_coefficients
from .flops import newton_schulz_flops
from .muon import LR_SCALE_MODES, muon_apply_, muon_lr_scale, muon_momentum_, muon_step_
from .newton_schulz import msgn_svd, newton_schulz_reference
from .ns_dispatch import ORTHOGONALIZE_METHODS, orthogonalize
from .ns_metrics import orthogonalization_errors
from .schedules import POLAR_EXPRESS_6, QUARTIC_SQUARE_5, QUARTIC_WIDE_4, design_polar_express, schedule_for_shape
from .splitting import (
    SPLIT_KINDS,
    SplitRule,
    glu_merge,
    glu_split,
    merge_heads,
    per_head,
    qkv_merge,
    qkv_split,
    rule_for_megatron_param,
)
