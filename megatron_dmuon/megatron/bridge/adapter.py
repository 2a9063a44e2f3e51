"""Megatron-Bridge's extension points filled with DMuon (this package's __init__.py, which users import as
``megatron_dmuon.bridge``, says how to use them; docs/bridge.md). The only module that imports ``megatron.bridge``:
it sits beside the Megatron-LM hook (megatron_lm.py), in the one package that imports megatron."""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.bridge.training.config import OptimizerConfig

from ..config_checks import check_dmuon_config, tensor_parallel_size
from ..config import DMuonConfig
from ..flags import dmuon_config_from_fields
from .names import bridge_names

DMUON = "dmuon"
_DDP = ("megatron.training.models.dist_utils", "DistributedDataParallel")
_ORIGINALS: dict = {}  # what install() and route_ddp replaced, by (module, name)


def _sections() -> dict:
    """{config field: its ConfigContainer section} for the fields DMuon's checks name as flags."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    out = {f.name: "model" for f in dataclasses.fields(TransformerConfig)}
    out.update({f.name: "ddp" for f in dataclasses.fields(DistributedDataParallelConfig)})
    out.update({f.name: "optimizer" for f in dataclasses.fields(OptimizerConfig)})
    return out


def _refuse(error: Exception):
    return type(error)(bridge_names(str(error), _sections()))


@dataclasses.dataclass
class DMuonOptimizerConfig(OptimizerConfig):
    """Bridge's OptimizerConfig for DMuon (``optimizer="dmuon"``); everything else is Bridge's."""

    optimizer: str = DMUON
    use_distributed_optimizer: bool = True  # DMuon's owners are the distributed optimizer's shards
    dmuon_options: dict = dataclasses.field(default_factory=dict)

    def dmuon_config(self, tensor_parallel: int = 1) -> DMuonConfig:
        try:
            return dmuon_config_from_fields(self, tensor_parallel, **self.dmuon_options)
        except (ValueError, TypeError) as e:
            raise _refuse(e) from None

    def megatron_core_config(self):
        """The plain megatron-core OptimizerConfig DMuon's builder reads (as ``adam``: the distributed
        optimizer DMuon's parts are built on)."""
        from megatron.core.optimizer import OptimizerConfig as CoreOptimizerConfig

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(CoreOptimizerConfig) if f.init}
        return CoreOptimizerConfig(**{**fields, "optimizer": "adam"})

    def finalize(self) -> None:
        super().finalize()
        route_ddp(self.dmuon_config())
        route_checkpoint_loads()

    def provide(self, model_chunks, config_overrides=None, use_gloo_process_groups=False, pg_collection=None):
        """DMuon's chained optimizer for Bridge's DDP-wrapped ``model_chunks`` (Bridge's
        ``setup_optimizer`` hook)."""
        from megatron.core.optimizer import get_standard_config_overrides

        from ..optimizer import get_dmuon_optimizer

        chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        core = self.megatron_core_config()
        if config_overrides and config_overrides != get_standard_config_overrides(core):
            raise ValueError(
                "optimizer 'dmuon' builds its param groups with megatron-core's standard overrides (no weight decay "
                "on biases and norms), as Megatron-LM does; this run's OptimizerConfigOverrideProvider (or muP) "
                "asks for others: drop the custom provider / model.use_mup, or train with Bridge's own optimizers")
        if not getattr(chunks[0], "dmuon_plan", None):
            raise ValueError(
                "optimizer 'dmuon' needs DMuon's owner-aligned DDP, but the model was wrapped by another "
                f"{type(chunks[0]).__name__}: build the model after DMuonOptimizerConfig.finalize() (Bridge's "
                "pretrain does), or call megatron_dmuon.bridge.use_dmuon(config) before building it")
        cfg = self.dmuon_config(tensor_parallel_size(chunks[0].config))
        try:
            return get_dmuon_optimizer(core, chunks, cfg)
        except ValueError as e:
            raise _refuse(e) from None


def route_ddp(cfg: DMuonConfig) -> None:
    """Bridge's DDP wrap (megatron-core's ``_ddp_wrap``) constructs DMuon's DDP bound to ``cfg``."""
    import megatron.training.models.dist_utils as dist_utils

    from ..megatron_lm import dmuon_ddp_class

    _ORIGINALS.setdefault(_DDP, dist_utils.DistributedDataParallel)
    dist_utils.DistributedDataParallel = dmuon_ddp_class(cfg)


def restore_ddp() -> None:
    """Megatron's own DDP in Bridge's wrap again (a later run of another optimizer in the same process)."""
    import megatron.training.models.dist_utils as dist_utils

    if _DDP in _ORIGINALS:
        dist_utils.DistributedDataParallel = _ORIGINALS[_DDP]


