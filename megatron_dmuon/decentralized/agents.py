"""Multi-process decentralized training over torch.distributed: each rank of a group is one agent.

The algorithm is ``decentralized.demuon.DecentralizedAlgorithm`` (the same code the simulator runs);
this module only supplies the gossip round and a torch-optimizer-like wrapper for ``nn.Module``
parameters:

* :class:`ProcessGroupMixer` — agent ``i`` sends its flat row to its out-neighbours and receives
  its in-neighbours' rows with one batch of P2P ``isend``/``irecv`` ops, then forms
  ``Σ_j W[i, j] X_j``. For a complete graph one ``all_gather_into_tensor`` replaces the P2P ops.
  Works with gloo (CPU) and NCCL (GPU).
* :class:`DecentralizedOptimizer` — rebinds the given parameters to views of one flat buffer,
  reads ``p.grad`` after the caller's backward, and steps. It performs no gradient averaging,
  so use it on a plain model or a megatron-core model that is **not** wrapped in Megatron's DDP
  (decentralized agents must not all-reduce gradients). Agents are the ranks of ``group`` (e.g.
  Megatron's data-parallel group); tensor-parallel shards would be orthogonalized per shard, so
  use TP = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .demuon import DecentralizedAlgorithm, DecentralizedConfig, FlatLayout, default_is_matrix
from .topology import Topology

__all__ = [
    "ProcessGroupMixer",
    "DecentralizedOptimizer",
    "distributed_consensus_error",
    "distributed_stationarity_proxy",
]


class ProcessGroupMixer:
    """One gossip round for the local agent (rank ``dist.get_rank(group)`` of ``group``)."""

    num_local_agents = 1

    def __init__(self, topology: Topology, group=None, use_all_gather: bool | None = None):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        world = dist.get_world_size(group)
        if world != topology.num_agents:
            raise ValueError(
                f"topology {topology.name!r} has {topology.num_agents} agents but the process group has "
                f"{world} ranks; build the topology with num_agents={world} (one agent per rank)"
            )
        self.topology = topology
        self.group = group
        self.agent = dist.get_rank(group)
        self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
        self.row = topology.weights[self.agent]
        self.in_neighbors = topology.in_neighbors[self.agent]
        self.out_neighbors = topology.out_neighbors[self.agent]
        self.use_all_gather = topology.is_complete if use_all_gather is None else bool(use_all_gather)
        self.bytes_sent = 0  # payload this agent has sent, for communication accounting

    def mix(self, flat: Tensor) -> Tensor:
        if flat.ndim != 2 or flat.shape[0] != 1:
            raise ValueError(f"expected this agent's row [1, P], got {tuple(flat.shape)}")
        flat = flat.contiguous()
        n = self.topology.num_agents
        if n == 1:
            return flat.clone()
        weights = self.row.to(device=flat.device, dtype=flat.dtype)
        if self.use_all_gather:
            gathered = torch.empty((n, flat.shape[1]), dtype=flat.dtype, device=flat.device)
            dist.all_gather_into_tensor(gathered, flat, group=self.group)
            self.bytes_sent += flat.numel() * flat.element_size()
            rows = {j: gathered[j : j + 1] for j in range(n) if j != self.agent}
        else:
            rows = {j: torch.empty_like(flat) for j in self.in_neighbors}
            ops = [dist.P2POp(dist.isend, flat, self.global_ranks[j], self.group) for j in self.out_neighbors]
            ops += [dist.P2POp(dist.irecv, rows[j], self.global_ranks[j], self.group) for j in self.in_neighbors]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            self.bytes_sent += flat.numel() * flat.element_size() * len(self.out_neighbors)
        # Σ_j W[i, j] X_j in ascending j, the self term included in its place
        out = None
        for j in range(n):
            if j != self.agent and (j not in rows or float(self.row[j]) == 0.0):
                continue
            term = (flat if j == self.agent else rows[j]) * weights[j]
            out = term if out is None else out + term
        return out


def distributed_consensus_error(flat: Tensor, group=None) -> float:
    """‖X − 1⊗X̄‖_F across the group's agents, each rank passing its row ``[1, P]`` (collective)."""
    world = dist.get_world_size(group)
    x = flat.detach().double()
    mean = x.clone()
    dist.all_reduce(mean, group=group)
    mean /= world
    sq = (x - mean).pow(2).sum().reshape(1)
    dist.all_reduce(sq, group=group)
    return float(sq.sqrt())


