"""DMuon in Megatron-Bridge, through Bridge's own extension points; all of it lives here:
``adapter.py`` (the only module that imports ``megatron.bridge``), ``names.py`` (DMuon's messages in
Bridge's field names) and ``__main__.py`` (the launcher). Users import it as ``megatron_dmuon.bridge``
(megatron_dmuon/bridge.py, the door to this package).

    from megatron_dmuon.bridge import dmuon_with_cosine_annealing
    cfg = <a Bridge recipe>(...)                       # e.g. a Qwen or DeepSeek recipe's ConfigContainer
    cfg.optimizer, cfg.scheduler = dmuon_with_cosine_annealing(max_lr=3e-3, muon_momentum=0.95)
    pretrain(cfg, forward_step)

or, keeping a recipe's own optimizer settings, ``use_dmuon(cfg, ns_launch="graph")``; or, for
Bridge's scripts with ``optimizer.optimizer=dmuon`` among their overrides,
``torchrun ... -m megatron_dmuon.bridge [--dmuon-* flags] scripts/training/run_recipe.py ...``.

* ``DMuonOptimizerConfig`` is Bridge's OptimizerConfig with a ``provide()``: Bridge's
  ``setup_optimizer`` calls it instead of megatron-core's factories, and it returns DMuon's chained
  optimizer (the one Megatron-LM's hook builds), on which Bridge builds its scheduler, checkpoints
  (``sharded_state_dict``) and train loop as usual. Its ``muon_*`` fields keep their meaning;
  ``dmuon_options`` holds DMuon's own (the ``--dmuon-*`` flags by name, without the prefix).
* Its ``finalize()`` (Bridge calls it while validating the ConfigContainer, before any model is
  built) makes Bridge's DDP wrap, megatron-core's ``_ddp_wrap``, construct DMuon's owner-aligned
  DDP: the one module attribute ``megatron.training.models.dist_utils.DistributedDataParallel``
  that the Megatron-LM hook sets as well.
* What DMuon cannot honour is refused by name before any state exists: Bridge's config field
  names appear in the message (``optimizer.muon_tp_mode``, ``ddp.use_megatron_fsdp``, ...).
"""
from __future__ import annotations

from .names import bridge_names  # noqa: F401 (public)

# the adapter (imports megatron.bridge) is loaded on first use, so the launcher's argument handling
# and these names import without Bridge installed
_ADAPTER_NAMES = ("DMuonOptimizerConfig", "as_dmuon_config", "dmuon_with_cosine_annealing", "install", "route_ddp",
                  "use_dmuon", "DMUON")


def __getattr__(name):
    if name in _ADAPTER_NAMES:
        from . import adapter

        return getattr(adapter, name)
    raise AttributeError(f"module 'megatron_dmuon.bridge' has no attribute {name!r}")
