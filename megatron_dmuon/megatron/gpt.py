"""A small Megatron-core GPT training core shared by the main job, `dmuon-verify` and the tests.

It mirrors what Megatron-LM's training.py wires up (DDP, sync funcs, finalize_model_grads,
forward_backward_func) so DMuon is exercised on megatron-core's real code paths.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, List, Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class GPTShape:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 160
    vocab_size: int = 256
    seq_length: int = 32
    swiglu: bool = True
    bf16: bool = False
    fp64: bool = False  # CPU exactness tests: Megatron's fp32 code path carrying float64 (see testing/cpu_shim)
    num_experts: int = 0  # > 0: MoE MLP in every layer (megatron-core's non-TE SequentialMLP experts)
    moe_ffn_hidden_size: int = 96
    moe_router_topk: int = 2
    sequence_parallel: bool = False
    # Transformer Engine (Megatron-LM's default layers; needs CUDA and transformer_engine):
    # 'transformer_engine' builds megatron-core's TE layer spec (fused norm+QKV, TE GLU fc1, TE
    # attention; MoE experts as TE GroupedLinear with moe_grouped_gemm), else the local spec
    transformer_impl: str = "local"
    moe_grouped_gemm: bool = False
    # FP8 through TE (--fp8-format / --fp8-recipe / --fp8-param-gather as Megatron-LM names them)
    fp8: Optional[str] = None  # 'hybrid' | 'e4m3' | None (bf16/fp32 GEMMs)
    fp8_recipe: str = "delayed"  # 'delayed' | 'tensorwise' (current scaling)
    fp8_param: bool = False  # params stored as TE Float8Tensors (the publish moves FP8 bytes)
    # TE layers accumulate wgrad straight into the DDP buffer's main_grad (the output layer, not TE,
    # then needs Apex's fused_weight_gradient_mlp_cuda, as in Megatron-LM)
    gradient_accumulation_fusion: bool = False

    @property
    def uses_te(self) -> bool:
        return self.transformer_impl == "transformer_engine"


TRANSFORMER_IMPLS = ("local", "transformer_engine")
FP8_FORMATS = ("hybrid", "e4m3")
FP8_RECIPES = ("delayed", "tensorwise")


def model_dtype(shape: GPTShape) -> torch.dtype:
    return torch.bfloat16 if shape.bf16 else torch.float64 if shape.fp64 else torch.float32


def _parallel_sizes():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {}
    return dict(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
    )


def transformer_config(shape: GPTShape, **overrides):
    """The model's TransformerConfig; parallel sizes come from Megatron's initialized parallel state."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        gated_linear_unit=shape.swiglu,
        activation_func=F.silu if shape.swiglu else F.gelu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # TE's FP8 params are created on the GPU (the tests re-initialize every matrix by name anyway)
        use_cpu_initialization=not shape.uses_te,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=shape.gradient_accumulation_fusion,
        bf16=shape.bf16,
        params_dtype=model_dtype(shape),
        pipeline_dtype=model_dtype(shape),
        init_method_std=0.02,
        sequence_parallel=shape.sequence_parallel,
        **_parallel_sizes(),
    )
    if shape.fp8:
        kw.update(fp8=shape.fp8, fp8_recipe=shape.fp8_recipe, fp8_param=shape.fp8_param)
    if shape.num_experts:
        kw.update(num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
                  moe_router_topk=shape.moe_router_topk, moe_token_dispatcher_type="alltoall",
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_grouped_gemm=shape.moe_grouped_gemm)
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(shape: GPTShape):
    """megatron-core's layer spec for ``shape``: the Transformer Engine one (what Megatron-LM
    builds by default) or the local one."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if shape.uses_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=shape.num_experts or None,
                                                                moe_grouped_gemm=shape.moe_grouped_gemm)
    return specs.get_gpt_layer_local_spec(num_experts=shape.num_experts or None, moe_grouped_gemm=False,
                                          normalization="RMSNorm")


def build_gpt(shape: GPTShape, config=None, vp_stage: Optional[int] = None):
    """This pipeline stage's megatron-core GPTModel with the local or TE layer spec; under the
    interleaved schedule the model chunk of virtual stage ``vp_stage`` (its layers, and the
    embedding / output layer only on the first / last virtual stage of the first / last rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config or transformer_config(shape)
    spec = layer_spec(shape)
    parallel = ps.model_parallel_is_initialized()
    first = not parallel or ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = not parallel or ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        pre_process=first,
        post_process=last,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        vp_stage=vp_stage,
    )
    if (shape.bf16 or shape.fp64) and not shape.fp8_param:  # (TE's FP8 params keep their own dtype)
        model = model.to(model_dtype(shape))
    if on_gpu():
        model = model.cuda(torch.cuda.current_device())
    return model


