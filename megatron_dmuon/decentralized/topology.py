"""Communication graphs and mixing matrices for decentralized optimization (DeMuon and baselines).

Convention (the DeMuon reference's): one gossip round maps the stacked agent values
``X = [X_0; ...; X_{N-1}]`` to ``W X``, i.e. agent ``i`` receives ``Σ_j W[i, j] X_j``. Agent ``i``
therefore *receives from* every ``j`` with ``W[i, j] > 0`` (its in-neighbours) and *sends to*
every ``j`` with ``W[j, i] > 0`` (its out-neighbours).

Every mixing matrix must be doubly stochastic (rows sum to 1 so consensus is a fixed point;
columns sum to 1 so the network average, and with it gradient tracking's invariant
``mean(V) = mean(M)``, is preserved), nonnegative and strongly connected. Its mixing rate is
``λ = ‖W − 11ᵀ/N‖₂`` (the second largest singular value for doubly stochastic W) and must be < 1;
the spectral gap is ``1 − λ``.

Built-in graphs (N agents; ``S`` is the cyclic shift ``S[i, (i+1) mod N] = 1``):

* ``complete``: ``W = 11ᵀ/N`` (λ = 0).
* ``ring``: Metropolis weights ``1/(1 + max(deg_i, deg_j))`` on the undirected cycle (deg = 2
  neighbours), the rest on the diagonal; for N ≥ 3 ``W = (I + S + Sᵀ)/3``.
* ``directed_exponential``: agent ``i`` receives from ``(i + 2^h) mod N`` for
  ``h = 0..⌊log₂(N−1)⌋`` plus itself, Metropolis weights ``1/(1 + max(deg_i, deg_j))`` with
  ``deg`` the (uniform) in-degree *counting the self-loop* (as the DeMuon reference builds it);
  for N = 8 this is
  ``W = 0.4 I + 0.2 (S + S² + S⁴)`` — doubly stochastic but not symmetric.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

__all__ = [
    "Topology",
    "complete_graph",
    "ring_graph",
    "directed_exponential_graph",
    "from_mixing_matrix",
    "make_topology",
    "mixing_rate",
    "TOPOLOGY_NAMES",
]

TOPOLOGY_NAMES = ("complete", "ring", "directed_exponential")

# Tolerance on row/column sums: float64 arithmetic on user input (e.g. 1/3 written to 17 digits).
STOCHASTIC_ATOL = 1e-9


@dataclasses.dataclass(frozen=True)
class Topology:
    """A validated mixing matrix plus the neighbour lists the runtimes exchange over."""

    name: str
    weights: torch.Tensor  # [N, N] float64, doubly stochastic
    mixing_rate: float  # λ = ‖W − 11ᵀ/N‖₂
    in_neighbors: tuple[tuple[int, ...], ...]  # in_neighbors[i] = sorted j ≠ i with W[i, j] > 0
    out_neighbors: tuple[tuple[int, ...], ...]  # out_neighbors[i] = sorted j ≠ i with W[j, i] > 0

    @property
    def num_agents(self) -> int:
        return int(self.weights.shape[0])

    @property
    def spectral_gap(self) -> float:
        return 1.0 - self.mixing_rate

    @property
    def is_complete(self) -> bool:
        """Every agent receives from every other agent (an all_gather then serves the exchange)."""
        return all(len(nbrs) == self.num_agents - 1 for nbrs in self.in_neighbors)

    @property
    def is_symmetric(self) -> bool:
        return bool(torch.equal(self.weights, self.weights.T))

    def describe(self) -> str:
        return (
            f"{self.name}: N={self.num_agents}, mixing rate λ={self.mixing_rate:.6f}, "
            f"spectral gap={self.spectral_gap:.6f}, "
            f"max in-degree={max((len(n) for n in self.in_neighbors), default=0)}"
        )


def _shift(n: int, power: int) -> torch.Tensor:
    """``S^power`` with ``S[i, (i+1) mod n] = 1``."""
    idx = torch.arange(n)
    s = torch.zeros(n, n, dtype=torch.float64)
    s[idx, (idx + power) % n] = 1.0
    return s


def _metropolis(adjacency: torch.Tensor) -> torch.Tensor:
    """Metropolis weights on a 0/1 adjacency; deg = row sums (a self-loop counts if present)."""
    n = adjacency.shape[0]
    deg = adjacency.sum(dim=1)
    weights = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            if i != j and adjacency[i, j] > 0:
                weights[i, j] = 1.0 / (1.0 + max(float(deg[i]), float(deg[j])))
        weights[i, i] = 1.0 - weights[i].sum()
    return weights


def _check_num_agents(num_agents: int) -> int:
    if isinstance(num_agents, bool) or not isinstance(num_agents, int) or num_agents < 1:
        raise ValueError(f"num_agents must be a positive int, got {num_agents!r}")
    return num_agents


def complete_graph(num_agents: int) -> Topology:
    n = _check_num_agents(num_agents)
    return from_mixing_matrix(torch.full((n, n), 1.0 / n, dtype=torch.float64), name="complete")


def ring_graph(num_agents: int) -> Topology:
    n = _check_num_agents(num_agents)
    # no self-loops in the adjacency: deg = 2 neighbours, so 1/(1+2) = 1/3 per edge (the reference's)
    adjacency = torch.zeros(n, n, dtype=torch.float64)
    if n > 1:
        adjacency = ((_shift(n, 1) + _shift(n, -1)) > 0).to(torch.float64)
    return from_mixing_matrix(_metropolis(adjacency), name="ring")


def directed_exponential_graph(num_agents: int) -> Topology:
    n = _check_num_agents(num_agents)
    adjacency = torch.eye(n, dtype=torch.float64)
    if n > 1:
        for h in range(int(math.floor(math.log2(n - 1))) + 1):
            adjacency = adjacency + _shift(n, 2**h)
    return from_mixing_matrix(_metropolis((adjacency > 0).to(torch.float64)), name="directed_exponential")


def make_topology(name: str, num_agents: int) -> Topology:
    builders = {
        "complete": complete_graph,
        "ring": ring_graph,
        "directed_exponential": directed_exponential_graph,
        "exp": directed_exponential_graph,
    }
    if name not in builders:
        raise ValueError(
            f"unknown topology {name!r}; choose one of {TOPOLOGY_NAMES} "
            "or pass your own mixing matrix to from_mixing_matrix(W)"
        )
    return builders[name](num_agents)


def mixing_rate(weights: torch.Tensor) -> float:
    """λ = ‖W − 11ᵀ/N‖₂: the factor by which one gossip round contracts disagreement."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    n = w.shape[0]
    return float(torch.linalg.matrix_norm(w - torch.full_like(w, 1.0 / n), ord=2))


