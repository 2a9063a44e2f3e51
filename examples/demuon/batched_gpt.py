"""A GPT whose every parameter carries a leading agent dimension: A agents in one forward pass.

Pre-LayerNorm GPT-2 block (causal self-attention + GELU MLP), learned positions, untied output
head. The paper's shape is 2 layers, d=256, 4 heads, ff=1024. Attention uses
``scaled_dot_product_attention(is_causal=True)``: position t attends to positions ≤ t only
(``causal_mask_is_real`` in the tests checks that changing future tokens leaves past logits
unchanged). Parameters live in one flat ``[A, P]`` tensor laid out by a ``FlatLayout``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_dmuon.decentralized.demuon import FlatLayout


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 4096
    seq_len: int = 64
    d_model: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_ff: int = 1024


def param_shapes(cfg: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    d, f = cfg.d_model, cfg.d_ff
    shapes = [("tok_emb", (cfg.vocab_size, d)), ("pos_emb", (cfg.seq_len, d))]
    for i in range(cfg.n_layer):
        p = f"layer{i}."
        shapes += [
            (p + "ln1.weight", (d,)),
            (p + "ln1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.qkv.bias", (3 * d,)),
            (p + "attn.proj.weight", (d, d)),
            (p + "attn.proj.bias", (d,)),
            (p + "ln2.weight", (d,)),
            (p + "ln2.bias", (d,)),
            (p + "mlp.fc1.weight", (f, d)),
            (p + "mlp.fc1.bias", (f,)),
            (p + "mlp.fc2.weight", (d, f)),
            (p + "mlp.fc2.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("head.weight", (cfg.vocab_size, d))]
    return shapes


def make_layout(cfg: GPTConfig) -> FlatLayout:
    return FlatLayout(param_shapes(cfg))


def init_params(cfg: GPTConfig, layout: FlatLayout, seed: int = 0) -> Tensor:
    """GPT-2 initialisation of one agent, flat ``[P]`` (all agents start from it)."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.zeros(layout.total_numel)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for slot in layout.slots:
        view = flat[slot.offset : slot.offset + slot.numel]
        if slot.name.endswith("ln1.weight") or slot.name.endswith("ln2.weight") or slot.name == "ln_f.weight":
            view.fill_(1.0)
        elif slot.name.endswith("bias"):
            view.zero_()
        else:
            std = residual_std if slot.name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else 0.02
            view.copy_(torch.randn(slot.numel, generator=gen) * std)
    return flat


def _linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x [A, n, in], weight [A, out, in], bias [A, out] → [A, n, out]."""
    return torch.baddbmm(bias.unsqueeze(1), x, weight.mT)


def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    y = F.layer_norm(x, (x.shape[-1],))
    return y * weight.unsqueeze(1) + bias.unsqueeze(1)


def forward(cfg: GPTConfig, layout: FlatLayout, flat: Tensor, idx: Tensor) -> Tensor:
    """Logits ``[A, B, T, V]`` of agent a's model on its tokens ``idx[a]`` (``idx``: [A, B, T])."""
    agents, batch, seq = idx.shape
    if seq > cfg.seq_len:
        raise ValueError(f"sequence length {seq} exceeds the model's {cfg.seq_len} positions")
    p = {s.name: v for s, v in zip(layout.slots, layout.views(flat))}
    d, h = cfg.d_model, cfg.n_head
    offsets = (torch.arange(agents, device=idx.device) * cfg.vocab_size).view(agents, 1, 1)
    x = F.embedding(idx + offsets, p["tok_emb"].reshape(agents * cfg.vocab_size, d))
    x = (x + p["pos_emb"][:, None, :seq]).reshape(agents, batch * seq, d)
    for i in range(cfg.n_layer):
        q = f"layer{i}."
        y = _layer_norm(x, p[q + "ln1.weight"], p[q + "ln1.bias"])
        qkv = _linear(y, p[q + "attn.qkv.weight"], p[q + "attn.qkv.bias"])
        qkv = qkv.view(agents * batch, seq, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        att = att.transpose(1, 2).reshape(agents, batch * seq, d)
        x = x + _linear(att, p[q + "attn.proj.weight"], p[q + "attn.proj.bias"])
        y = _layer_norm(x, p[q + "ln2.weight"], p[q + "ln2.bias"])
        y = F.gelu(_linear(y, p[q + "mlp.fc1.weight"], p[q + "mlp.fc1.bias"]))
        x = x + _linear(y, p[q + "mlp.fc2.weight"], p[q + "mlp.fc2.bias"])
    x = _layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
    logits = torch.bmm(x, p["head.weight"].mT)
    return logits.view(agents, batch, seq, cfg.vocab_size)


def per_agent_loss(cfg: GPTConfig, layout: FlatLayout, flat: Tensor, idx: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of each agent on its own batch, ``[A]`` (float32)."""
    logits = forward(cfg, layout, flat, idx)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), targets.reshape(-1), reduction="none")
    return loss.view(idx.shape[0], -1).mean(dim=1)
