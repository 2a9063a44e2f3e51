"""Rank workers that run a real Megatron-LM checkout's training code on CPU (gloo + the CPU shim):
parse with the hook installed, `setup_model_and_optimizer` through the model-config builder path
`pretrain_gpt.py` takes, then Megatron's own `train_step` with `pretrain_gpt.forward_step` on
`--mock-data`. Used by tests/megatron/test_megatron_lm.py when a checkout is around."""
from __future__ import annotations

import os
import sys
import typing

typing.override = getattr(typing, "override", lambda f: f)  # Megatron-LM needs Python 3.12's typing.override


def megatron_train_step(rank, world_size, argv, iters=4, save_at=None, local_max_logits=False, log=False):
    """``iters`` of Megatron-LM's train_step (after a ``--load``, from the loaded iteration on);
    ``save_at``: Megatron-LM's own save_checkpoint once the loop reaches that iteration (to ``--save``;
    ``save_at`` = the loaded iteration: right after the load, before any step);
    ``local_max_logits``: the local attention records the max logits `--qk-clip` needs;
    ``log``: after each step, Megatron-LM's ``training.training_log`` as its ``train()`` calls it (with
    the hook installed, the wrapped one), into the writers its argument parsing made (TensorBoard on
    the last rank)."""
    import megatron_dmuon.megatron as dm

    if local_max_logits:
        from megatron_dmuon.testing import local_max_logits as recorder

        recorder.install()
    dm.install()
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.utils import get_model_config
    from megatron.training import training
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    import pretrain_gpt

    setattr(pretrain_gpt.train_valid_test_datasets_provider, "is_distributed", True)
    container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    model, optimizer, scheduler = training.setup_model_and_optimizer(
        ModelType.encoder_or_decoder, pretrain_gpt.model_provider, cfg_container=container,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    config = get_model_config(model[0])  # what Megatron-LM's train() sets before its loop
    config.grad_scale_func, config.finalize_model_grads_func = optimizer.scale_loss, finalize_model_grads
    data, _, _ = training.build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
    losses, max_logits, start = [], [], args.iteration
    logged, total_loss_dict, report_memory = [], {}, False
    if log:
        from megatron.training.global_vars import get_timers

        get_timers()("interval-time", log_level=0).start(barrier=True)  # as train() does before its loop
    if save_at is not None and save_at == start:
        from megatron.training.checkpointing import save_checkpoint

        save_checkpoint(start, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
    for it in range(start, start + iters):
        loss, skipped, *_, grad_norm, zeros, max_logit = training.train_step(
            pretrain_gpt.forward_step, data, model, optimizer, scheduler, config, get_forward_backward_func(), iteration=it)
        assert not skipped
        if log:
            report_memory = training.training_log(loss, total_loss_dict, optimizer.param_groups[0]["lr"], it + 1,
                                                  optimizer.get_loss_scale().item(), report_memory, skipped, grad_norm,
                                                  None, zeros, max_logit)
            logged.append(it + 1)
        losses.append(float(loss["lm loss"]))
        max_logits.append(float(max_logit))
        args.consumed_train_samples += args.global_batch_size
        if save_at is not None and it + 1 == save_at:
            from megatron.training.checkpointing import save_checkpoint

            save_checkpoint(it + 1, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
    qkv = [p.detach().float().tolist() for n, p in model[0].named_parameters() if n.endswith("linear_qkv.weight")]
    if log:
        from megatron.training.global_vars import get_tensorboard_writer

        writer = get_tensorboard_writer()
        if writer is not None:
            writer.flush()
    return {"losses": losses, "max_logits": max_logits, "qkv": qkv, "ddp": [type(m).__name__ for m in model], "logged": logged,
            "optimizers": [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])]}


def compare_checkpoints(rank, world_size, first, second):
    """bench/megatron_lm_switch.py's tensor-by-tensor state comparison of two torch_dist checkpoints,
    in a rank process (its reader wants a process group)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
    from megatron_lm_switch import compare_saved

    return compare_saved(first, second)