def route_checkpoint_loads() -> None:
    """The optimizer switch in Bridge's own load, as in Megatron-LM's (docs/checkpoints.md): a
    checkpoint of Bridge's LayerWise Muon resumes under DMuon, and a DMuon one under Bridge's Muon.
    Bridge's ``_load_checkpoint_from_path`` is given the optimizer; its ``_load_base_checkpoint``
    reads the common state first, with the run's ConfigContainer as ``cfg``. Idempotent."""
    import megatron.bridge.training.checkpointing as checkpointing

    from ..checkpoint import route_checkpoint_loads as route

    route(checkpointing, "_load_checkpoint_from_path", 3, checkpointing, _load_settings)


def _load_settings(ckpt_cfg, kwargs):
    """The run's optimizer name and no_load_optim, from a Bridge base read's arguments."""
    from types import SimpleNamespace

    cfg = kwargs.get("cfg")
    return SimpleNamespace(optimizer=getattr(getattr(cfg, "optimizer", None), "optimizer", None),
                           no_load_optim=not getattr(ckpt_cfg, "load_optim", True))


def as_dmuon_config(optimizer_config, **options) -> DMuonOptimizerConfig:
    """``optimizer_config`` (Bridge's, any optimizer) as DMuon's: its lr, schedule, precision and
    ``muon_*`` fields kept; ``options`` added to its DMuon options."""
    kept = {f.name: getattr(optimizer_config, f.name) for f in dataclasses.fields(OptimizerConfig)
            if f.init and f.name not in ("optimizer", "use_distributed_optimizer")}
    previous = dict(getattr(optimizer_config, "dmuon_options", None) or {})
    return DMuonOptimizerConfig(**kept, dmuon_options={**previous, **options})


def use_dmuon(config, **options) -> None:
    """Switch a Bridge ConfigContainer to DMuon (before ``pretrain``): the optimizer config becomes
    ``DMuonOptimizerConfig`` with the recipe's settings, the distributed optimizer's DDP buffers
    are turned on (DMuon's owners are its shards), and the model's parallel layout is checked
    against DMuon's options now, before anything is built."""
    unsupported = [f"{part}.{name}" for part in ("ddp", "dist") for name in ("use_megatron_fsdp", "use_torch_fsdp2")
                   if getattr(getattr(config, part, None), name, False)]
    if unsupported:
        raise ValueError(f"optimizer 'dmuon' runs on megatron-core's DDP: drop {', '.join(unsupported)}")
    optimizer = as_dmuon_config(config.optimizer, **options)
    cfg = optimizer.dmuon_config(tensor_parallel_size(config.model))  # refuses what this layout cannot run
    ddp = dataclasses.replace(config.ddp, use_distributed_optimizer=True)
    try:  # every start-up check the optimizer build makes, now, before any model exists
        check_dmuon_config(optimizer.megatron_core_config(), ddp, cfg, config.model)
    except ValueError as e:
        raise _refuse(e) from None
    if not config.ddp.use_distributed_optimizer:
        print("> megatron_dmuon.bridge: ddp.use_distributed_optimizer=True (DMuon's owners are the distributed "
              "optimizer's shards)", flush=True)
    config.ddp.use_distributed_optimizer = True
    config.optimizer = optimizer


def dmuon_with_cosine_annealing(*args, dmuon_options: Optional[dict] = None, **kwargs):
    """Bridge's ``distributed_muon_with_cosine_annealing`` (same arguments, same schedule) with DMuon
    as the optimizer: (DMuonOptimizerConfig, SchedulerConfig)."""
    from megatron.bridge.recipes.utils.optimizer_utils import distributed_muon_with_cosine_annealing

    optimizer, scheduler = distributed_muon_with_cosine_annealing(*args, **kwargs)
    return as_dmuon_config(optimizer, **(dmuon_options or {})), scheduler




def install(**options) -> None:
    """Let Bridge's entry scripts take ``optimizer.optimizer=dmuon``: ``pretrain`` (and ``finetune``)
    switch a ConfigContainer whose optimizer says 'dmuon' with ``use_dmuon(config, **options)``
    first. Call it before the script imports them (``python -m megatron_dmuon.bridge`` does).
    Without it, Bridge would hand the string 'dmuon' to its Muon branch ('muon' in the name), so
    the launcher, or DMuonOptimizerConfig, is the way in. Also routes Bridge's checkpoint load for
    the optimizer switch (``route_checkpoint_loads``), whatever the optimizer. Idempotent."""
    import importlib

    from ..child_processes import install as children_die_with_this_rank

    children_die_with_this_rank()  # Megatron's checkpoint writers (its Manager, async saves) end with the rank
    route_checkpoint_loads()

    for module_name, name in (("megatron.bridge.training.pretrain", "pretrain"),
                              ("megatron.bridge.training.finetune", "finetune")):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if (module_name, name) in _ORIGINALS or not hasattr(module, name):
            continue
        original = _ORIGINALS[(module_name, name)] = getattr(module, name)

        def entry(config, *args, _original=original, **kwargs):
            if getattr(config.optimizer, "optimizer", None) == DMUON:
                use_dmuon(config, **options)
            elif not isinstance(config.optimizer, DMuonOptimizerConfig):
                restore_ddp()  # a DMuon run before it in this process routed the wrap
            return _original(config, *args, **kwargs)

        entry.__name__ = entry.__qualname__ = name
        setattr(module, name, entry)
