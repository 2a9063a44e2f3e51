"""Pure tensor math: Newton–Schulz variants, Muon/AdamW rules, parameter splitting, FLOP model.

No process groups and no megatron imports here.
"""
from .adamw import adamw_step_
from .coefficients import COEFFICIENT_SETS, get_coefficients
from .flops import newton_schulz_flops
from .gram_newton_schulz import gram_newton_schulz
from .muon import LR_SCALE_MODES, muon_apply_, muon_lr_scale, muon_momentum_, muon_step_
from .newton_schulz import ORTHOGONALIZE_METHODS, msgn_svd, newton_schulz, newton_schulz_reference, orthogonalize
from .ns_metrics import orthogonalization_errors
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
