"""The `dmuon` mode's optimizer: Megatron's DistributedOptimizer over the owner-aligned buffers,
its inner step the owner step (runtime/owner_step.py), one part for dense and one for expert params.

Built from the DDP chunks' plans: every Muon matrix's record (split pieces, owners, TP method) and
the NS its owner's stack runs (``planning.ns_choice.plan_ns_choices``) become the owner step's
``MatrixInfo``s. Checkpoints use DMuon's per-parameter format (megatron/checkpoint/optimizer_state.py).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from .checkpoint import torch_format
from ..planning.dp_shards import shard_range
from ..planning.ns_choice import plan_ns_choices
from ..planning.overlap_mode import OverlapMode
from ..runtime.dp_exchange import SplitMatrix
from ..runtime.owner_step import MatrixInfo, OwnerMuonAdamW
from .checkpoint import OwnerCheckpoints
from .overlap_hooks import install_overlap_step, need_order
from .publish import register_masters


def muon_adam_groups(param_groups, infos):
    """Split each Megatron param group (lr/wd multipliers intact) into a Muon and an AdamW group."""
    out = []
    for g in param_groups:
        muon = [p for p in g["params"] if p in infos]
        adam = [p for p in g["params"] if p not in infos]
        for params, use_muon in ((muon, True), (adam, False)):
            out.append({**g, "params": params, "use_muon": use_muon})
    return out


def init_state_fn(opt, config=None):
    """Megatron's init_state_fn hook: every state tensor, for every param, now (see init_state)."""
    opt.init_state()


def _matrix_infos(model_chunks, muon) -> dict:
    """{model param: MatrixInfo} for every Muon matrix of the chunks: the views of their plans'
    records, with the NS each piece's stack runs (``planning.ns_choice.plan_ns_choices`` over
    every chunk's records: one optimizer stacks them together) and, under --dmuon-overlap-step,
    when the next forward needs it (``overlap_hooks.need_order``). Names are unique across chunks
    (virtual pipeline)."""
    params = [(idx, param, name, chunk.dmuon_plan.record(name)) for idx, chunk in enumerate(model_chunks)
              for param, name in chunk.param_names().items()]
    device = next(p for _, p, _, _ in params).device if params else torch.device("cpu")
    choices = plan_ns_choices([r for *_, r in params], muon.ns_resolver(device))
    need = need_order(model_chunks) if OverlapMode(muon.overlap_step).cuts_per_need_group else {}
    out = {}
    for (idx, param, name, record), ns in zip(params, choices):
        if record.use_muon:
            key = name if len(model_chunks) == 1 else f"chunk{idx}/{name}"
            layout = model_chunks[idx].dmuon_plan.layouts[record.buffer]
            split = _split_matrix(key, name, layout, record.numel) if layout.scheme == "split" else None
            out[param] = dataclasses.replace(MatrixInfo.from_record(record, key, ns, need.get(param, 0)), dp_split=split)
    return out


def _split_matrix(key: str, name: str, layout, numel: int) -> SplitMatrix:
    """The exchange's view of split-layout matrix ``name``: its pieces, its home or its team's blocks."""
    if name not in layout.teams:
        return SplitMatrix(key, layout.owners[name], numel, tuple(layout.pieces(name)))
    shape, blocks = layout.homes(name)
    return SplitMatrix(key, layout.owners[name], numel, tuple(layout.pieces(name)), tuple(shape), tuple(blocks))


def register_split_layout(inner: OwnerMuonAdamW, opt, infos: dict) -> dict:
    """Under the split layout: ``infos`` (this part's) with this rank's piece of every split matrix it
    holds (Megatron's own range of the param in this rank's shard, which the plan's piece must equal:
    ``register_matrix`` checks), and every matrix homed here without a piece registered as a home.
    Returns the infos."""
    infos = dict(infos)
    held = set()
    for model in opt.model_params():
        info = infos.get(model)
        if info is not None and info.dp_split is not None:
            shard = opt._get_model_param_range_map(model)["param"]
            infos[model] = dataclasses.replace(info, dp_piece=(shard.start, shard.end))
            held.add(model)
    for model, info in infos.items():
        if info.dp_split is not None and model not in held and any(
                home == inner.dp.rank for home, _, _ in info.dp_split.homes()[1]):
            inner.register_home(info)
    inner.register_split_matrices([info for info in infos.values() if info.dp_split is not None])
    return infos


