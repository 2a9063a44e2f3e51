"""The cell a heaviest-first greedy gives the next matrix: the placement rule of every greedy owner
planner (planning/owner_layout.py's cost and numel greedies and its bucket balance check,
planning/milp.py's warm start).
"""
from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["least_loaded_cell"]


def least_loaded_cell(cells: Iterable[int], tp_size: int, has_room: Callable[[int], bool],
                      load: Callable[[int], float], used: Callable[[int], float]) -> int:
    """Among ``cells`` (index ``dp * tp_size + tp``) whose DP row has room for the matrix
    (``has_room(dp)``), the least loaded: smallest ``(load(c), used(dp), c)``. If no row has
    room, the cell of the row with the most room: smallest ``(used(dp), load(c), c)``."""
    cells = list(cells)
    fits = [c for c in cells if has_room(c // tp_size)]
    if fits:
        return min(fits, key=lambda c: (load(c), used(c // tp_size), c))
    return min(cells, key=lambda c: (used(c // tp_size), load(c), c))
