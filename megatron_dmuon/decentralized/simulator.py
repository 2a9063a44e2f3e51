"""Single-process N-agent simulator for the decentralized methods of ``decentralized.demuon``.

All agents' parameters are one stacked tensor ``[N, P]``; a gossip round is one matmul
``W @ X``. The algorithm code is exactly the one the multi-process runtime runs (only the mixer
differs), so a simulated trajectory equals the multi-process one for the same gradients.

Several independent graphs can be simulated side by side (e.g. one graph per step size): pass a
list of topologies; the mixing matrix is then block diagonal and agent rows are grouped per block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .demuon import (
    DecentralizedAlgorithm,
    DecentralizedConfig,
    FlatLayout,
    consensus_error,
    stationarity_proxy,
)
from .topology import Topology

__all__ = ["StackedMixer", "DecentralizedSimulator", "vmapped_loss_and_grad"]


class StackedMixer:
    """Mixes a full stack ``[A, P]`` with a (block-diagonal) mixing matrix in one matmul."""

    def __init__(self, topologies: Topology | Sequence[Topology], device=None):
        blocks = [topologies] if isinstance(topologies, Topology) else list(topologies)
        if not blocks or not all(isinstance(t, Topology) for t in blocks):
            raise TypeError("topologies must be a Topology or a non-empty sequence of Topology objects")
        self.topologies = tuple(blocks)
        self.weights = torch.block_diag(*[t.weights for t in blocks]).to(device=device)
        self.num_local_agents = int(self.weights.shape[0])
        sizes = {t.num_agents for t in blocks}
        # Blocks are mixed separately (one bmm when all have the same size), never through the
        # zeros of the block-diagonal matrix: a diverged (NaN/Inf) block must not leak into others.
        self._uniform = len(sizes) == 1
        self._stacked = torch.stack([t.weights for t in blocks]) if self._uniform else None
        self._cast: dict[tuple, list[Tensor] | Tensor] = {}

    def mix(self, flat: Tensor) -> Tensor:
        if flat.ndim != 2 or flat.shape[0] != self.num_local_agents:
            raise ValueError(f"expected a stack [{self.num_local_agents}, P], got {tuple(flat.shape)}")
        key = (flat.device, flat.dtype)
        if key not in self._cast:
            if self._uniform:
                self._cast[key] = self._stacked.to(device=flat.device, dtype=flat.dtype)
            else:
                self._cast[key] = [t.weights.to(device=flat.device, dtype=flat.dtype) for t in self.topologies]
        weights = self._cast[key]
        if self._uniform:
            blocks, n = weights.shape[0], weights.shape[1]
            return torch.bmm(weights, flat.reshape(blocks, n, flat.shape[1])).reshape(flat.shape)
        return torch.cat([w @ flat[s] for w, s in zip(weights, self.block_slices())])

    def block_slices(self) -> list[slice]:
        out, start = [], 0
        for t in self.topologies:
            out.append(slice(start, start + t.num_agents))
            start += t.num_agents
        return out


class DecentralizedSimulator:
    """N agents in one process; ``step(grad_fn)`` runs one iteration of the configured method.

    Args:
        config: the method and its hyper-parameters.
        topologies: one Topology, or several run side by side as disjoint blocks.
        layout: the flat layout of one agent's parameters.
        initial_params: ``[P]`` (every agent starts there, as in the DeMuon reference) or ``[A, P]``.
    """

    def __init__(
        self,
        config: DecentralizedConfig,
        topologies: Topology | Sequence[Topology],
        layout: FlatLayout,
        initial_params: Tensor,
    ):
        mixer = StackedMixer(topologies, device=initial_params.device)
        agents = mixer.num_local_agents
        if initial_params.ndim == 1:
            params = initial_params.detach().unsqueeze(0).repeat(agents, 1)
        elif initial_params.ndim == 2 and initial_params.shape[0] == agents:
            params = initial_params.detach().clone()
        else:
            raise ValueError(
                f"initial_params must be [P] or [{agents}, P] for {agents} agents, got {tuple(initial_params.shape)}"
            )
        self.mixer = mixer
        self.layout = layout
        self.algorithm = DecentralizedAlgorithm(config, layout, mixer, params)

    @property
    def params(self) -> Tensor:
        return self.algorithm.params

    @property
    def num_agents(self) -> int:
        return self.mixer.num_local_agents

    def step(self, grad_fn: Callable[[Tensor], Tensor]) -> None:
        """``grad_fn(points [A, P]) -> grads [A, P]``; must use one minibatch for all its calls."""
        grads = [grad_fn(point) for point in self.algorithm.gradient_points()]
        self.algorithm.step(grads)

    def block_average(self) -> Tensor:
        """The averaged model X̄ of each block, ``[num_blocks, P]``."""
        return torch.stack([self.params[s].mean(dim=0) for s in self.mixer.block_slices()])

    def consensus_errors(self) -> list[float]:
        """‖X − 1⊗X̄‖_F of each block."""
        return [consensus_error(self.params[s]) for s in self.mixer.block_slices()]

    def stationarity_proxies(self) -> list[float]:
        """‖mean of the latest (combined) stochastic gradients‖_F of each block (NaN before step 1)."""
        g = self.algorithm.last_grad
        if g is None:
            return [float("nan")] * len(self.mixer.topologies)
        return [stationarity_proxy(g[s]) for s in self.mixer.block_slices()]


def vmapped_loss_and_grad(
    module: torch.nn.Module,
    layout: FlatLayout,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Per-agent loss and gradient of an ``nn.Module`` at stacked flat parameters.

    Returns ``f(flat [A, P], inputs [A, ...], targets [A, ...]) -> (losses [A], grads [A, P])``
    computed with ``torch.func.functional_call`` under ``vmap`` (one batched pass for all agents).
    """
    from torch.func import functional_call, grad_and_value, vmap

    names = [slot.name for slot in layout.slots]
    module_params = dict(module.named_parameters())
    missing = [n for n in names if n not in module_params]
    if missing:
        raise ValueError(f"layout names not found in the module: {missing}")
    buffers = dict(module.named_buffers())

    def agent_loss(row: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
        params = {s.name: row[s.offset : s.offset + s.numel].view(s.shape) for s in layout.slots}
        params.update(buffers)
        return loss_fn(functional_call(module, params, (inputs,)), targets)

    batched = vmap(grad_and_value(agent_loss))

    def loss_and_grad(flat: Tensor, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        grads, losses = batched(flat, inputs, targets)
        return losses, grads

    return loss_and_grad