def gpt_training_flops(shape: GPTShape, batch_size: int) -> float:
    """FLOPs of one training iteration on `batch_size` sequences, counted the way Megatron-LM's
    `num_floating_point_operations` counts a GPT (so TFLOP/s compare with its logs): every GEMM
    three times (forward, weight grad, input grad) at 2 FLOPs per multiply-add; causal attention
    counts half of QK^T and of its product with V; the logit GEMM included; no recomputation."""
    s, h, layers = shape.seq_length, shape.hidden_size, shape.num_layers
    head_dim = h // shape.num_attention_heads
    q, kv = head_dim * shape.num_attention_heads, head_dim * shape.num_query_groups
    mlp_width = shape.moe_ffn_hidden_size * shape.moe_router_topk if shape.num_experts else shape.ffn_hidden_size
    mlp = h * mlp_width * (3 if shape.swiglu else 2)
    attention_proj = h * (q + 2 * kv) + q * h
    per_token = 6 * (layers * (mlp + attention_proj) + h * shape.vocab_size) + 6 * layers * q * s
    return float(batch_size * s * per_token)


def on_gpu() -> bool:
    """True on a real CUDA run (the CPU test shim makes ``torch.cuda.is_available()`` False)."""
    return torch.cuda.is_available()


def wire_sync_funcs(model_chunks: List[torch.nn.Module], ddp_config) -> None:
    """Set the config hooks Megatron-LM's training.py sets for DDP chunks."""
    from megatron.core.distributed import finalize_model_grads

    config = model_chunks[0].config

    def one_or_list(fns):
        return fns[0] if len(fns) == 1 else fns

    config.no_sync_func = one_or_list([m.no_sync for m in model_chunks])
    config.grad_sync_func = None
    config.param_sync_func = None
    if ddp_config.overlap_grad_reduce:
        config.grad_sync_func = one_or_list([m.start_grad_sync for m in model_chunks])
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = one_or_list([m.start_param_sync for m in model_chunks])
    config.finalize_model_grads_func = finalize_model_grads


def causal_batch(tokens: torch.Tensor):
    """Split a [b, s+1] token block into Megatron's GPT inputs (causal mask, positions)."""
    inputs = tokens[:, :-1].contiguous()
    labels = tokens[:, 1:].contiguous()
    b, s = inputs.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=tokens.device), diagonal=1)
    return dict(
        input_ids=inputs,
        labels=labels,
        position_ids=torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s),
        attention_mask=mask.view(1, 1, s, s),
        loss_mask=torch.ones(b, s, dtype=torch.float, device=tokens.device),
    )


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    loss_mask = batch.pop("loss_mask")
    output = model(**batch)

    def loss_func(output_tensor):
        losses = output_tensor if output_tensor.dtype == torch.float64 else output_tensor.float()
        loss = torch.sum(losses.view(-1) * loss_mask.view(-1))
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    return output, loss_func


def _data_iterators(model_chunks, micro_batches, device):
    """Megatron's data_iterator argument: one iterator, or under the interleaved schedule one per
    model chunk (each virtual stage reads every micro-batch, as Megatron-LM's loaders do)."""
    if len(model_chunks) == 1:
        return iter([causal_batch(t.to(device)) for t in micro_batches])
    return [iter([causal_batch(t.to(device)) for t in micro_batches]) for _ in model_chunks]


def _token_mean_loss(losses, device) -> float:
    """The token-averaged loss of a forward_backward_func's outputs over every rank (only the last
    pipeline stage has losses; TP copies count alike in tokens and loss, so the ratio is unchanged)."""
    tot = (torch.stack([x["lm loss"] for x in losses]).sum(0).double() if losses
           else torch.zeros(2, dtype=torch.float64, device=device))
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(tot)
    return (tot[0] / tot[1]).item()


@torch.no_grad()
def eval_loss(model_chunks: List[torch.nn.Module], micro_batches: List[torch.Tensor], seq_length: int,
              micro_batch_size: int) -> float:
    """Forward-only loss over this rank's ``micro_batches`` (and every other rank's), averaged over
    tokens, as Megatron-LM's evaluate(). Changes no parameter or optimizer state. Under
    --overlap-param-gather the forward pre-hooks are taken off for the evaluation (all params
    synced first) and put back after, as Megatron-LM does."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    hooked = [c for c in model_chunks if getattr(c, "use_forward_hook", False)]
    for chunk in hooked:
        chunk.disable_forward_pre_hook()
    for chunk in model_chunks:
        chunk.eval()
    try:
        device = torch.cuda.current_device() if on_gpu() else "cpu"
        data = _data_iterators(model_chunks, micro_batches, device)
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=data, model=model_chunks,
            num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=True)
    finally:
        for chunk in model_chunks:
            chunk.train()
        for chunk in hooked:
            chunk.enable_forward_pre_hook()
    return _token_mean_loss(losses, device)


def train_step(
    model_chunks: List[torch.nn.Module],
    optimizer,
    micro_batches: List[torch.Tensor],
    seq_length: int,
    micro_batch_size: int,
):
    """One Megatron training iteration (grad accumulation over `micro_batches`).

    Returns (loss averaged over tokens, grad_norm, num_zeros, update_successful).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    device = torch.cuda.current_device() if on_gpu() else "cpu"
    data = _data_iterators(model_chunks, micro_batches, device)
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=data,
        model=model_chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    update_successful, grad_norm, num_zeros = optimizer.step()
    return _token_mean_loss(losses, device), grad_norm, num_zeros, update_successful
