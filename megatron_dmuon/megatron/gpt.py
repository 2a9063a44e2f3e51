"""A small Megatron-core GPT training core shared by the main job, `dmuon verify` and the tests.

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


def transformer_config(shape: GPTShape, **overrides):
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
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        bf16=shape.bf16,
        params_dtype=torch.bfloat16 if shape.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if shape.bf16 else torch.float32,
        init_method_std=0.02,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(shape: GPTShape, config=None):
    """A megatron-core GPTModel with the local (non-TE) layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config or transformer_config(shape)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    if shape.bf16:
        model = model.bfloat16()
    if on_gpu():
        model = model.cuda(torch.cuda.current_device())
    return model


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
        losses = output_tensor.float()
        loss = torch.sum(losses.view(-1) * loss_mask.view(-1))
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    return output, loss_func


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
    data = iter([causal_batch(t.to(device)) for t in micro_batches])
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
    tot = torch.stack([x["lm loss"] for x in losses]).sum(0).float()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(tot)
    return (tot[0] / tot[1]).item(), grad_norm, num_zeros, update_successful
