"""The two baselines `--dmuon-mode` offers beside `dmuon`: Megatron's own LayerWise Muon
(``megatron_layerwise``) and every rank orthogonalizing every matrix after an all-reduce
(``gather_then_compute``). Both train the same rule as DMuon, for side-by-side measurements."""
from __future__ import annotations

import dataclasses

import torch

from ..planning.ns_choice import plan_ns_choices
from ..runtime.owner_step import MatrixInfo, OwnerMuonAdamW
from .megatron_lm_flags import megatron_muon_fields, megatron_ns_path
from .ddp import plan_records
from .modes import LAYERWISE_NEEDS_BF16
from .owner_optimizer import grad_scaler, init_state_fn, muon_adam_groups, register_matrices


def build_megatron_layerwise(config, model_chunks, cfg):
    """Baseline: Megatron's own Muon, as Megatron-LM builds it for `--optimizer muon` (LayerWise
    distributed under the distributed optimizer), with the `--muon-*` fields of ``cfg``'s rule."""
    try:
        import emerging_optimizers  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "--dmuon-mode megatron_layerwise delegates to Megatron's LayerWiseDistributedOptimizer, "
            "which needs the emerging_optimizers package (Python >= 3.12): pip install emerging-optimizers"
        ) from e
    from megatron.core.optimizer import get_megatron_optimizer

    # as Megatron-LM's validate_args turns --optimizer muon --use-distributed-optimizer: the
    # LayerWise distributed optimizer (each matrix stepped whole by one DP rank), not DistOpt
    layer_wise = config.use_distributed_optimizer
    if layer_wise and not config.bf16:
        raise ValueError(LAYERWISE_NEEDS_BF16)  # (the Python API; the flags are checked at parse time)
    fields = megatron_muon_fields(cfg, getattr(config, "muon_tp_mode", "duplicated"))
    opt = get_megatron_optimizer(
        dataclasses.replace(config, optimizer="muon", use_distributed_optimizer=False,
                            use_layer_wise_distributed_optimizer=layer_wise, **fields),
        model_chunks)
    opt.megatron_ns_path = megatron_ns_path(fields)  # (the job's summary and the benchmarks' tables name it)
    return opt

def build_gather_then_compute_parts(config, model_chunks, cfg) -> list:
    """Baseline: all-reduced grads (Megatron's plain DDP), every rank orthogonalizes every matrix
    (DP only). Its matrices are the records the dmuon plan would hold (routing, splits: one
    rule, ``layout.plan_records``), all owned by every rank; the part, for the chain."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import _get_param_groups_and_buffers, get_standard_config_overrides
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    infos = {}
    for chunk in model_chunks:
        module = chunk.module if hasattr(chunk, "module") else chunk
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        records = plan_records(module, chunk.ddp_config, lambda key: (1, 1), cfg, chunk.config)
        device = next((p.device for _, p in named if p.is_cuda), torch.device("cpu"))
        choices = plan_ns_choices(records, cfg.muon.ns_resolver(device))
        params = {n: p for n, p in named}
        for record, ns in zip(records, choices):
            if record.use_muon:
                infos[params[record.name]] = MatrixInfo.from_record(record, ns=ns)
    param_groups, _ = _get_param_groups_and_buffers(
        model_chunks, 0, config, get_standard_config_overrides(config), lambda g: True, "buffers")
    inner = OwnerMuonAdamW(
        muon_adam_groups(param_groups, infos),
        lr=config.lr, weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, muon=cfg.muon,
    )
    if config.bf16 or config.fp16:
        opt = Float16OptimizerWithFloat16Params(inner, config, grad_scaler(config), init_state_fn)
        register_matrices(inner, opt.float16_groups, opt.fp32_from_float16_groups, infos)
        register_matrices(inner, opt.fp32_from_fp32_groups, opt.fp32_from_fp32_groups, infos)
    else:
        opt = FP32Optimizer(inner, config, init_state_fn)
        groups = [g["params"] for g in inner.param_groups]
        register_matrices(inner, groups, groups, infos)
    opt.grad_stats_parallel_group = parallel_state.get_model_parallel_group()
    opt.tp_group = parallel_state.get_tensor_model_parallel_group()
    opt.expert_tp_group = opt.tp_group
    inner.init_state()
    return [opt]


