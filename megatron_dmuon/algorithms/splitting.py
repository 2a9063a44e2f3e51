"""How a Megatron parameter is cut into the matrices Newton–Schulz orthogonalizes.

Layouts (megatron-core 0.19.2, read from its source):

* ``linear_qkv.weight`` of ``SelfAttention`` has ``ng·(q + 2)·hd`` rows (``ng`` query groups,
  ``q = heads/ng`` query heads per group, ``hd = kv_channels``), ordered group by group:
  ``[q heads of group 0; k_0; v_0 | q heads of group 1; k_1; v_1 | ...]``, each head ``hd``
  rows (``get_query_key_value_tensors`` views the output as ``[.., ng, (q+2)·hd]`` and splits
  ``[q·hd, hd, hd]``). With ``attention_output_gate=True`` each group block is
  ``[q heads; q gate heads; k; v]`` (split ``[q·hd, q·hd, hd, hd]``). TP shards hold whole
  groups, so the concatenation of the TP shards along dim 0 is this canonical layout.
* ``linear_fc1.weight`` of a GLU MLP is ``[gate; up]`` (halves along dim 0; the forward does
  ``torch.chunk(x, 2, dim=-1)``). Under TP it is column-parallel with ``partition_stride=2``:
  shard ``i`` is ``[gate_i; up_i]``, so the concatenation of ``t`` TP shards is
  ``[gate_0; up_0; ...; gate_{t-1}; up_{t-1}]`` — pass ``tp_shards=t`` to split that.
* MoE experts in 0.19 (``TEGroupedMLP``: ``weight0..weight{E-1}``; ``SequentialMLP``:
  ``local_experts.{i}.linear_fc1.weight``) are separate 2-D parameters, each its own matrix.
  The ``'experts'`` rule is for stacks ``[E, rows, cols]`` (or ``[E·rows, cols]``) that a
  runtime builds to orthogonalize same-shape experts as one batch.

Defaults: ``rule_for_megatron_param`` returns the ``'none'`` rule (the whole matrix, one NS)
unless ``split_qkv`` / ``split_glu`` are asked for. Note that Megatron's own
``--optimizer muon`` defaults to ``muon_split_qkv=True`` (``OptimizerConfig``, 0.19.2): it
orthogonalizes Q, K, V (and the gate) as three (four) separate matrices, which is our
``split_qkv=True, qkv_per_head=False`` rule. ``qkv_per_head=True`` goes further: one NS per
attention head (a ``[heads, hd, cols]`` stack).

All split/merge functions are pure reshapes/permutations: ``merge(split(w)) == w`` bitwise.
They act on the last two dims, so leading batch dims pass through. Pieces may be views of the
input; do not modify them in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "qkv_split",
    "qkv_merge",
    "glu_split",
    "glu_merge",
    "per_head",
    "merge_heads",
    "SplitRule",
    "SPLIT_KINDS",
    "rule_for_megatron_param",
]

SPLIT_KINDS: tuple[str, ...] = ("none", "qkv", "glu", "experts")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check_matrix(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or t.ndim < 2:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor [..., rows, cols], got {shape}")


def _qkv_sizes(
    rows: int, num_attention_heads: int, num_query_groups: int, head_dim: int | None, gated: bool
) -> tuple[int, int, list[int], list[str]]:
    """(groups, head_dim, per-group row sizes in layout order, names in layout order)."""
    heads = _positive_int("num_attention_heads", num_attention_heads)
    groups = _positive_int("num_query_groups", num_query_groups)
    if heads % groups:
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_query_groups ({groups})"
        )
    q = heads // groups
    heads_total = heads + 2 * groups + (heads if gated else 0)
    if head_dim is None:
        if rows % heads_total:
            raise ValueError(
                f"qkv weight has {rows} rows, not a multiple of heads+2*groups"
                f"{'+heads (gated)' if gated else ''} = {heads_total}; check the head counts"
            )
        head_dim = rows // heads_total
    _positive_int("head_dim", head_dim)
    if rows != heads_total * head_dim:
        raise ValueError(
            f"qkv weight has {rows} rows but heads={heads}, groups={groups}, head_dim={head_dim}, "
            f"gated={gated} need {heads_total * head_dim} (pass the full, un-sharded matrix)"
        )
    if gated:
        return groups, head_dim, [q * head_dim, q * head_dim, head_dim, head_dim], ["q", "gate", "k", "v"]
    return groups, head_dim, [q * head_dim, head_dim, head_dim], ["q", "k", "v"]


def qkv_split(
    weight: Tensor,
    num_attention_heads: int,
    num_query_groups: int,
    head_dim: int | None = None,
    gated: bool = False,
) -> dict[str, Tensor]:
    """Split a fused ``linear_qkv`` weight into ``'q'``, ``'k'``, ``'v'`` (+ ``'gate'``).

    ``q``/``gate`` are ``[heads·hd, cols]`` (head ``h`` = rows ``h·hd:(h+1)·hd``) and ``k``/``v``
    are ``[groups·hd, cols]`` — the tensors Megatron's ``get_query_key_value_tensors`` and its
    Muon ``split_qkv`` produce. ``head_dim=None`` infers it from the row count.
    """
    _check_matrix("weight", weight)
    rows, cols = weight.shape[-2:]
    groups, _, sizes, names = _qkv_sizes(rows, num_attention_heads, num_query_groups, head_dim, gated)
    lead = weight.shape[:-2]
    grouped = weight.reshape(*lead, groups, rows // groups, cols)
    parts = torch.split(grouped, sizes, dim=-2)
    return {n: p.reshape(*lead, groups * s, cols) for n, p, s in zip(names, parts, sizes)}


def qkv_merge(
    parts: dict[str, Tensor],
    num_attention_heads: int,
    num_query_groups: int,
    head_dim: int | None = None,
    gated: bool = False,
) -> Tensor:
    """Inverse of ``qkv_split``: rebuild the fused ``[q; (gate;) k; v]``-per-group weight."""
    expected = {"q", "k", "v", "gate"} if gated else {"q", "k", "v"}
    if set(parts) != expected:
        raise ValueError(f"parts must have keys {sorted(expected)} (gated={gated}), got {sorted(parts)}")
    q = parts["q"]
    _check_matrix("parts['q']", q)
    heads = _positive_int("num_attention_heads", num_attention_heads)
    if head_dim is None:
        if q.size(-2) % heads:
            raise ValueError(f"q has {q.size(-2)} rows, not a multiple of num_attention_heads={heads}")
        head_dim = q.size(-2) // heads
    heads_total = heads + 2 * num_query_groups + (heads if gated else 0)
    rows = heads_total * head_dim
    groups, _, sizes, names = _qkv_sizes(rows, heads, num_query_groups, head_dim, gated)
    lead, cols = q.shape[:-2], q.size(-1)
    blocks = []
    for n, s in zip(names, sizes):
        p = parts[n]
        if tuple(p.shape) != (*lead, groups * s, cols):
            raise ValueError(
                f"parts[{n!r}] has shape {tuple(p.shape)}, expected {(*lead, groups * s, cols)}"
            )
        blocks.append(p.reshape(*lead, groups, s, cols))
    return torch.cat(blocks, dim=-2).reshape(*lead, rows, cols)


def glu_split(weight: Tensor, tp_shards: int = 1) -> tuple[Tensor, Tensor]:
    """Split a GLU ``linear_fc1`` weight ``[gate; up]`` into ``(gate, up)``.

    ``tp_shards=t`` reads the concatenation of ``t`` TP shards ``[gate_i; up_i]`` (stride-2
    column parallelism) and returns the canonical full ``gate`` and ``up``.
    """
    _check_matrix("weight", weight)
    t = _positive_int("tp_shards", tp_shards)
    rows, cols = weight.shape[-2:]
    if rows % (2 * t):
        raise ValueError(f"GLU fc1 weight has {rows} rows, not divisible by 2*tp_shards = {2 * t}")
    lead = weight.shape[:-2]
    halves = weight.reshape(*lead, t, 2, rows // (2 * t), cols)
    gate = halves.select(-3, 0).reshape(*lead, rows // 2, cols)
    up = halves.select(-3, 1).reshape(*lead, rows // 2, cols)
    return gate, up


def glu_merge(gate: Tensor, up: Tensor, tp_shards: int = 1) -> Tensor:
    """Inverse of ``glu_split``."""
    _check_matrix("gate", gate)
    if gate.shape != up.shape:
        raise ValueError(f"gate shape {tuple(gate.shape)} != up shape {tuple(up.shape)}")
    t = _positive_int("tp_shards", tp_shards)
    half, cols = gate.shape[-2:]
    if half % t:
        raise ValueError(f"gate has {half} rows, not divisible by tp_shards = {t}")
    lead = gate.shape[:-2]
    pair = torch.stack(
        [gate.reshape(*lead, t, half // t, cols), up.reshape(*lead, t, half // t, cols)], dim=-3
    )
    return pair.reshape(*lead, 2 * half, cols)


def per_head(matrix: Tensor, head_dim: int) -> Tensor:
    """View ``[heads·hd, cols]`` as the stack ``[heads, hd, cols]`` (one matrix per head)."""
    _check_matrix("matrix", matrix)
    hd = _positive_int("head_dim", head_dim)
    rows, cols = matrix.shape[-2:]
    if rows % hd:
        raise ValueError(f"matrix has {rows} rows, not a multiple of head_dim={hd}")
    return matrix.reshape(*matrix.shape[:-2], rows // hd, hd, cols)


def merge_heads(stack: Tensor) -> Tensor:
    """Inverse of ``per_head``: ``[..., heads, hd, cols] -> [..., heads·hd, cols]``."""
    if not isinstance(stack, Tensor) or stack.ndim < 3:
        raise ValueError("merge_heads needs a stack [..., heads, head_dim, cols]")
    return stack.reshape(*stack.shape[:-3], stack.size(-3) * stack.size(-2), stack.size(-1))


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """How one parameter matrix is cut into NS inputs, and put back together.

    kind:
        ``'none'``  whole matrix (one piece).
        ``'qkv'``   q, k, v (+ gate) of a fused ``linear_qkv`` (needs ``num_attention_heads``,
                    ``num_query_groups``; ``head_dim`` inferred when None). With ``per_head``
                    every piece is a ``[heads, hd, cols]`` stack (one NS per head).
        ``'glu'``   gate and up halves of a GLU fc1 (``tp_shards`` as in ``glu_split``).
        ``'experts'`` ``[E, r, c]`` or ``[E·r, c]`` → one ``[E, r, c]`` stack (needs
                    ``num_experts``); with ``split_glu`` two stacks (gate, up).
    Each piece is a 2-D matrix or a 3-D stack of same-shape matrices to orthogonalize as one
    batch; ``assemble(pieces(m), m)`` reproduces ``m`` exactly.
    """

    kind: str = "none"
    per_head: bool = False
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    head_dim: int | None = None
    gated: bool = False
    tp_shards: int = 1
    num_experts: int | None = None
    split_glu: bool = False

    def __post_init__(self) -> None:
        if self.kind not in SPLIT_KINDS:
            raise ValueError(f"unknown split kind {self.kind!r}; valid: {', '.join(SPLIT_KINDS)}")
        if self.per_head and self.kind != "qkv":
            raise ValueError(f"per_head applies to kind='qkv' only, not {self.kind!r}")
        if self.kind == "qkv":
            if self.num_attention_heads is None or self.num_query_groups is None:
                raise ValueError("kind='qkv' needs num_attention_heads and num_query_groups")
            heads = _positive_int("num_attention_heads", self.num_attention_heads)
            groups = _positive_int("num_query_groups", self.num_query_groups)
            if heads % groups:
                raise ValueError(
                    f"num_attention_heads ({heads}) must be a multiple of num_query_groups ({groups})"
                )
            if self.head_dim is not None:
                _positive_int("head_dim", self.head_dim)
        if self.kind == "experts":
            _positive_int("num_experts", self.num_experts)
        _positive_int("tp_shards", self.tp_shards)

    def piece_names(self) -> list[str]:
        """Names of the pieces in the order ``pieces`` returns them."""
        if self.kind == "qkv":
            return ["q", "gate", "k", "v"] if self.gated else ["q", "k", "v"]
        if self.kind == "glu" or (self.kind == "experts" and self.split_glu):
            return ["gate", "up"]
        return ["experts"] if self.kind == "experts" else ["matrix"]

    def _qkv_args(self) -> tuple:
        return (self.num_attention_heads, self.num_query_groups, self.head_dim, self.gated)

    def _expert_stack(self, matrix: Tensor) -> Tensor:
        e = self.num_experts
        if matrix.ndim == 3 and matrix.size(0) == e:
            return matrix
        if matrix.ndim == 2 and matrix.size(0) % e == 0:
            return matrix.reshape(e, matrix.size(0) // e, matrix.size(1))
        raise ValueError(
            f"kind='experts' with num_experts={e} needs [E, rows, cols] or [E*rows, cols]; "
            f"got {tuple(matrix.shape)}"
        )

    def pieces(self, matrix: Tensor) -> list[Tensor]:
        """The NS inputs of ``matrix`` (2-D matrices or 3-D same-shape stacks)."""
        _check_matrix("matrix", matrix)
        if self.kind == "none":
            return [matrix]
        if self.kind == "qkv":
            parts = qkv_split(matrix, *self._qkv_args())
            out = [parts[n] for n in self.piece_names()]
            if self.per_head:
                hd = out[0].size(-2) // self.num_attention_heads
                out = [per_head(p, hd) for p in out]
            return out
        if self.kind == "glu":
            return list(glu_split(matrix, self.tp_shards))
        stack = self._expert_stack(matrix)
        return list(glu_split(stack, self.tp_shards)) if self.split_glu else [stack]

    def piece_shapes(self, shape: Sequence[int]) -> list[tuple[int, ...]]:
        """Shapes ``pieces`` returns for a matrix of ``shape`` (for planners; no data needed)."""
        return [tuple(p.shape) for p in self.pieces(torch.empty(tuple(shape), device="meta"))]

    def assemble(self, pieces: Sequence[Tensor], like: Tensor) -> Tensor:
        """Exact inverse of ``pieces``: a tensor of ``like``'s shape (pieces' dtype)."""
        expected = self.piece_shapes(like.shape)
        got = [tuple(p.shape) for p in pieces]
        if got != expected:
            raise ValueError(
                f"{self.kind!r} rule expects pieces of shapes {expected} for a {tuple(like.shape)} "
                f"matrix, got {got}"
            )
        if self.kind == "none":
            return pieces[0].reshape(like.shape)
        if self.kind == "qkv":
            parts = [merge_heads(p) if self.per_head else p for p in pieces]
            return qkv_merge(dict(zip(self.piece_names(), parts)), *self._qkv_args())
        if self.kind == "glu":
            return glu_merge(pieces[0], pieces[1], self.tp_shards)
        stack = glu_merge(pieces[0], pieces[1], self.tp_shards) if self.split_glu else pieces[0]
        return stack.reshape(like.shape)


def rule_for_megatron_param(
    name: str,
    param_shape: Sequence[int],
    config,
    *,
    split_qkv: bool = False,
    qkv_per_head: bool = False,
    split_glu: bool = False,
    tp_shards: int = 1,
    per_head: bool = False,
) -> SplitRule:
    """The split rule for a Megatron parameter called ``name`` of full shape ``param_shape``.

    ``config`` is a megatron ``TransformerConfig`` (or anything with its attribute names:
    ``num_attention_heads``, ``num_query_groups``, ``kv_channels``, ``hidden_size``,
    ``attention_output_gate``, ``gated_linear_unit``). Defaults give ``'none'`` for every
    parameter (whole-matrix NS). ``split_qkv`` cuts ``*.linear_qkv.weight`` (self-attention);
    ``split_glu`` cuts GLU ``*.linear_fc1.weight*`` (dense and expert); 3-D parameters under
    ``experts`` become ``'experts'`` stacks. ``tp_shards`` describes how a GLU matrix was
    assembled from stride-2 TP shards (see ``glu_split``). ``per_head`` is an alias of
    ``qkv_per_head`` (either one turns it on); per-head splitting implies ``split_qkv``.
    """
    qkv_per_head = qkv_per_head or per_head
    split_qkv = split_qkv or qkv_per_head
    shape = tuple(int(s) for s in param_shape)
    base = name.rsplit(".", 1)[-1]
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    is_fc1 = module == "linear_fc1" and base.startswith("weight")
    glu = bool(getattr(config, "gated_linear_unit", False))
    if len(shape) == 3 and "experts" in name:
        return SplitRule("experts", num_experts=shape[0], split_glu=split_glu and is_fc1 and glu,
                         tp_shards=tp_shards)
    if len(shape) != 2:
        return SplitRule("none")
    if split_qkv and module == "linear_qkv" and base == "weight":
        heads = int(config.num_attention_heads)
        groups = int(getattr(config, "num_query_groups", None) or heads)
        head_dim = getattr(config, "kv_channels", None) or int(config.hidden_size) // heads
        rule = SplitRule(
            "qkv", per_head=qkv_per_head, num_attention_heads=heads, num_query_groups=groups,
            head_dim=int(head_dim), gated=bool(getattr(config, "attention_output_gate", False)),
        )
        rule.piece_shapes(shape)  # raises a clear error if the shape does not fit the config
        return rule
    if split_glu and glu and is_fc1:
        rule = SplitRule("glu", tp_shards=tp_shards)
        rule.piece_shapes(shape)
        return rule
    return SplitRule("none")
