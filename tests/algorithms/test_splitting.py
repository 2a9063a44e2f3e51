"""Parameter splitting: exact round trips, and agreement with megatron-core's real layouts
(linear_qkv with/without attention_output_gate, GLU fc1 under TP=2 stride-2 sharding)."""
import os
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_dmuon.algorithms.splitting import (
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
from megatron_dmuon.testing.multiproc import run_distributed

HERE = os.path.dirname(__file__)


def _labelled_qkv(heads, groups, hd, cols, gated):
    """A fused weight whose every entry says where it came from: 1000*kind + 10*head + d,
    kind q=1, gate=2, k=3, v=4 (head = global q head, or group index for k/v)."""
    q = heads // groups
    rows = []
    for g in range(groups):
        blocks = [(1, range(g * q, (g + 1) * q))]
        if gated:
            blocks.append((2, range(g * q, (g + 1) * q)))
        blocks += [(3, [g]), (4, [g])]
        for kind, head_ids in blocks:
            for h in head_ids:
                for d in range(hd):
                    rows.append(torch.full((cols,), 1000.0 * kind + 10 * h + d))
    return torch.stack(rows)


@pytest.mark.parametrize("gated", [False, True])
def test_qkv_split_follows_megatron_group_layout(gated):
    heads, groups, hd, cols = 6, 3, 4, 5
    parts = qkv_split(_labelled_qkv(heads, groups, hd, cols, gated), heads, groups, hd, gated=gated)
    assert sorted(parts) == (["gate", "k", "q", "v"] if gated else ["k", "q", "v"])
    want_rows = lambda kind, n: torch.tensor([1000.0 * kind + 10 * h + d for h in range(n) for d in range(hd)])
    assert torch.equal(parts["q"][:, 0], want_rows(1, heads))
    assert torch.equal(parts["k"][:, 0], want_rows(3, groups))
    assert torch.equal(parts["v"][:, 0], want_rows(4, groups))
    if gated:
        assert torch.equal(parts["gate"][:, 0], want_rows(2, heads))


def test_qkv_round_trip_random_gqa_configs():
    rng = random.Random(0)
    for _ in range(25):
        groups = rng.choice([1, 2, 4, 8])
        heads = groups * rng.choice([1, 2, 3, 4])
        hd, cols, gated = rng.choice([1, 2, 8, 16]), rng.choice([3, 16, 33]), rng.random() < 0.5
        lead = rng.choice([(), (2,)])
        rows = (heads + 2 * groups + (heads if gated else 0)) * hd
        w = torch.randn(*lead, rows, cols)
        infer = rng.random() < 0.5
        parts = qkv_split(w, heads, groups, None if infer else hd, gated)
        assert parts["q"].shape == (*lead, heads * hd, cols) and parts["k"].shape == (*lead, groups * hd, cols)
        assert torch.equal(qkv_merge(parts, heads, groups, None if infer else hd, gated), w)
        rule = SplitRule("qkv", per_head=rng.random() < 0.5, num_attention_heads=heads,
                         num_query_groups=groups, head_dim=hd, gated=gated)
        if not lead:
            pieces = rule.pieces(w)
            assert [tuple(p.shape) for p in pieces] == rule.piece_shapes(w.shape)
            assert torch.equal(rule.assemble([p.clone() for p in pieces], w), w)


def test_qkv_errors():
    with pytest.raises(ValueError, match="multiple of num_query_groups"):
        qkv_split(torch.zeros(40, 4), 6, 4)
    with pytest.raises(ValueError, match="need 48"):
        qkv_split(torch.zeros(40, 4), 8, 2, head_dim=4)
    with pytest.raises(ValueError, match="keys"):
        qkv_merge({"q": torch.zeros(8, 2)}, 2, 1)


def test_glu_split_merge_and_tp_interleave():
    gate, up = torch.randn(12, 5), torch.randn(12, 5)
    assert all(torch.equal(a, b) for a, b in zip(glu_split(torch.cat([gate, up])), (gate, up)))
    # two stride-2 TP shards concatenated: [gate_0; up_0; gate_1; up_1]
    sharded = torch.cat([gate[:6], up[:6], gate[6:], up[6:]])
    g2, u2 = glu_split(sharded, tp_shards=2)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    assert torch.equal(glu_merge(gate, up, tp_shards=2), sharded)
    stack = torch.randn(3, 24, 5)
    assert torch.equal(glu_merge(*glu_split(stack, 3), 3), stack)
    with pytest.raises(ValueError, match="divisible by 2\\*tp_shards"):
        glu_split(torch.zeros(10, 3), tp_shards=2)


def test_per_head_and_merge():
    m = torch.arange(24.0).reshape(6, 4)
    stack = per_head(m, 2)
    assert stack.shape == (3, 2, 4) and torch.equal(stack[1], m[2:4])
    assert torch.equal(merge_heads(stack), m)
    with pytest.raises(ValueError, match="head_dim=4"):
        per_head(m, 4)


def test_split_rule_kinds_round_trip():
    cases = [
        (SplitRule(), torch.randn(10, 7), [(10, 7)]),
        (SplitRule("glu"), torch.randn(10, 7), [(5, 7), (5, 7)]),
        (SplitRule("glu", tp_shards=2), torch.randn(12, 7), [(6, 7), (6, 7)]),
        (SplitRule("experts", num_experts=4), torch.randn(4 * 6, 7), [(4, 6, 7)]),
        (SplitRule("experts", num_experts=4), torch.randn(4, 6, 7), [(4, 6, 7)]),
        (SplitRule("experts", num_experts=2, split_glu=True), torch.randn(2, 8, 3), [(2, 4, 3), (2, 4, 3)]),
    ]
    for rule, m, shapes in cases:
        pieces = rule.pieces(m)
        assert [tuple(p.shape) for p in pieces] == shapes == rule.piece_shapes(m.shape)
        assert len(rule.piece_names()) == len(pieces)
        assert torch.equal(rule.assemble([p.clone() for p in pieces], m), m)
    assert set(SPLIT_KINDS) == {"none", "qkv", "glu", "experts"}


def test_split_rule_errors():
    with pytest.raises(ValueError, match="unknown split kind"):
        SplitRule("rows")
    with pytest.raises(ValueError, match="per_head applies to kind='qkv'"):
        SplitRule("glu", per_head=True)
    with pytest.raises(ValueError, match="needs num_attention_heads"):
        SplitRule("qkv")
    with pytest.raises(ValueError, match="num_experts"):
        SplitRule("experts")
    with pytest.raises(ValueError, match="expects pieces of shapes"):
        SplitRule("glu").assemble([torch.zeros(5, 7)], torch.zeros(10, 7))


def test_rule_for_megatron_param_defaults_and_options():
    cfg = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=16, hidden_size=128,
                          attention_output_gate=False, gated_linear_unit=True)
    qkv = "decoder.layers.3.self_attention.linear_qkv.weight"
    fc1 = "decoder.layers.3.mlp.linear_fc1.weight"
    qkv_shape, fc1_shape = ((8 + 4) * 16, 128), (2 * 344, 128)
    # defaults: every matrix whole
    for name, shape in ((qkv, qkv_shape), (fc1, fc1_shape), ("decoder.layers.3.mlp.linear_fc2.weight", (128, 344))):
        assert rule_for_megatron_param(name, shape, cfg) == SplitRule("none")
    rule = rule_for_megatron_param(qkv, qkv_shape, cfg, split_qkv=True)
    assert rule.kind == "qkv" and rule.piece_shapes(qkv_shape) == [(128, 128), (32, 128), (32, 128)]
    rule = rule_for_megatron_param(qkv, qkv_shape, cfg, split_qkv=True, qkv_per_head=True)
    assert rule.piece_shapes(qkv_shape) == [(8, 16, 128), (2, 16, 128), (2, 16, 128)]
    assert rule_for_megatron_param(qkv, qkv_shape, cfg, per_head=True) == rule  # implies split_qkv
    assert rule_for_megatron_param(fc1, fc1_shape, cfg, split_glu=True).kind == "glu"
    expert = "decoder.layers.3.mlp.experts.linear_fc1.weight5"
    assert rule_for_megatron_param(expert, fc1_shape, cfg, split_glu=True) == SplitRule("glu")
    stacked = rule_for_megatron_param("decoder.layers.3.mlp.experts.linear_fc1.weight", (4, 688, 128), cfg,
                                      split_glu=True)
    assert stacked == SplitRule("experts", num_experts=4, split_glu=True)
    no_glu = SimpleNamespace(**{**vars(cfg), "gated_linear_unit": False})
    assert rule_for_megatron_param(fc1, (344, 128), no_glu, split_glu=True).kind == "none"
    assert rule_for_megatron_param("decoder.final_layernorm.weight", (128,), cfg, split_qkv=True).kind == "none"
    with pytest.raises(ValueError, match="un-sharded"):
        rule_for_megatron_param(qkv, (96, 128), cfg, split_qkv=True)  # a TP shard, not the full matrix


