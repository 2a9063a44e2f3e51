"""The owner's NS input stacks: one ``[B, m, n]`` stack per distinct (piece shape, dtype), and
where every matrix's pieces sit in them.

A matrix whose pieces are consecutive row blocks of equal shape (a whole matrix; a GLU fc1 cut
into its gate and up halves without TP interleaving) takes consecutive slots of its stack in row
order, so the matrix *is* a view of the stack: the owner step writes its Nesterov update straight
into that view and applies the direction straight from the same view of the NS output, with no
stack copy and no reassembly. Other splits (QKV per query group, per head, interleaved GLU) are cut
by their ``SplitRule`` and copied in; a 3-D piece (a per-head stack) takes consecutive slots too,
so its output comes back as a view.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class StackJob:
    """One matrix to orthogonalize: its name, the shape of the tensor its update comes in, how it
    is cut (``algorithms.splitting.SplitRule`` or None) and the update's dtype."""

    name: str
    shape: Tuple[int, ...]
    split: Optional[object] = None
    dtype: torch.dtype = torch.float32


def _is_direct(split) -> bool:
    return split is None or split.kind == "none" or (split.kind == "glu" and split.tp_shards == 1)


class StackPlan:
    """Slots of every job's pieces. ``groups[g]`` = (m, n, dtype) of stack g; ``pieces[j]`` =
    [(g, start, count, piece shape)] per piece of job j (count > 1: a 3-D piece, or a direct
    matrix's row blocks, in consecutive slots); ``direct[j]`` = (g, start, count) when job j is
    a view of its stack."""

    def __init__(self, jobs: Sequence[StackJob], tag: Optional[int] = None):
        self.jobs = list(jobs)
        self.tag = tag  # the need group whose own stacks these are (overlapped step), else None
        self.groups: List[Tuple[int, int, torch.dtype]] = []
        self.sizes: List[int] = []
        self.pieces: List[List[Tuple[int, int, int, Tuple[int, ...]]]] = []
        self.direct: Dict[int, Tuple[int, int, int]] = {}
        self.ns: list = []  # per stack, the planning.ns_choice.NSChoice it runs (set by the owner step)
        index: Dict[tuple, int] = {}

        def take(shape2d, dtype, count):
            key = (*shape2d, dtype)
            if key not in index:
                index[key] = len(self.groups)
                self.groups.append(key)
                self.sizes.append(0)
            g = index[key]
            start, self.sizes[g] = self.sizes[g], self.sizes[g] + count
            return g, start

        for j, job in enumerate(self.jobs):
            shapes = [tuple(job.shape)] if job.split is None else [tuple(s) for s in job.split.piece_shapes(job.shape)]
            if _is_direct(job.split) and len(set(shapes)) == 1 and len(shapes[0]) == 2:
                g, start = take(shapes[0], job.dtype, len(shapes))
                self.direct[j] = (g, start, len(shapes))
                self.pieces.append([(g, start + i, 1, s) for i, s in enumerate(shapes)])
                continue
            slots = []
            for s in shapes:
                count = 1 if len(s) == 2 else s[0]
                g, start = take(s[-2:], job.dtype, count)
                slots.append((g, start, count, s))
            self.pieces.append(slots)

    def new_stacks(self, device) -> List[torch.Tensor]:
        return [torch.empty(size, m, n, dtype=dtype, device=device)
                for (m, n, dtype), size in zip(self.groups, self.sizes)]

    def stack_shapes(self) -> List[Tuple[int, int, int]]:
        return [(size, m, n) for (m, n, _), size in zip(self.groups, self.sizes)]

    def direct_view(self, stacks: Sequence[torch.Tensor], j: int) -> Optional[torch.Tensor]:
        """Job j's matrix as a view of ``stacks`` (inputs or NS outputs), or None if it is copied.
        (An NS output in another layout, e.g. a transposed result of the torch path, is reshaped:
        a copy; input stacks are always contiguous, so writes land in them.)"""
        if j not in self.direct:
            return None
        g, start, count = self.direct[j]
        block = stacks[g][start:start + count]
        return block.view(self.jobs[j].shape) if block.is_contiguous() else block.reshape(self.jobs[j].shape)

    def piece_shape(self, j: int) -> Tuple[int, ...]:
        return self.pieces[j][0][3]

    def write(self, stacks: Sequence[torch.Tensor], j: int, update: torch.Tensor) -> None:
        """Copy job j's update (its full matrix) into its slots."""
        direct = self.direct_view(stacks, j)
        if direct is not None:
            direct.copy_(update.view(direct.shape))
            return
        split = self.jobs[j].split
        cut = [update.view(self.jobs[j].shape)] if split is None else split.pieces(update.view(self.jobs[j].shape))
        for (g, start, count, shape), piece in zip(self.pieces[j], cut):
            stacks[g][start:start + count].copy_(piece.reshape(count, *shape[-2:]))

    def outputs(self, stacks: Sequence[torch.Tensor], j: int) -> List[torch.Tensor]:
        """Job j's NS outputs in its split's piece order (3-D pieces stay stacks), as views."""
        return [stacks[g][start] if len(shape) == 2 else stacks[g][start:start + count]
                for g, start, count, shape in self.pieces[j]]

    def slot_names(self) -> List[List[str]]:
        """Per stack, the name of the matrix each slot holds a piece of (for logs)."""
        names = [[""] * size for size in self.sizes]
        for job, slots in zip(self.jobs, self.pieces):
            for g, start, count, _ in slots:
                for i in range(start, start + count):
                    names[g][i] = job.name
        return names
