"""The start-up budget of balance 'milp' (``LayoutOptions.plan_budget_s``), shared by the rank
profile (runtime/rank_profile.py: the owner step timed on this GPU) and the owner MILP
(planning/rank_milp.py), both on rank 0 of each pipeline stage: profiling gets its share first, the
MILP what profiling left.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["STARTUP_BUDGET_S", "profile_budget", "milp_time_limit"]

STARTUP_BUDGET_S = 30.0  # profiling + MILP at start-up, rank 0 of each pipeline stage
PROFILE_SHARE = 2.0 / 3.0  # of that budget; the MILP gets what profiling left (>= MIN_MILP_S)
MIN_MILP_S = 1.0


def profile_budget(startup_budget_s: float = STARTUP_BUDGET_S) -> float:
    return startup_budget_s * PROFILE_SHARE


def milp_time_limit(startup_budget_s: float, spent_s: float, requested_s: Optional[float] = None) -> float:
    """The MILP's time limit: what the start-up budget has left after profiling (never above a
    requested limit, never below MIN_MILP_S; the MILP keeps its greedy start when time runs out)."""
    left = max(MIN_MILP_S, startup_budget_s - spent_s)
    return left if requested_s is None else min(requested_s, left)
