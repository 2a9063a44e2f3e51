"""Mixing matrices: the built-in graphs match their stated formulas; bad matrices are refused."""
import math

import pytest
import torch

from megatron_dmuon.decentralized.topology import (
    complete_graph,
    directed_exponential_graph,
    from_mixing_matrix,
    make_topology,
    mixing_rate,
    ring_graph,
)


def shift(n, power=1):
    s = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        s[i, (i + power) % n] = 1.0
    return s


def test_directed_exponential_n8_is_stated_matrix():
    topo = directed_exponential_graph(8)
    S = shift(8)
    expected = 0.4 * torch.eye(8, dtype=torch.float64) + 0.2 * (S + S @ S + torch.linalg.matrix_power(S, 4))
    assert torch.allclose(topo.weights, expected, atol=1e-15, rtol=0)
    assert not topo.is_symmetric and not topo.is_complete
    # agent i receives from i+1, i+2, i+4 and sends to i-1, i-2, i-4
    assert topo.in_neighbors[0] == (1, 2, 4)
    assert topo.out_neighbors[0] == (4, 6, 7)
    # λ = ‖W − 11ᵀ/8‖₂: the reference notes 0.6 for this graph
    assert topo.mixing_rate == pytest.approx(0.6, abs=1e-12)
    assert topo.spectral_gap == pytest.approx(0.4, abs=1e-12)


def test_ring_and_complete_match_formulas():
    ring = ring_graph(8)
    S = shift(8)
    assert torch.allclose(ring.weights, (torch.eye(8, dtype=torch.float64) + S + S.T) / 3, atol=1e-15, rtol=0)
    # eigenvalues (1 + 2cos(2πk/8))/3: λ = (1 + √2)/3
    assert ring.mixing_rate == pytest.approx((1 + math.sqrt(2)) / 3, abs=1e-12)
    assert ring.in_neighbors[0] == (1, 7) and ring.is_symmetric
    complete = complete_graph(8)
    assert torch.equal(complete.weights, torch.full((8, 8), 1 / 8, dtype=torch.float64))
    assert complete.mixing_rate == pytest.approx(0.0, abs=1e-12) and complete.is_complete


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 9, 16])
def test_builtin_graphs_are_doubly_stochastic_and_mixing(n):
    for name in ("complete", "ring", "directed_exponential"):
        topo = make_topology(name, n)
        w = topo.weights
        assert torch.allclose(w.sum(0), torch.ones(n, dtype=torch.float64), atol=1e-14)
        assert torch.allclose(w.sum(1), torch.ones(n, dtype=torch.float64), atol=1e-14)
        assert topo.mixing_rate < 1.0 or n == 1
        # λ is the contraction of disagreement: check on a random stack
        x = torch.randn(n, 5, dtype=torch.float64)
        dev = x - x.mean(0)
        mixed = w @ x
        assert (mixed - mixed.mean(0)).norm() <= topo.mixing_rate * dev.norm() + 1e-12


def test_directed_exponential_n4_weights():
    # N=4: hops +1, +2, in-degree 3 with the self-loop → off-diagonal 1/4, diagonal 1/2
    w = directed_exponential_graph(4).weights
    S = shift(4)
    assert torch.allclose(w, 0.5 * torch.eye(4, dtype=torch.float64) + 0.25 * (S + S @ S), atol=1e-15)


def test_user_matrix_accepted_and_reports_rate():
    w = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]], dtype=torch.float64)
    topo = from_mixing_matrix(w, name="mine")
    assert topo.num_agents == 3 and topo.name == "mine"
    assert topo.mixing_rate == pytest.approx(mixing_rate(w))
    assert topo.mixing_rate == pytest.approx(0.5, abs=1e-12)  # |(1+ω)/2| for a cube root of unity ω
    assert topo.in_neighbors == ((1,), (2,), (0,)) and topo.out_neighbors == ((2,), (0,), (1,))


@pytest.mark.parametrize(
    "matrix, message",
    [
        ([[0.6, 0.6], [0.4, 0.4]], "not row-stochastic: row 0 sums to 1.2"),
        ([[0.5, 0.5], [0.9, 0.1]], "not column-stochastic: column 0 sums to 1.4"),
        ([[1.2, -0.2], [-0.2, 1.2]], "nonnegative; W[0, 1]"),
        ([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.0, 0.5, 0.5]], "disconnected"),
        ([[0.0, 1.0], [1.0, 0.0]], "does not mix"),
        ([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]], "square"),
        ([[float("nan"), 1.0], [1.0, 0.0]], "NaN"),
    ],
)
def test_bad_mixing_matrices_raise_clear_errors(matrix, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_mixing_matrix(torch.tensor(matrix, dtype=torch.float64))


def test_unknown_graph_name_and_bad_size():
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        make_topology("star", 4)
    with pytest.raises(ValueError, match="num_agents must be a positive int"):
        ring_graph(0)