def register_matrices(inner: OwnerMuonAdamW, model_groups, main_groups, infos) -> None:
    for model_group, main_group in zip(model_groups, main_groups):
        for model_param, main_param in zip(model_group, main_group):
            if model_param in infos:
                inner.register_matrix(main_param, infos[model_param])


def _master_pairs(opt):
    """[(model param, its fp32 master shard)] of a DistributedOptimizer (bf16 params: separate masters)."""
    return [(m, s) for mg, sg in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)
            for m, s in zip(mg, sg)]


def grad_scaler(config):
    """bf16/fp32 need no scaler; a constant --loss-scale is honoured as Megatron does (fp16 needs
    one: check_dmuon_config rejects fp16 with Megatron's dynamic scaler)."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    return ConstantGradScaler(config.loss_scale) if config.loss_scale else None


def instance_id(pgs) -> int:
    """This rank's distributed-optimizer instance under ``--num-distributed-optimizer-instances``
    (as Megatron's get_megatron_optimizer: its rank in the inter-instance group; 0 with one)."""
    if pgs["dp_cp_group"].size() > pgs["intra_dp_cp_group"].size():
        return pgs["inter_dist_opt_group"].rank()
    return 0


def build_owner_parts(config, model_chunks, cfg) -> list:
    """The `dmuon` mode: one DMuonDistributedOptimizer per buffer kind (dense, expert) that holds
    params, for ``optimizer.DMuonChainedOptimizer`` to chain."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import _get_param_groups_and_buffers, get_standard_config_overrides
    from megatron.core.process_groups_config import ProcessGroupCollection

    DMuonDistributedOptimizer.check_owner_aligned(model_chunks)
    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(None, model_chunks, False)
    tp_groups = {False: parallel_state.get_tensor_model_parallel_group(),
                 True: parallel_state.get_expert_tensor_parallel_group()}
    infos = _matrix_infos(model_chunks, cfg.muon)
    expert_params = {param: chunk.dmuon_plan.record(name).expert for chunk in model_chunks
                     for param, name in chunk.param_names().items()}
    parts = []
    for expert in (False, True):
        param_groups, buffers = _get_param_groups_and_buffers(
            model_chunks, 0, config, get_standard_config_overrides(config),
            (lambda g, e=expert: g["is_expert_parallel"] == e), "expert_parallel_buffers" if expert else "buffers",
        )
        if not any(g["params"] for g in param_groups):
            continue
        dp_group = pgs["intra_expt_dp_group"] if expert else pgs["intra_dp_cp_group"]
        inner = OwnerMuonAdamW(
            muon_adam_groups(param_groups, infos),
            lr=config.lr, weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, muon=cfg.muon,
            tp_group=tp_groups[expert], dp_group=dp_group,
        )
        opt = DMuonDistributedOptimizer(
            inner, config, grad_scaler(config), init_state_fn,
            model_chunks=model_chunks,
            per_model_buffers=buffers,
            data_parallel_group=dp_group,
            data_parallel_group_gloo=None,
            data_parallel_group_idx=(pgs["expt_tp_pp_with_egtp_remat_group"] if expert else pgs["mp_group"]).rank(),
            distributed_optimizer_instance_id=instance_id(pgs),
        )
        part_infos = register_split_layout(inner, opt, {m: i for m, i in infos.items() if expert_params[m] == expert})
        register_matrices(inner, opt.model_float16_groups, opt.shard_fp32_from_float16_groups, part_infos)
        register_matrices(inner, opt.model_fp32_groups, opt.shard_fp32_groups, part_infos)
        # Megatron's get_megatron_optimizer sets these three after construction, as here
        opt.grad_stats_parallel_group = pgs["intra_dist_opt_group"]
        opt.tp_group = tp_groups[False]
        opt.expert_tp_group = tp_groups[True]
        inner.init_state()  # after register_matrix: every rank holds every state key from the start
        for chunk in model_chunks:  # an FP8 publish quantizes from these fp32 masters
            register_masters(chunk, lambda o=opt: _master_pairs(o))
        parts.append(opt)
    if OverlapMode(cfg.muon.overlap_step).cuts_per_need_group:
        install_overlap_step(model_chunks, parts, infos)
    return parts


def _import_distributed_optimizer():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


class DMuonDistributedOptimizer(OwnerCheckpoints, _import_distributed_optimizer()):
    """Megatron's DistributedOptimizer whose shards are owner-aligned and whose inner step is the
    owner step (OwnerMuonAdamW). Everything else (grad copy, norm/clip, zero count, publish via
    param all-gather, overlap hooks) is inherited unchanged; checkpoints use DMuon's per-parameter
    format (megatron/checkpoint/optimizer_state.py)."""

    def __init__(self, *args, **kwargs):
        self.check_owner_aligned(kwargs["model_chunks"])  # before Megatron builds any state
        super().__init__(*args, **kwargs)

    @classmethod
    def _build_model_gbuf_range(cls, param_and_grad_buffer, bucket_index: int):
        """As Megatron's, but this rank's shard is `buffer.dmuon_shard_index` (the two-level
        reduce-scatter delivers shard l*N + k to node k, local rank l); flat runs use the DP rank."""
        from megatron.core.optimizer.distrib_optimizer import Range

        shard = getattr(param_and_grad_buffer, "dmuon_shard_index", None)
        if shard is None:
            return super()._build_model_gbuf_range(param_and_grad_buffer, bucket_index)
        world = param_and_grad_buffer.data_parallel_group.size()
        bucket = param_and_grad_buffer.buckets[bucket_index]
        size = bucket.grad_data.numel() // world
        local = Range(*shard_range(shard, size, bucket.offset))
        return {"param_map": cls._build_model_gbuf_param_range_map(
            param_and_grad_buffer.param_index_map, local, bucket.offset)}

    def prepare_grads(self) -> bool:
        for chunk in self.model_chunks:
            if not getattr(chunk, "grads_reduced", True):
                raise RuntimeError(
                    "DMuon: optimizer.step() before the gradients were reduced to their owners: call "
                    "ddp.finish_grad_sync() after backward (Megatron's schedules do it through "
                    "config.finalize_model_grads_func = finalize_model_grads)"
                )
        return super().prepare_grads()

    def _checkpoint_parts(self):
        return [self]

    def model_params(self) -> list:
        return [p for groups in (self.model_float16_groups, self.model_fp32_groups) for g in groups for p in g]

    def _copy_main_params_to_model_params(self):
        """Megatron's copy, of the masters not in flight (--dmuon-overlap-step: those are copied by
        ``copy_applied_masters`` when their group is finished)."""
        in_flight = self.optimizer.masters_in_flight()
        if not in_flight:
            return super()._copy_main_params_to_model_params()
        self._copy_masters(lambda main: main not in in_flight)

    @torch.no_grad()
    def launch_early(self, need: int, reduce_handle=None) -> None:
        """--dmuon-overlap-step backward: the Muon work of need group ``need``, started by its
        bucket group's grad reduce during the backward. Its main grads are set as Megatron's step
        sets them (``_copy_model_grads_to_main_grads``: the grad buffer's shard, in the master's dtype)
        once the reduce is done; on CUDA all of it runs on the NS side stream, which waits for the
        reduce, so the backward goes on meanwhile. A group started already is left alone (Megatron
        may start its grad reduce again, as a no-op, at the step)."""
        members = self._early_members().get(need)
        if not members or self.optimizer.started_early(need):
            return
        inner = self.optimizer
        device = members[0][1].device
        side = inner.early_momentum_stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if reduce_handle is not None:
                reduce_handle.wait()  # on CUDA: the side stream waits for the reduce, not the host
            for model, main, shard, _ in members:
                # Megatron's .float() (a view of fp32 grads): in the master's dtype, as its step gets it
                main.grad = model.main_grad.view(-1)[shard.start:shard.end].to(main.dtype)
            inner.launch_early([(main, group, inner.matrix_info[main]) for _, main, _, group in members])

    def _early_members(self) -> dict:
        """{need: [(model param, main param, its shard range, its param group)]} of the Muon
        matrices, in the step's order (by name): worked out once, at the first early launch."""
        if getattr(self, "_early_by_need", None) is None:
            inner = self.optimizer
            group_of = {p: g for g in inner.param_groups if g.get("use_muon", False) for p in g["params"]}
            by_need = {}
            for models, mains in ((self.model_float16_groups, self.shard_fp32_from_float16_groups),
                                  (self.model_fp32_groups, self.shard_fp32_groups)):
                for mg, sg in zip(models, mains):
                    for model, main in zip(mg, sg):
                        if main in group_of:
                            by_need.setdefault(inner.matrix_info[main].need, []).append(
                                (model, main, self._get_model_param_range_map(model)["param"], group_of[main]))
            for members in by_need.values():
                members.sort(key=lambda m: inner.matrix_info[m[1]].name)
            self._early_by_need = by_need
        return self._early_by_need

    def copy_applied_masters(self, mains) -> None:
        """Megatron's copy into the model's param buffer, of the masters ``mains`` only."""
        wanted = set(mains)
        self._copy_masters(lambda main: main in wanted)

    def _copy_masters(self, keep) -> None:
        names = ("shard_fp32_from_float16_groups", "model_float16_groups", "shard_fp32_groups", "model_fp32_groups")
        saved = [getattr(self, n) for n in names]
        try:
            for main_name, model_name, mains, models in ((names[0], names[1], saved[0], saved[1]),
                                                         (names[2], names[3], saved[2], saved[3])):
                pairs = [[(s, m) for s, m in zip(sg, mg) if keep(s)] for sg, mg in zip(mains, models)]
                setattr(self, main_name, [[s for s, _ in g] for g in pairs])
                setattr(self, model_name, [[m for _, m in g] for g in pairs])
            _import_distributed_optimizer()._copy_main_params_to_model_params(self)
        finally:
            for n, v in zip(names, saved):
                setattr(self, n, v)

    def get_parameter_state_dp_zero(self, *args, **kwargs):
        return torch_format.param_state_dp_zero([self])

    def load_parameter_state_from_dp_zero(self, state_dict, *, update_legacy_format: bool = False):
        torch_format.load_param_state_dp_zero([self], state_dict)

    def _megatron_format_not_used(self, *args, **kwargs):
        raise NotImplementedError(
            "DMuon optimizer state uses its own per-parameter format: call sharded_state_dict()/load_state_dict() "
            "(dist_checkpointing) or save_parameter_state()/load_parameter_state() (torch format)")

    get_parameter_state_dp_reshardable = _megatron_format_not_used
    load_parameter_state_from_dp_reshardable = _megatron_format_not_used
    load_parameter_state_from_fully_reshardable = _megatron_format_not_used
    load_parameter_state_from_fs_model_space = _megatron_format_not_used
    sharded_param_state_dp_reshardable = _megatron_format_not_used
    sharded_param_state_fully_reshardable = _megatron_format_not_used
    sharded_param_state_fs_model_space = _megatron_format_not_used
    sharded_param_state_dp_zero = _megatron_format_not_used

    @staticmethod
    def check_owner_aligned(model_chunks) -> None:
        for chunk in model_chunks:
            if getattr(chunk, "dmuon_plan", None) is None:
                raise ValueError(
                    "DMuon: the model chunk was wrapped with a plain DistributedDataParallel; wrap it "
                    "with megatron_dmuon.megatron.ddp.build_dmuon_ddp(...) so buckets are owner-aligned"
                )