@pytest.fixture(scope="module")
def megatron_tp2_layouts():
    return run_distributed("splitting_workers:layer_layouts", 2, sys_path=[HERE],
                           kwargs=dict(hidden=32, heads=8, groups=2, ffn=24))


@pytest.mark.parametrize("gated", [False, True])
def test_matches_megatron_linear_qkv_under_tp2(megatron_tp2_layouts, gated):
    heads, groups, hidden = 8, 2, 32
    hd = hidden // heads
    rows = (heads + 2 * groups + (heads if gated else 0)) * hd
    master = torch.arange(rows * hidden, dtype=torch.float32).reshape(rows, hidden)
    ranks = [r[gated] for r in megatron_tp2_layouts]
    assert all(r["qkv_stride"] == 1 for r in ranks)
    # the full matrix an owner assembles = concatenation of the TP shards = the canonical layout
    assert torch.equal(torch.cat([r["qkv_weight"] for r in ranks]), master)
    rule = SplitRule("qkv", per_head=True, num_attention_heads=heads, num_query_groups=groups, gated=gated)
    ours = dict(zip(rule.piece_names(), rule.pieces(master)))  # [heads, hd, hidden] stacks
    for rank, r in enumerate(ranks):
        assert r["rule_piece_shapes"] == rule.piece_shapes(master.shape)
        for name, t in r["qkv_out"].items():  # Megatron: [s, b=1, local heads, hd], input = identity
            local = t[:, 0].permute(1, 2, 0)  # -> [local heads, hd, hidden]
            n = local.size(0)
            assert torch.equal(local, ours[name][rank * n:(rank + 1) * n]), (rank, name)


def test_matches_megatron_glu_fc1_under_tp2(megatron_tp2_layouts):
    ffn, hidden = 24, 32
    master = torch.arange(2 * ffn * hidden, dtype=torch.float32).reshape(2 * ffn, hidden)
    ranks = [r[False] for r in megatron_tp2_layouts]
    assert all(r["fc1_stride"] == 2 for r in ranks)
    full = torch.cat([r["fc1_weight"] for r in ranks])
    assert not torch.equal(full, master)  # stride 2: concatenated shards are interleaved
    gate, up = glu_split(full, tp_shards=2)
    assert torch.equal(gate, master[:ffn]) and torch.equal(up, master[ffn:])
    rule = rule_for_megatron_param("decoder.layers.0.mlp.linear_fc1.weight", full.shape,
                                   SimpleNamespace(gated_linear_unit=True), split_glu=True, tp_shards=2)
    assert torch.equal(rule.assemble(rule.pieces(full), full), full)
