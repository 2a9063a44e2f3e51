"""The split layout's way back as 16-bit bits (runtime/narrow_directions.py): a holder's decoded piece is
the home's direction, bit for bit, for every split rule, every mix of the pieces' formats and every cut of
the flattened matrix; on CUDA too where there is one (the product the home and the holder compute there)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from megatron_dmuon.algorithms.muon import muon_direction
from megatron_dmuon.algorithms.splitting import SplitRule
from megatron_dmuon.runtime.narrow_directions import NARROW_FORMATS, NarrowDecoder, encode_direction

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RULES = [  # (rule, full shape)
    (None, (24, 40)),
    (SplitRule("qkv", num_attention_heads=4, num_query_groups=2, head_dim=8), (64, 40)),
    (SplitRule("qkv", per_head=True, num_attention_heads=4, num_query_groups=2, head_dim=8), (64, 40)),
    (SplitRule("qkv", num_attention_heads=4, num_query_groups=2, head_dim=8, gated=True), (96, 40)),
    (SplitRule("glu"), (48, 40)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_mode", ["spectral", "shape_scaling"])
@pytest.mark.parametrize("rule,shape", RULES, ids=["whole", "qkv", "qkv_heads", "qkv_gated", "glu"])
def test_a_holders_piece_is_the_homes_direction_bit_for_bit(rule, shape, scale_mode, device):
    rng = random.Random(hash((str(rule), scale_mode)) % 1000)
    shapes = [shape] if rule is None else rule.piece_shapes(shape)
    # each piece's NS output in its own 16-bit format (per shape, as 'auto' may pick Gram's fp16 for one)
    outputs = [torch.randn(s, device=device).to(rng.choice(NARROW_FORMATS)) for s in shapes]
    home, _ = muon_direction(outputs, rule, shape=shape, scale_mode=scale_mode, extra_scale=1.3, dtype=torch.float32)
    bits, tag = encode_direction(outputs, rule, shape, "w")
    assert bits.dtype == torch.int16 and bits.numel() == home.numel()
    numel = home.numel()
    cuts = sorted({0, numel, *(rng.randrange(1, numel) for _ in range(5))})
    for lo, hi in zip(cuts, cuts[1:]):  # every holder's piece of the flattened matrix
        info = SimpleNamespace(name=f"w{lo}", dp_piece=(lo, hi), split=rule, shape=shape)
        got = NarrowDecoder(scale_mode, 1.3).decode(info, bits[lo:hi], tag, torch.float32)
        assert torch.equal(got, home.reshape(-1)[lo:hi]), (lo, hi)


def test_an_output_that_is_not_16_bit_is_refused_by_name():
    with pytest.raises(RuntimeError, match="'w'.*float32"):
        encode_direction([torch.zeros(4, 6)], None, (4, 6), "w")
