"""The experiment pieces: BPE round trip, the batched GPT's causal mask and per-agent independence."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "demuon"))

from batched_gpt import GPTConfig, forward, init_params, make_layout, per_agent_loss  # noqa: E402
from bpe import BytePairTokenizer  # noqa: E402
from stdlib_data import mean_symmetric_kl  # noqa: E402

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\tüñíçødé\r\n" * 20
)


def test_bpe_round_trip_and_merges():
    tok = BytePairTokenizer.train(TEXT, 300)
    assert tok.vocab_size == 300
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode()) / 2  # merges compress the repeated text
    assert {"self", "return", "class"} <= {tok.decode([i]) for i in range(256, 300)}
    with pytest.raises(ValueError, match="vocab_size must be"):
        BytePairTokenizer.train(TEXT, 100)


def test_paper_gpt_shape_parameter_count():
    # 2 layers, d=256, 4 heads, ff=1024, 4096-token BPE vocabulary, 64 positions, untied head
    layout = make_layout(GPTConfig())
    assert layout.total_numel == 3_693_568
    assert sum(1 for s in layout.slots if s.matrix_shape is not None) == 11


def test_causal_mask_is_real():
    cfg = GPTConfig(vocab_size=50, seq_len=12, d_model=16, n_layer=2, n_head=4, d_ff=32)
    layout = make_layout(cfg)
    flat = init_params(cfg, layout, seed=1).repeat(2, 1) * 5  # larger weights: strong attention
    idx = torch.randint(0, 50, (2, 3, 12), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, :, 7:] = (changed[:, :, 7:] + 1) % 50
    with torch.no_grad():
        a, b = forward(cfg, layout, flat, idx), forward(cfg, layout, flat, changed)
    assert torch.equal(a[:, :, :7], b[:, :, :7])  # positions < 7 never see tokens ≥ 7
    assert (a[:, :, 7:] - b[:, :, 7:]).abs().max() > 1e-3


def test_agents_are_independent_and_equal_single_agent_runs():
    cfg = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layer=1, n_head=2, d_ff=24)
    layout = make_layout(cfg)
    gen = torch.Generator().manual_seed(2)
    flat = init_params(cfg, layout).repeat(3, 1) + 0.01 * torch.randn(3, layout.total_numel, generator=gen)
    idx = torch.randint(0, 40, (3, 2, 8), generator=gen)
    targets = torch.randint(0, 40, (3, 2, 8), generator=gen)
    leaf = flat.clone().requires_grad_(True)
    losses = per_agent_loss(cfg, layout, leaf, idx, targets)
    losses.sum().backward()
    for a in range(3):
        one = flat[a : a + 1].clone().requires_grad_(True)
        loss = per_agent_loss(cfg, layout, one, idx[a : a + 1], targets[a : a + 1])
        loss.sum().backward()
        assert torch.allclose(loss, losses[a : a + 1], atol=1e-6)
        assert torch.allclose(one.grad[0], leaf.grad[a], atol=1e-6)


def test_heterogeneity_measure():
    same = [torch.tensor([0, 1, 2, 3] * 10), torch.tensor([3, 2, 1, 0] * 10)]
    different = [torch.tensor([0, 0, 0, 1] * 10), torch.tensor([2, 3, 3, 3] * 10)]
    assert mean_symmetric_kl(same, 4) == pytest.approx(0.0, abs=1e-12)
    assert mean_symmetric_kl(different, 4) > 1.0
