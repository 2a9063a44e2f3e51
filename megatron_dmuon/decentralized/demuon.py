"""DeMuon, DeMuon-A and the decentralized baselines DSGD, DSGD-C, DSGD-N (pure tensor math).

Every algorithm here works on *flat agent stacks*: a tensor ``[A, P]`` whose row ``a`` holds all
``P`` parameters of one agent, laid out by a :class:`FlatLayout`. ``A`` is the number of agents
held by the caller: all N in the single-process simulator, 1 on each rank of the multi-process
runtime. Communication is delegated to a *mixer* — any object with ``mix(flat) -> W·flat``
restricted to the local rows — so both runtimes run this one code path.

Per iteration k (ATC form, as the DeMuon reference code; ``θ = 1 − μ``):

* ``demuon``:   ``M ← μM + θG``; ``V ← mix(V + M_new − M_old)``; ``X ← mix(X − η D(V))``
  where ``D`` is msgn (``UVᵀ``) for matrices and ``v/‖v‖₂`` for every other tensor.
* ``demuon_a``: the same with ``G = Σ_s a_s ∇f(X + c_s(X − X_prev))`` (multi-extrapolated
  momentum, see :mod:`.extrapolation`); ``q`` gradient evaluations per iteration.
* ``dsgd``:     ``X ← mix(X − ηG)``.
* ``dsgd_c``:   ``X ← mix(X − η clip(G, τ_k))``, each agent's whole gradient clipped to
  ``‖·‖₂ ≤ τ_k = clip_scale · k^clip_exponent`` (``torch.nn.utils.clip_grad_norm_``'s rule).
* ``dsgd_n``:   DeMuon's M/V tracking with ``X ← mix(X − η V/‖V‖₂)``, one norm over all of an
  agent's parameters.

M and V start at zero; gradients are supplied by the caller at the points returned by
:meth:`DecentralizedAlgorithm.gradient_points` (the current iterate, or DeMuon-A's extrapolation
points — evaluate all of them on the same minibatch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from ..algorithms.newton_schulz import msgn_svd, newton_schulz
from .extrapolation import ExtrapolationScheme, extrapolation_scheme

__all__ = [
    "METHODS",
    "DecentralizedConfig",
    "ParamSlot",
    "FlatLayout",
    "Mixer",
    "DecentralizedAlgorithm",
    "default_is_matrix",
    "consensus_error",
    "stationarity_proxy",
    "agent_norms",
]

METHODS = ("demuon", "demuon_a", "dsgd", "dsgd_c", "dsgd_n")
TRACKING_METHODS = ("demuon", "demuon_a", "dsgd_n")
ORTHOGONALIZERS = ("newton_schulz", "svd")
MSGN_SCALES = ("none", "keller")


@dataclasses.dataclass
class DecentralizedConfig:
    """Hyper-parameters of one decentralized method (names follow the DeMuon paper's notation).

    ``lr`` may be a float or, in the simulator, a tensor ``[A]`` giving each local agent its own
    step size (used to run several step sizes side by side on disjoint graph copies).
    """

    method: str = "demuon"
    lr: float | Tensor = 0.02
    momentum: float = 0.8  # μ in M ← μM + (1−μ)G
    orthogonalizer: str = "newton_schulz"  # msgn by Newton–Schulz or by exact float64 SVD
    ns_coefficients: str = "keller"
    ns_steps: int = 5
    ns_dtype: torch.dtype = torch.bfloat16
    msgn_scale: str = "none"  # "keller": multiply msgn by sqrt(max(1, rows/cols))
    clip_scale: float = 0.1  # DSGD-C: τ_k = clip_scale · k^clip_exponent
    clip_exponent: float = 0.4
    extrapolation_points: int = 2  # DeMuon-A's q
    extrapolation_ratios: tuple[float, ...] | None = None

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if isinstance(self.lr, Tensor):
            if self.lr.ndim != 1 or not bool((self.lr >= 0).all()):
                raise ValueError("lr as a tensor must be 1-D (one step size per local agent) and nonnegative")
        elif not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be a finite number ≥ 0, got {self.lr!r}")
        if not (0.0 <= float(self.momentum) < 1.0):
            raise ValueError(f"momentum μ must lie in [0, 1), got {self.momentum!r}")
        if self.orthogonalizer not in ORTHOGONALIZERS:
            raise ValueError(f"orthogonalizer must be one of {ORTHOGONALIZERS}, got {self.orthogonalizer!r}")
        if self.msgn_scale not in MSGN_SCALES:
            raise ValueError(f"msgn_scale must be one of {MSGN_SCALES}, got {self.msgn_scale!r}")
        if not (self.clip_scale > 0):
            raise ValueError(f"clip_scale must be > 0, got {self.clip_scale!r}")
        if self.method == "demuon_a":
            extrapolation_scheme(float(self.momentum), self.extrapolation_points, self.extrapolation_ratios)


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    matrix_shape: tuple[int, int] | None  # (rows, cols) msgn acts on; None → normalized vector rule


def default_is_matrix(name: str, shape: Sequence[int]) -> bool:
    """A tensor with ≥ 2 dimensions of size > 1 is a matrix (as the reference's ``squeeze``)."""
    return sum(1 for s in shape if s > 1) >= 2


class FlatLayout:
    """Where each parameter lives in an agent's flat row, and which ones msgn treats as matrices.

    A matrix parameter of shape ``(d0, d1, ..., dk)`` (size-1 dims dropped) is orthogonalized as
    ``d0 × (d1···dk)`` (the Muon convention for conv kernels); everything else gets ``v/‖v‖₂``.
    """

    def __init__(
        self,
        named_shapes: Sequence[tuple[str, Sequence[int]]],
        is_matrix: Callable[[str, Sequence[int]], bool] = default_is_matrix,
    ):
        slots, offset, seen = [], 0, set()
        for name, shape in named_shapes:
            if name in seen:
                raise ValueError(f"duplicate parameter name {name!r} in the layout")
            seen.add(name)
            shape = tuple(int(s) for s in shape)
            numel = math.prod(shape)
            squeezed = [s for s in shape if s != 1]
            matrix_shape = None
            if is_matrix(name, shape):
                if len(squeezed) < 2:
                    raise ValueError(f"parameter {name!r} of shape {shape} was marked a matrix but has < 2 non-unit dims")
                matrix_shape = (squeezed[0], numel // squeezed[0])
            slots.append(ParamSlot(name, shape, offset, numel, matrix_shape))
            offset += numel
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.total_numel = offset
        groups: dict[tuple[int, int], list[ParamSlot]] = {}
        for slot in self.slots:
            if slot.matrix_shape is not None:
                groups.setdefault(slot.matrix_shape, []).append(slot)
        self.matrix_groups = groups  # same-shape matrices are orthogonalized in one batched call
        self.vector_slots = tuple(s for s in self.slots if s.matrix_shape is None)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views ``[A, *shape]`` into a flat ``[A, P]`` tensor (no copies)."""
        self._check(flat)
        return [flat[:, s.offset : s.offset + s.numel].view(flat.shape[0], *s.shape) for s in self.slots]

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """Inverse of :meth:`views`: ``[A, *shape]`` tensors → one new ``[A, P]`` tensor."""
        if len(tensors) != len(self.slots):
            raise ValueError(f"expected {len(self.slots)} tensors, got {len(tensors)}")
        for t, s in zip(tensors, self.slots):
            if tuple(t.shape[1:]) != s.shape:
                raise ValueError(f"tensor for {s.name!r} has shape {tuple(t.shape)}, expected [A, *{s.shape}]")
        return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=1)

    def _check(self, flat: Tensor) -> None:
        if flat.ndim != 2 or flat.shape[1] != self.total_numel:
            raise ValueError(f"flat agent stack must be [A, {self.total_numel}], got {tuple(flat.shape)}")


class Mixer(Protocol):
    """One gossip round restricted to the local agents: returns ``(W · X_all)[local rows]``."""

    num_local_agents: int

    def mix(self, flat: Tensor) -> Tensor: ...


def agent_norms(flat: Tensor) -> Tensor:
    """‖row‖₂ of each agent's flat parameters, ``[A]`` (accumulated in float64 for stability)."""
    return flat.double().pow(2).sum(dim=1).sqrt().to(flat.dtype)


def consensus_error(flat: Tensor) -> float:
    """‖X − 1⊗X̄‖_F over all agents and parameters, for the full stack ``[N, P]``."""
    x = flat.double()
    return float((x - x.mean(dim=0, keepdim=True)).pow(2).sum().sqrt())


def stationarity_proxy(grads: Tensor) -> float:
    """‖(1/N) Σ_i G_i‖_F for the full stack ``[N, P]`` of the agents' latest stochastic gradients.

    At consensus this is a minibatch estimate of ‖∇f(X̄)‖_F; it is the same quantity for every
    method (for the tracking methods mean(V) = mean(M) is a smoothed version of it).
    """
    g = grads.double().mean(dim=0)
    return float(g.pow(2).sum().sqrt())


class DecentralizedAlgorithm:
    """State and update of one decentralized method over a flat agent stack.

    ``params`` ``[A, P]`` is updated **in place** (so module parameters that view into it stay
    current). Use ``gradient_points()`` → evaluate one gradient ``[A, P]`` per point on the same
    minibatch → ``step(grads)``.
    """

    def __init__(self, config: DecentralizedConfig, layout: FlatLayout, mixer: Mixer, params: Tensor):
        config.validate()
        layout._check(params)
        if not params.is_floating_point():
            raise TypeError(f"params must be floating point, got {params.dtype}")
        if mixer.num_local_agents != params.shape[0]:
            raise ValueError(
                f"the mixer serves {mixer.num_local_agents} local agent(s) but params has {params.shape[0]} rows"
            )
        if isinstance(config.lr, Tensor) and config.lr.shape[0] != params.shape[0]:
            raise ValueError(f"lr tensor has {config.lr.shape[0]} entries but there are {params.shape[0]} local agents")
        self.config, self.layout, self.mixer = config, layout, mixer
        self.params = params
        self.step_count = 0
        self.last_grad: Tensor | None = None  # the (combined) gradient of the latest step
        tracking = config.method in TRACKING_METHODS
        self.momentum_buf = torch.zeros_like(params) if tracking else None
        self.tracker = torch.zeros_like(params) if tracking else None
        self.extrapolation: ExtrapolationScheme | None = None
        self.prev_params = None
        if config.method == "demuon_a":
            self.extrapolation = extrapolation_scheme(
                float(config.momentum), config.extrapolation_points, config.extrapolation_ratios
            )
            self.prev_params = params.detach().clone()  # X^0 = X^{-1}: no step to extrapolate yet

    # ----------------------------------------------------------------------------------- API
    def gradient_points(self) -> list[Tensor]:
        """Where the caller must evaluate stochastic gradients this iteration (same minibatch)."""
        if self.extrapolation is not None:
            return self.extrapolation.points(self.params, self.prev_params)
        return [self.params]

    def step(self, grads: Sequence[Tensor]) -> None:
        """Apply one iteration given one gradient ``[A, P]`` per point of ``gradient_points()``."""
        expected = 1 if self.extrapolation is None else self.extrapolation.num_points
        if len(grads) != expected:
            raise ValueError(f"{self.config.method} needs {expected} gradient(s) per step, got {len(grads)}")
        for g in grads:
            if g.shape != self.params.shape:
                raise ValueError(f"gradient shape {tuple(g.shape)} != params shape {tuple(self.params.shape)}")
        self.step_count += 1
        method = self.config.method
        grad = grads[0] if self.extrapolation is None else self.extrapolation.combine(grads)
        grad = grad.to(self.params.dtype)
        self.last_grad = grad
        if method in TRACKING_METHODS:
            update = self._tracked_direction(grad)
        elif method == "dsgd":
            update = grad
        else:  # dsgd_c
            update = grad * self._clip_factors(grad).unsqueeze(1)
        if self.prev_params is not None:
            self.prev_params.copy_(self.params)
        local = self.params - self._lr_column() * update
        self.params.copy_(self.mixer.mix(local))

    def clip_threshold(self, step: int) -> float:
        """DSGD-C's τ_k at iteration ``step`` (1-based)."""
        return self.config.clip_scale * float(step) ** self.config.clip_exponent

    def state_tensors(self) -> dict[str, Tensor]:
        """The algorithm's state (for checkpoints and tests); tensors are live, not copies."""
        out = {"params": self.params}
        if self.momentum_buf is not None:
            out["momentum"] = self.momentum_buf
            out["tracker"] = self.tracker
        if self.prev_params is not None:
            out["prev_params"] = self.prev_params
        return out

    # ------------------------------------------------------------------------------ internals
    def _lr_column(self) -> Tensor | float:
        lr = self.config.lr
        if isinstance(lr, Tensor):
            return lr.to(device=self.params.device, dtype=self.params.dtype).unsqueeze(1)
        return float(lr)

    def _tracked_direction(self, grad: Tensor) -> Tensor:
        mu = float(self.config.momentum)
        new_momentum = self.momentum_buf * mu + grad * (1.0 - mu)
        # gradient tracking: V ← W (V + M_new − M_old) keeps mean(V) = mean(M) for doubly stochastic W
        self.tracker.copy_(self.mixer.mix(self.tracker + (new_momentum - self.momentum_buf)))
        self.momentum_buf.copy_(new_momentum)
        if self.config.method == "dsgd_n":
            return self.tracker / self._safe(agent_norms(self.tracker)).unsqueeze(1)
        return self._msgn_direction(self.tracker)

    @staticmethod
    def _safe(norms: Tensor) -> Tensor:
        # a zero direction stays zero instead of 0/0 = NaN
        return torch.where(norms > 0, norms, torch.ones_like(norms))

    def _clip_factors(self, grad: Tensor) -> Tensor:
        tau = self.clip_threshold(self.step_count)
        return (tau / (agent_norms(grad) + 1e-6)).clamp(max=1.0)

    def _msgn_direction(self, tracker: Tensor) -> Tensor:
        """msgn of every matrix block, v/‖v‖₂ of every other tensor, per agent."""
        agents = tracker.shape[0]
        out = torch.empty_like(tracker)
        for (rows, cols), slots in self.layout.matrix_groups.items():
            stack = torch.stack([tracker[:, s.offset : s.offset + s.numel] for s in slots], dim=1)
            ortho = self._orthogonalize(stack.view(agents * len(slots), rows, cols))
            if self.config.msgn_scale == "keller":
                ortho = ortho * math.sqrt(max(1.0, rows / cols))
            ortho = ortho.reshape(agents, len(slots), rows * cols)
            for i, s in enumerate(slots):
                out[:, s.offset : s.offset + s.numel] = ortho[:, i]
        for s in self.layout.vector_slots:
            block = tracker[:, s.offset : s.offset + s.numel]
            out[:, s.offset : s.offset + s.numel] = block / self._safe(agent_norms(block)).unsqueeze(1)
        return out

    def _orthogonalize(self, stack: Tensor) -> Tensor:
        if self.config.orthogonalizer == "svd":
            return msgn_svd(stack).to(stack.dtype)
        return newton_schulz(
            stack,
            coefficients=self.config.ns_coefficients,
            steps=self.config.ns_steps,
            compute_dtype=self.config.ns_dtype,
            check_finite=False,
        ).to(stack.dtype)
