"""Emerging-Optimizers' Newton–Schulz coefficient types (Megatron-LM's `muon_coefficient_type`),
as explicit per-step schedules DMuon's NS runs step for step.

Megatron-LM's own Muon hands `muon_coefficient_type` and `muon_num_ns_steps` to
Emerging-Optimizers' `newton_schulz` (NVIDIA-NeMo/Emerging-Optimizers,
`emerging_optimizers/orthogonalized_optimizers/muon_utils.py`, tags v0.3.0 and v0.4.0). There a
type is a table of (a, b, c) sets (`_COEFFICIENT_SETS`) walked for `steps` iterations in one of
two ways past its end: `polar_express`, `cans` and `deepseekv4` repeat their last set, every
other type starts over from its first. The tables below are those of v0.4.0 (v0.3.0's are the
same, without `cubic5`), as they are printed there, rounding included: EO's `polar_express` is
Polar Express (arXiv 2505.16932) with its 1.01 safety damping folded into every set, rounded to 4
decimals, and 8 sets long. It is not DMuon's own coefficient set `polar_express`
(algorithms/coefficients.py: the published 5 sets at full precision, the fifth undamped), which
stays as it is under that name. `cubic5` has c = 0 (a cubic step, no A² product) and is a fixed
5-step schedule: Emerging-Optimizers refuses any other step count. `custom` takes sets from
`newton_schulz(custom_coefficient_sets=...)`, which Megatron-LM never passes (it has no flag for
them), so no rule exists to follow: DMuon refuses it by name (megatron/megatron_lm_flags.py, where
the flag is read).

tests/algorithms/test_eo_coefficients.py runs Emerging-Optimizers' own `newton_schulz` (the installed 0.3.x,
and 0.4.0 where $DMUON_EO040 points to it) against DMuon's on the same inputs.
"""
from __future__ import annotations

from itertools import chain, cycle, islice, repeat

from .coefficients import KELLER, YOU, Coefficients

EO_TABLES: dict[str, tuple[Coefficients, ...]] = {
    "simple": (KELLER,),
    "quintic": YOU,  # modded-nanogpt's five per-step sets
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "cans": (  # CANS, arXiv 2506.10935
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "aol": (  # thib-s/flash-newton-schulz
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    # DeepSeek-V4's schedule: 8 steps of Keller's set, then 2 of (2, -1.5, 0.5)
    "deepseekv4": (KELLER,) * 8 + ((2.0, -1.5, 0.5),) * 2,
    "cubic5": (  # relaxed cubic steps, arXiv 2606.00371 (v0.4.0 only)
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ),
}
# the types whose table repeats its last set past its end (the rest cycle from the first set)
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
# types whose step count is fixed: Emerging-Optimizers raises for any other step count
FIXED_STEPS = {"cubic5": 5}
# every type of Emerging-Optimizers 0.4.0's NSCoeffT; 'custom' has no sets under Megatron-LM
EO_COEFFICIENT_TYPES: tuple[str, ...] = tuple(EO_TABLES)
UNRUNNABLE_TYPES = {
    "custom": "Megatron-LM has no flag for Emerging-Optimizers' custom_coefficient_sets, so its own Muon "
              "runs no custom rule (newton_schulz raises 'custom_coefficient_sets must be provided' at the "
              "first step) and there is none for DMuon to match",
}


def eo_schedule(coefficient_type: str, steps: int) -> tuple[Coefficients, ...]:
    """The ``steps`` (a, b, c) sets Emerging-Optimizers' ``newton_schulz`` applies for
    ``coefficient_type`` (one of ``EO_TABLES`` at a step count it takes: ``FIXED_STEPS``)."""
    if coefficient_type not in EO_TABLES or FIXED_STEPS.get(coefficient_type, steps) != steps:
        raise ValueError(f"Emerging-Optimizers has no schedule for coefficient type {coefficient_type!r} at {steps} "
                         "steps")
    table = EO_TABLES[coefficient_type]
    walk = chain(table, repeat(table[-1])) if coefficient_type in REPEAT_LAST else cycle(table)
    return tuple(islice(walk, steps))