def _strongly_connected(support: torch.Tensor) -> bool:
    """Every node reaches every other along edges j→i (W[i, j] > 0) and back."""
    n = support.shape[0]

    def reach(adj: torch.Tensor) -> int:
        seen = {0}
        frontier = [0]
        while frontier:
            node = frontier.pop()
            for nxt in torch.nonzero(adj[node]).flatten().tolist():
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        return len(seen)

    return reach(support) == n and reach(support.T) == n


def from_mixing_matrix(weights: torch.Tensor | Sequence[Sequence[float]], name: str = "custom") -> Topology:
    """Validate a user-given mixing matrix and wrap it as a :class:`Topology`.

    Raises ValueError (naming the offending row/column/entry and the fix) if ``weights`` is not
    square, has non-finite or negative entries, is not doubly stochastic, its graph is not
    strongly connected, or it does not mix (λ ≥ 1, e.g. a permutation without self-loops).
    """
    w = torch.as_tensor(weights, dtype=torch.float64).detach().cpu().clone()
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] == 0:
        raise ValueError(f"mixing matrix W must be square N×N with N ≥ 1, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("mixing matrix W contains NaN or Inf")
    if bool((w < 0).any()):
        i, j = torch.nonzero(w < 0)[0].tolist()
        raise ValueError(f"mixing matrix W must be nonnegative; W[{i}, {j}] = {float(w[i, j])!r}")
    row_sums, col_sums = w.sum(dim=1), w.sum(dim=0)
    bad_rows = torch.nonzero((row_sums - 1).abs() > STOCHASTIC_ATOL).flatten().tolist()
    if bad_rows:
        r = bad_rows[0]
        raise ValueError(
            f"mixing matrix W is not row-stochastic: row {r} sums to {float(row_sums[r])!r} "
            "(every row must sum to 1; normalise each row, e.g. W / W.sum(1, keepdim=True))"
        )
    bad_cols = torch.nonzero((col_sums - 1).abs() > STOCHASTIC_ATOL).flatten().tolist()
    if bad_cols:
        c = bad_cols[0]
        raise ValueError(
            f"mixing matrix W is not column-stochastic: column {c} sums to {float(col_sums[c])!r}. "
            "DeMuon's gradient tracking needs a doubly stochastic W (rows and columns sum to 1); "
            "use Metropolis weights for a directed graph with equal in/out degrees"
        )
    support = w > 0
    if not _strongly_connected(support):
        raise ValueError(
            "mixing matrix W describes a disconnected graph (not strongly connected): some agents "
            "never receive information from others, so they cannot reach consensus; add edges"
        )
    rate = mixing_rate(w)
    if rate >= 1.0 - 1e-12:
        raise ValueError(
            f"mixing matrix W does not mix: λ = ‖W − 11ᵀ/N‖₂ = {rate:.6g} ≥ 1 (a periodic graph); "
            "add self-loops (positive diagonal), e.g. W ← (I + W)/2"
        )
    n = w.shape[0]
    in_nbrs = tuple(tuple(j for j in range(n) if j != i and w[i, j] > 0) for i in range(n))
    out_nbrs = tuple(tuple(j for j in range(n) if j != i and w[j, i] > 0) for i in range(n))
    return Topology(name=name, weights=w, mixing_rate=rate, in_neighbors=in_nbrs, out_neighbors=out_nbrs)