def distributed_stationarity_proxy(grad: Tensor, group=None) -> float:
    """‖(1/N) Σ_i G_i‖_F across the group, each rank passing its latest gradient row (collective)."""
    g = grad.detach().double().clone()
    dist.all_reduce(g, group=group)
    g /= dist.get_world_size(group)
    return float(g.pow(2).sum().sqrt())


class DecentralizedOptimizer:
    """Torch-optimizer-like decentralized method for one agent's parameters on this rank.

    Usage::

        opt = DecentralizedOptimizer(model.named_parameters(), config, ring_graph(world_size))
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()

    DeMuon-A needs gradients at its extrapolation points: call ``opt.step(closure)`` where
    ``closure()`` zeroes nothing, runs forward + backward on this iteration's minibatch and
    returns the loss; it is called once per point.

    All ranks must start from the same parameters (as in the DeMuon reference); pass
    ``broadcast_from=0`` to copy rank 0's initial values to every agent.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
        config: DecentralizedConfig,
        topology: Topology,
        group=None,
        is_matrix: Callable[[str, Sequence[int]], bool] = default_is_matrix,
        broadcast_from: int | None = None,
    ):
        config.validate()
        named = []
        for i, item in enumerate(params):
            name, p = item if isinstance(item, tuple) else (f"param{i}", item)
            if p.requires_grad:
                named.append((name, p))
        if not named:
            raise ValueError("params is empty (or no parameter requires grad)")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all parameters must share one dtype and device (got dtypes {sorted(map(str, dtypes))}, "
                f"devices {sorted(map(str, devices))}); keep fp32 master copies in one dtype"
            )
        mixer = ProcessGroupMixer(topology, group)  # validates world size before any state changes
        layout = FlatLayout([(n, tuple(p.shape)) for n, p in named], is_matrix)
        flat = torch.empty((1, layout.total_numel), dtype=dtypes.pop(), device=devices.pop())
        for (_, p), slot in zip(named, layout.slots):
            flat[0, slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        if broadcast_from is not None:
            dist.broadcast(flat, src=mixer.global_ranks[broadcast_from], group=group)
        for (_, p), view in zip(named, layout.views(flat)):
            p.data = view[0]  # the module now reads the algorithm's live parameters
        self.params = [p for _, p in named]
        self.names = [n for n, _ in named]
        self.layout, self.mixer, self.group = layout, mixer, group
        self.flat = flat
        self.algorithm = DecentralizedAlgorithm(config, layout, mixer, flat)

    @property
    def config(self) -> DecentralizedConfig:
        return self.algorithm.config

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _flat_grad(self) -> Tensor:
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(1, -1).to(self.flat.dtype)
            for p in self.params
        ]
        return torch.cat(grads, dim=1)

    def step(self, closure: Callable[[], Tensor] | None = None):
        """One iteration. Without a closure, uses the ``.grad`` of the current backward pass."""
        if self.algorithm.extrapolation is None:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self.algorithm.step([self._flat_grad()])
            return loss
        if closure is None:
            raise ValueError("method='demuon_a' evaluates gradients at extrapolation points: pass step(closure)")
        current = self.flat.clone()
        points = [p.clone() for p in self.algorithm.gradient_points()]
        grads, first_loss = [], None
        for point in points:
            self.flat.copy_(point)
            self.zero_grad()
            with torch.enable_grad():
                loss = closure()
            first_loss = loss if first_loss is None else first_loss
            grads.append(self._flat_grad())
        self.flat.copy_(current)
        self.algorithm.step(grads)
        return first_loss

    def consensus_error(self) -> float:
        return distributed_consensus_error(self.flat, self.group)

    def stationarity_proxy(self) -> float:
        """‖mean over agents of the latest (combined) gradients‖_F; collective; NaN before step 1."""
        if self.algorithm.last_grad is None:
            return float("nan")
        return distributed_stationarity_proxy(self.algorithm.last_grad, self.group)

    def state_dict(self) -> dict:
        return {
            "step_count": self.algorithm.step_count,
            "names": list(self.names),
            "state": {k: v.detach().clone() for k, v in self.algorithm.state_tensors().items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if list(state.get("names", [])) != self.names:
            raise ValueError("state_dict was saved for a different parameter list")
        live = self.algorithm.state_tensors()
        if set(state["state"]) != set(live):
            raise ValueError(f"state_dict holds {sorted(state['state'])}, expected {sorted(live)}")
        for k, v in state["state"].items():
            live[k].copy_(v)
        self.algorithm.step_count = int(state["step_count"])
