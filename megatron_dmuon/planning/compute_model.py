"""One training iteration's compute per GPU, from FLOPs: the windows the overlapped owner step can use.

For a dense GPT stage (planning/models.py) the forward of one micro-batch is cut into the segments
whose modules Megatron's forward pre-hooks see, in forward order (embedding; per layer the fused
layernorm + QKV, the core attention, the output projection, the fused layernorm + fc1, fc2; the
final layernorm + output layer). Each segment costs its FLOPs at the device's achieved model rate
(``model_tflops`` in clusters.json); its backward costs twice its forward.

FLOPs per micro-batch of ``T = micro_batch x seq_length`` tokens, per TP rank:

* a linear layer of ``p`` weights: ``2 T p`` forward;
* causal attention (scores and values, flash attention skips the masked half):
  ``2 x 2 T s (heads x head_dim) / 2 = 2 T s heads head_dim``, s the sequence length.

This is Megatron-LM's own count (its 'throughput per GPU (TFLOP/s/GPU)' line): for the calibration
run below it gives 108.7 TFLOP per iteration, 453.6 TFLOP/s at 239.6 ms, as Megatron printed.

Calibration (``model_tflops`` = 487 for the H200): Megatron-LM's AdamW run of the 4-layer
Qwen2.5-7B-shaped GPT (hidden 3584, ffn 18944, 28 heads, 4 query groups, vocab 32000, seq 4096,
micro-batch 1, global batch 4 on one GPU: 4 micro-batches; docs/results/overlap/megatron_lm_run1/
adam_ogp.log) ran 239 ms per iteration, of which the optimizer step 16 ms: 4 x (forward + backward)
= 223 ms for 4 x 27.17 TFLOP. Pure data; no torch.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from .cost_model import load_config
from .models import ModelSpec, ParallelSpec, stage_params

__all__ = ["Segment", "model_tflops", "forward_segments", "iteration_flops", "CALIBRATION"]

# The measured point behind the H200's model_tflops (clusters.json).
CALIBRATION = {"preset": "qwen7b-4l", "seq_length": 4096, "micro_batch": 1, "micro_batches": 4,
               "iteration_ms": 239.0, "optimizer_ms": 16.0, "forward_backward_ms": 223.0,
               "source": "docs/results/overlap/megatron_lm_run1/adam_ogp.log (AdamW, iterations 20-40)"}


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of the forward between two of Megatron's pre-hooks: its time forward and backward (ms,
    one micro-batch) and the params of its modules (the pre-hook waits for their bucket groups)."""

    name: str
    fwd_ms: float
    bwd_ms: float
    params: Tuple[str, ...]


def model_tflops(device: str, config: Optional[dict] = None) -> float:
    """The achieved forward + backward rate (TFLOP/s) of ``device`` in the cluster config."""
    config = config or load_config()
    entry = config["devices"].get(device)
    if entry is None or "model_tflops" not in entry:
        raise ValueError(f"device {device!r} has no model_tflops in the cluster config")
    return float(entry["model_tflops"])


def _module_of(name: str) -> str:
    """Which segment of a layer a param belongs to (TE fuses each layernorm into the next linear)."""
    for key, seg in (("input_layernorm", "qkv"), ("linear_qkv", "qkv"), ("linear_proj", "proj"),
                     ("pre_mlp_layernorm", "fc1"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
        if key in name:
            return seg
    raise ValueError(f"the compute model does not know where {name!r} runs (dense GPT layers only)")


def _segment_flops(model: ModelSpec, par: ParallelSpec, tokens: int, seq_length: int) -> dict:
    """Forward FLOPs of one layer's segments on one TP rank."""
    h, hq = model.hidden, model.heads * model.head_dim
    qkv_rows = (model.heads + 2 * model.groups) * model.head_dim
    fc1_rows = (2 if model.swiglu else 1) * model.ffn_hidden
    flops = {"qkv": 2 * tokens * qkv_rows * h, "attn": 2 * tokens * seq_length * hq,
             "proj": 2 * tokens * hq * h, "fc1": 2 * tokens * fc1_rows * h, "fc2": 2 * tokens * model.ffn_hidden * h}
    return {k: v / par.tp for k, v in flops.items()}


def forward_segments(model: ModelSpec, par: ParallelSpec, tflops: float, *, seq_length: int = 4096,
                     micro_batch: int = 1, stage: int = 0) -> List[Segment]:
    """The forward of one micro-batch on one GPU of pipeline stage ``stage``, segment by segment in
    forward order (the backward runs them in reverse at twice the time)."""
    if model.num_experts:
        raise ValueError("the compute model covers dense GPTs (no MoE layers yet)")
    if tflops <= 0 or seq_length < 1 or micro_batch < 1:
        raise ValueError(f"need tflops > 0, seq_length >= 1, micro_batch >= 1 (got {tflops}, {seq_length}, {micro_batch})")
    rate = tflops * 1e9  # FLOPs per ms
    tokens = micro_batch * seq_length
    params = [p for ps in stage_params(model, par, stage).values() for p in ps]
    per_layer = _segment_flops(model, par, tokens, seq_length)
    segments: List[Segment] = []

    def add(name, flops, names):
        segments.append(Segment(name, flops / rate, 2 * flops / rate, tuple(names)))

    if stage == 0:
        add("embedding", 0.0, [p.name for p in params if p.name.startswith("embedding.")])
    layers = model.num_layers // par.pp
    for layer in range(layers):
        prefix = f"decoder.layers.{layer}."
        mine = [p for p in params if p.name.startswith(prefix)]
        for seg in ("qkv", "attn", "proj", "fc1", "fc2"):
            add(f"layer{layer}.{seg}", per_layer[seg],
                [p.name for p in mine if seg != "attn" and _module_of(p.name) == seg])
    if stage == par.pp - 1:
        out = [p for p in params if p.name.startswith(("decoder.final_layernorm", "output_layer"))]
        head = next((p for p in out if p.name.startswith("output_layer")), None)
        add("output", 2 * tokens * (head.numel if head is not None else 0), [p.name for p in out])
    return segments


def iteration_flops(model: ModelSpec, par: ParallelSpec, *, seq_length: int = 4096, micro_batch: int = 1,
                    micro_batches: int = 1, stage: int = 0) -> float:
    """Forward + backward FLOPs of one iteration on one GPU (3x the forward)."""
    segs = forward_segments(model, par, 1e-9, seq_length=seq_length, micro_batch=micro_batch, stage=stage)
    return 3 * micro_batches * sum(s.fwd_ms for s in segs)  # at 1 FLOP per ms, ms = FLOPs
