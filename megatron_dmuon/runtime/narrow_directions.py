"""The split layout's way back in 16 bits: a direction as its NS outputs' own bits.

Where the NS returns its 16-bit compute dtype (CUDA: the kernels and their torch fallback return it, and
a float32 retry is cast back to it), a split matrix's direction is those outputs widened to the masters'
dtype, each QKV / head / GLU piece scaled by its own lr multiplier (``algorithms.muon.muon_direction``).
So the home sends the outputs' bits, assembled as the direction is, and a tag with each piece's format
(bf16, or fp16 under Gram NS: each home's NS chooses per shape, so the holder reads it rather than
assumes it); a holder widens its piece run by run and scales each run by its piece's multiplier, the
same float32 product the home's direction holds. Half the bytes of the masters' fp32, the same bits.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..algorithms.muon import muon_lr_scale
from ..planning.split_layout import NARROW_TAG_BYTES

__all__ = ["NARROW_FORMATS", "encode_direction", "NarrowDecoder"]

NARROW_FORMATS = (torch.bfloat16, torch.float16)  # a piece's format, by its code in the tag


def _whole(split) -> bool:
    return split is None or split.kind == "none"


def encode_direction(outputs: Sequence[torch.Tensor], split, shape: Sequence[int], name: str = "") -> Tuple[torch.Tensor, tuple]:
    """(bits, tag) of the direction of a ``shape`` matrix from its NS outputs (in the order of
    ``split.pieces``, each of a NARROW_FORMATS dtype): the int16 bits assembled as the direction is,
    flattened, and each piece's format code."""
    wrong = sorted({str(o.dtype) for o in outputs if o.dtype not in NARROW_FORMATS})
    if wrong or len(outputs) > NARROW_TAG_BYTES:
        raise RuntimeError(f"DMuon: the NS of {name!r} returned {wrong or len(outputs)} outputs that cannot travel as "
                           "16-bit bits (a bug: please report it)")
    bits = [o.view(torch.int16) for o in outputs]
    whole = bits[0] if _whole(split) else split.assemble(bits, like=torch.empty(tuple(shape), device="meta"))
    return whole.reshape(-1), tuple(NARROW_FORMATS.index(o.dtype) for o in outputs)


class NarrowDecoder:
    """Widens this rank's piece of a direction from its bits (``decode``); the runs of each piece (which
    NS piece each element comes from) are worked out once per matrix."""

    def __init__(self, scale_mode: str, extra_scale: float):
        self.scale_mode, self.extra_scale = scale_mode, extra_scale
        self._runs: Dict[str, List[Tuple[int, int, int]]] = {}

    def _runs_of(self, info) -> List[Tuple[int, int, int]]:
        """(start, end, piece) of this rank's [lo, hi) of ``info``'s flattened matrix, in order."""
        lo, hi = info.dp_piece
        runs = self._runs.get(info.name)
        if runs is None:
            if _whole(info.split):
                runs = [(0, hi - lo, 0)]
            else:
                shapes = info.split.piece_shapes(tuple(info.shape))
                index = info.split.assemble([torch.full(s, i, dtype=torch.int16) for i, s in enumerate(shapes)],
                                            like=torch.empty(tuple(info.shape), device="meta")).reshape(-1)[lo:hi]
                cuts = (torch.nonzero(index[1:] != index[:-1]).flatten() + 1).tolist()
                runs = [(a, b, int(index[a])) for a, b in zip([0] + cuts, cuts + [hi - lo])]
            self._runs[info.name] = runs
        return runs

    def decode(self, info, bits: torch.Tensor, tag: tuple, dtype: torch.dtype) -> torch.Tensor:
        """This rank's piece of ``info``'s direction in ``dtype`` from its ``bits`` and the home's ``tag``."""
        out = torch.empty(bits.numel(), dtype=dtype, device=bits.device)
        scales = None if _whole(info.split) else [
            muon_lr_scale(s[-2], s[-1], self.scale_mode, self.extra_scale) for s in info.split.piece_shapes(tuple(info.shape))]
        for a, b, piece in self._runs_of(info):
            run = out[a:b]
            run.copy_(bits[a:b].view(NARROW_FORMATS[tag[piece]]))  # widening: exact
            if scales is not None:
                run.mul_(scales[piece])  # the home's product: its output widened, times the piece's multiplier
        return out
