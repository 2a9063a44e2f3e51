"""A GPT's parameters as Megatron-core lays them out, from a model description (no model built).

``ModelSpec`` (layers, hidden, ffn, heads, query groups, vocab, experts) + ``ParallelSpec``
(TP/PP/EP/DP, nodes x GPUs per node) -> the parameters of one pipeline stage, per DDP buffer
(dense, expert), in Megatron's parameter order, with each parameter's local (TP shard) and full
shape. ``parse_megatron_argv`` reads the same from a Megatron-LM command line. Used by
``dmuon plan`` and the simulation (planning/simulate.py); pure data.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
from typing import Dict, List, Optional, Sequence, Tuple

from .params import is_muon_matrix

__all__ = ["ModelSpec", "ParallelSpec", "ParamSpec", "PRESETS", "stage_params", "parse_megatron_argv"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    num_layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    query_groups: Optional[int] = None  # None: no GQA (= heads)
    vocab: int = 32000
    kv_channels: Optional[int] = None  # None: hidden / heads
    swiglu: bool = True
    untie_embeddings: bool = True
    qkv_bias: bool = False
    num_experts: int = 0
    moe_ffn_hidden: Optional[int] = None
    name: str = "custom"

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def groups(self) -> int:
        return self.query_groups or self.heads


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel; None: = tp (Megatron's default)
    dp: Optional[int] = None  # None: world / (tp x pp)
    nodes: int = 1
    gpus_per_node: int = 8
    make_vocab_size_divisible_by: int = 128

    @property
    def dp_size(self) -> int:
        if self.dp is not None:
            return self.dp
        world = self.nodes * self.gpus_per_node
        if world % (self.tp * self.pp):
            raise ValueError(f"{self.nodes} nodes x {self.gpus_per_node} GPUs is not a multiple of TP x PP = {self.tp * self.pp}")
        return world // (self.tp * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def world(self) -> int:
        return self.dp_size * self.tp * self.pp

    @property
    def expert_dp_size(self) -> int:
        stage = self.dp_size * self.tp
        if stage % (self.ep * self.expert_tp):
            raise ValueError(f"DP x TP = {stage} is not a multiple of EP x expert TP = {self.ep * self.expert_tp}")
        return stage // (self.ep * self.expert_tp)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    name: str
    local_shape: Tuple[int, ...]  # this TP rank's shard
    full_shape: Tuple[int, ...]  # the whole (TP-merged) tensor

    @property
    def is_matrix(self) -> bool:  # Muon's (planning/params.py's rule)
        return is_muon_matrix(self.name, self.full_shape)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def partition_dim(self) -> Optional[int]:
        """The dim TP splits (None: replicated)."""
        return next((d for d, (a, b) in enumerate(zip(self.local_shape, self.full_shape)) if a != b), None)


PRESETS: Dict[str, ModelSpec] = {
    # Qwen2.5-7B (config.json of Qwen/Qwen2.5-7B): untied embeddings, QKV bias, SwiGLU
    "qwen2.5-7b": ModelSpec(28, 3584, 18944, 28, 4, 152064, qkv_bias=True, name="qwen2.5-7b"),
    # Qwen2.5-32B (config.json of Qwen/Qwen2.5-32B): 64 layers, 40 heads in 8 groups, untied, QKV bias
    "qwen2.5-32b": ModelSpec(64, 5120, 27648, 40, 8, 152064, qkv_bias=True, name="qwen2.5-32b"),
    # Qwen2.5-72B (config.json of Qwen/Qwen2.5-72B): 80 layers, 64 heads in 8 groups, untied, QKV bias
    "qwen2.5-72b": ModelSpec(80, 8192, 29568, 64, 8, 152064, qkv_bias=True, name="qwen2.5-72b"),
    # the 4-layer Qwen2.5-7B-shaped GPT of the H200 runs (bench/e2e.py --preset qwen7b-4l)
    "qwen7b-4l": ModelSpec(4, 3584, 18944, 28, 4, 32000, name="qwen7b-4l"),
    # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): 128 experts of 768, top-8, head_dim 128, untied
    "qwen3-30b-a3b": ModelSpec(48, 2048, 6144, 32, 4, 151936, kv_channels=128, num_experts=128, moe_ffn_hidden=768,
                               name="qwen3-30b-a3b"),
    # its shapes in 8 layers (what one H200 can emulate rank by rank: bench/rank_balance.py)
    "qwen3-moe-8l": ModelSpec(8, 2048, 6144, 32, 4, 151936, kv_channels=128, num_experts=128, moe_ffn_hidden=768,
                              name="qwen3-moe-8l"),
    "tiny": ModelSpec(2, 128, 352, 4, 2, 1024, name="tiny"),
    "tiny-moe": ModelSpec(2, 128, 352, 4, 2, 1024, num_experts=4, moe_ffn_hidden=96, name="tiny-moe"),
}


def _padded_vocab(vocab: int, par: ParallelSpec) -> int:
    multiple = par.make_vocab_size_divisible_by * par.tp
    return -(-vocab // multiple) * multiple


def _sharded(name, full, dim, tp) -> ParamSpec:
    if dim is None or tp == 1:
        return ParamSpec(name, tuple(full), tuple(full))
    if full[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of {tuple(full)} is not divisible by TP={tp}")
    local = list(full)
    local[dim] //= tp
    return ParamSpec(name, tuple(local), tuple(full))


def stage_params(model: ModelSpec, par: ParallelSpec, stage: int = 0) -> Dict[str, List[ParamSpec]]:
    """{'dense': [...], 'expert': [...]} of pipeline stage ``stage`` (one EP rank's experts)."""
    if model.num_layers % par.pp:
        raise ValueError(f"{model.num_layers} layers do not split evenly over PP={par.pp} stages")
    if not 0 <= stage < par.pp:
        raise ValueError(f"stage {stage} out of range for PP={par.pp}")
    if model.num_experts and model.num_experts % par.ep:
        raise ValueError(f"{model.num_experts} experts do not split over EP={par.ep}")
    tp, etp, h = par.tp, par.expert_tp, model.hidden
    per_stage = model.num_layers // par.pp
    qkv_rows = (model.heads + 2 * model.groups) * model.head_dim
    proj_cols = model.heads * model.head_dim
    dense: List[ParamSpec] = []
    expert: List[ParamSpec] = []
    if stage == 0:
        dense.append(_sharded("embedding.word_embeddings.weight", (_padded_vocab(model.vocab, par), h), 0, tp))
    for layer in range(per_stage):
        p = f"decoder.layers.{layer}."
        dense.append(ParamSpec(p + "input_layernorm.weight", (h,), (h,)))
        dense.append(_sharded(p + "self_attention.linear_qkv.weight", (qkv_rows, h), 0, tp))
        if model.qkv_bias:
            dense.append(_sharded(p + "self_attention.linear_qkv.bias", (qkv_rows,), 0, tp))
        dense.append(_sharded(p + "self_attention.linear_proj.weight", (h, proj_cols), 1, tp))
        dense.append(ParamSpec(p + "pre_mlp_layernorm.weight", (h,), (h,)))
        if model.num_experts:
            dense.append(ParamSpec(p + "mlp.router.weight", (model.num_experts, h), (model.num_experts, h)))
            ffn = model.moe_ffn_hidden or model.ffn_hidden
            fc1_rows = 2 * ffn if model.swiglu else ffn
            for j in range(model.num_experts // par.ep):
                e = f"{p}mlp.experts.local_experts.{j}."
                expert.append(_sharded(e + "linear_fc1.weight", (fc1_rows, h), 0, etp))
                expert.append(_sharded(e + "linear_fc2.weight", (h, ffn), 1, etp))
        else:
            fc1_rows = 2 * model.ffn_hidden if model.swiglu else model.ffn_hidden
            dense.append(_sharded(p + "mlp.linear_fc1.weight", (fc1_rows, h), 0, tp))
            dense.append(_sharded(p + "mlp.linear_fc2.weight", (h, model.ffn_hidden), 1, tp))
    if stage == par.pp - 1:
        dense.append(ParamSpec("decoder.final_layernorm.weight", (h,), (h,)))
        if model.untie_embeddings or par.pp > 1:
            dense.append(_sharded("output_layer.weight", (_padded_vocab(model.vocab, par), h), 0, tp))
    return {"dense": dense, "expert": expert}


def megatron_argv_parser() -> argparse.ArgumentParser:
    """The Megatron-LM flags ``parse_megatron_argv`` reads (the plan CLI checks an argv with it too)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    a = p.add_argument
    a("--num-layers", type=int)
    a("--hidden-size", type=int)
    a("--ffn-hidden-size", type=int)
    a("--num-attention-heads", type=int)
    a("--num-query-groups", type=int)
    a("--group-query-attention", action="store_true")
    a("--kv-channels", type=int)
    a("--vocab-size", type=int)
    a("--make-vocab-size-divisible-by", type=int, default=128)
    a("--swiglu", action="store_true")
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--add-qkv-bias", action="store_true")
    a("--num-experts", type=int, default=0)
    a("--moe-ffn-hidden-size", type=int)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--expert-model-parallel-size", type=int, default=1)
    a("--expert-tensor-parallel-size", type=int)
    a("--overlap-grad-reduce", action="store_true")
    a("--ddp-bucket-size", type=int)
    a("--nnodes", type=int, default=1)  # torchrun's, if the launch line is included
    a("--nproc-per-node", "--nproc_per_node", type=int, default=8)
    return p


def parse_megatron_argv(argv: Sequence[str] | str) -> Tuple[ModelSpec, ParallelSpec, dict]:
    """Model shape, parallel sizes and DDP options from a Megatron-LM (pretrain_gpt.py) command
    line; unknown flags are ignored. Returns (ModelSpec, ParallelSpec, {'overlap_grad_reduce',
    'bucket_size'})."""
    if isinstance(argv, str):
        argv = shlex.split(argv)
    args, _ = megatron_argv_parser().parse_known_args(list(argv))
    missing = [f for f, v in (("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                              ("--num-attention-heads", args.num_attention_heads)) if v is None]
    if missing:
        raise ValueError(f"the Megatron argv lacks {', '.join(missing)}")
    if args.vocab_size is None:
        raise ValueError("the Megatron argv lacks --vocab-size (dmuon plan cannot run the tokenizer to find it)")
    model = ModelSpec(
        num_layers=args.num_layers, hidden=args.hidden_size,
        ffn_hidden=args.ffn_hidden_size or 4 * args.hidden_size, heads=args.num_attention_heads,
        query_groups=args.num_query_groups if args.group_query_attention or args.num_query_groups else None,
        vocab=args.vocab_size, kv_channels=args.kv_channels, swiglu=args.swiglu,
        untie_embeddings=args.untie_embeddings_and_output_weights, qkv_bias=args.add_qkv_bias,
        num_experts=args.num_experts or 0, moe_ffn_hidden=args.moe_ffn_hidden_size, name="megatron-argv")
    par = ParallelSpec(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                       ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                       nodes=args.nnodes, gpus_per_node=args.nproc_per_node,
                       make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    return model, par, {"overlap_grad_reduce": args.overlap_grad_reduce, "bucket_size": args.ddp_bucket_size}
