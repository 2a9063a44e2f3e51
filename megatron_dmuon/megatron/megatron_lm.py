"""`--optimizer dmuon` inside Megatron-LM's own entry scripts (`pretrain_gpt.py`, core_v0.19.0).

Two plain factories hold everything DMuon-specific; the example, the CI test and the Megatron-LM
hook all build through them:

* `ddp_class_for(args)` — the class to construct instead of Megatron's DistributedDataParallel
  (`DMuonDDP` with this run's `--dmuon-*` layout options; called as Megatron calls its DDP).
* `optimizer_factory_for(args, fallback)` — a drop-in `get_megatron_optimizer` that builds DMuon for
  `OptimizerConfig(optimizer='dmuon')` and hands every other optimizer to `fallback` untouched.

`install()` is the thin Megatron-LM layer on top. Its whole contact surface with
`megatron.training` (listed in docs/megatron_lm.md) is six module attributes, replaced by
wrappers that pass everything but `--optimizer dmuon` through unchanged (and, under
`--dmuon-overlap-step on`, `megatron.training.training.train`: the loop then runs on a high-priority
CUDA stream, so the owner's Newton-Schulz on its low-priority stream fills what the model leaves):

1. `megatron.training.arguments.add_megatron_arguments` — also registers DMuon's flags
   (`dmuon` becomes an `--optimizer` choice; combinations are checked while parsing).
2. `megatron.training.arguments.validate_args` — for `--optimizer dmuon`, Megatron validates the run
   as the distributed Adam run it is built on (`args.optimizer` reads `adam` during Megatron's own
   checks, so `--use-distributed-optimizer` is not diverted to the layer-wise Muon path), then
   `args.optimizer` reads `dmuon` again and the four routes below are set.
3. `megatron.training.training.DDP` and 4. `megatron.training.models.dist_utils.DistributedDataParallel`
   — the DDP class of both model-building paths (`get_model` and the model-config builders) becomes
   `ddp_class_for(args)`.
5. `megatron.training.training.get_megatron_optimizer` — becomes `optimizer_factory_for(args, original)`.
6. `megatron.training.training.clip_qk` (MuonClip, `--qk-clip`, run after every optimizer step) —
   becomes `megatron/qk_clip.clip_qk`, Megatron's own made to rescale DMuon's owner masters.

9. `megatron.training.training.training_log` (`--optimizer dmuon` runs) — Megatron-LM's own log, then at
   every `--log-interval` DMuon's metrics (megatron/metrics.py) into Megatron's TensorBoard and W&B
   writers when `--tensorboard-dir` / `--wandb-project` ask for them.

7. `megatron.training.training.load_checkpoint` and 8. `megatron.training.checkpointing._load_base_checkpoint`
   (every run, DMuon or not) — the optimizer switch inside Megatron-LM's loop: the common state
   Megatron-LM reads first is noted (`checkpoint_switch.note_megatron_lm_load`), so DMuon's
   request can ask a Megatron Muon checkpoint for Megatron's names; and where Megatron's own
   optimizer loads a DMuon checkpoint, its request is pointed at DMuon's keys and the loaded state
   rebuilt (`checkpoint_switch.megatron_request_for_dmuon`). Any other load passes through unchanged.

Nothing is copied from Megatron-LM; importing this module imports nothing from it.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Optional

from .checkpoint import switch as checkpoint_switch
from ..planning.overlap_mode import OverlapMode
from .config import config_of
from .flags import add_dmuon_args
from .modes import mode_traits

_ORIGINALS: dict = {}
# every (module, attribute) of megatron.training that install() and its routes replace
HOOK_POINTS = (("megatron.training.arguments", "add_megatron_arguments"),
               ("megatron.training.arguments", "validate_args"),
               ("megatron.training.training", "DDP"),
               ("megatron.training.training", "get_megatron_optimizer"),
               ("megatron.training.training", "clip_qk"),
               ("megatron.training.training", "load_checkpoint"),
               ("megatron.training.training", "train"),
               ("megatron.training.training", "training_log"),
               ("megatron.training.checkpointing", "_load_base_checkpoint"),
               ("megatron.training.models.dist_utils", "DistributedDataParallel"))


def ddp_class_for(args) -> Optional[type]:
    """The DDP class for this run: DMuonDDP bound to this run's DMuonConfig; Megatron's DDP with
    LayerWise's layout for the `megatron_layerwise` baseline; or None where Megatron's own
    DistributedDataParallel is right (another optimizer, or the all-reduce baseline
    `--dmuon-mode gather_then_compute`)."""
    ddp = mode_traits(args.dmuon_mode).ddp if args.optimizer == "dmuon" else "megatron"
    if ddp == "megatron":
        return None
    from .ddp import MegatronLayerWiseDDP

    if ddp == "layerwise":  # Megatron's own LayerWise Muon, wired as Megatron-LM does
        return MegatronLayerWiseDDP
    return dmuon_ddp_class(config_of(args))


def dmuon_ddp_class(cfg) -> type:
    """DMuonDDP bound to ``cfg``, constructed as Megatron constructs its DistributedDataParallel
    (what Megatron-LM's and Megatron-Bridge's model builders call)."""
    from .ddp import DMuonDDP

    class BoundDMuonDDP(DMuonDDP):
        def __init__(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None,
                     full_param_layout=None):
            super().__init__(config, ddp_config, module, disable_bucketing=disable_bucketing,
                             pg_collection=pg_collection, full_param_layout=full_param_layout, dmuon=cfg)

    return BoundDMuonDDP


def optimizer_factory_for(args, fallback: Callable) -> Callable:
    """`get_megatron_optimizer(config, model_chunks, ...)` for this run: DMuon (configured by
    `config_of(args)`, the run's one DMuonConfig) for `config.optimizer == 'dmuon'`, else `fallback(...)`.

    DMuon builds its param groups with Megatron's standard overrides (no weight decay on biases and
    norms), as Megatron-LM's default `config_overrides` do; `--use-mup` is refused at parse time."""

    def get_megatron_optimizer(config, model_chunks, *extra, **kwargs):
        if config.optimizer != "dmuon":
            return fallback(config, model_chunks, *extra, **kwargs)
        from .optimizer import get_dmuon_optimizer

        optimizer = get_dmuon_optimizer(dataclasses.replace(config, optimizer="adam"), model_chunks, config_of(args))
        if getattr(args, "tensorboard_dir", None) or getattr(args, "wandb_project", None):
            _RUN["metrics"] = optimizer.enable_metrics(model_chunks)  # written by training_log's route (9)
        return optimizer

    return get_megatron_optimizer


_RUN: dict = {}  # this process's DMuon run: its metrics (megatron/metrics.py), once the optimizer is built


def _with_dmuon_metrics(training_log: Callable, args) -> Callable:
    """Megatron-LM's ``training_log``, then at every ``--log-interval`` DMuon's metrics into Megatron's own
    TensorBoard and W&B writers (``values`` gathers on every rank: training_log runs on every rank)."""

    def training_log_with_dmuon_metrics(*a, **k):
        out = training_log(*a, **k)
        iteration = a[3] if len(a) > 3 else k.get("iteration")
        metrics = _RUN.get("metrics")
        if metrics is not None and iteration is not None and iteration % args.log_interval == 0:
            from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

            from .metrics import write_values

            write_values(iteration, metrics.values(), get_tensorboard_writer(), get_wandb_writer())
        return out

    return training_log_with_dmuon_metrics


def install() -> None:
    """Make `--optimizer dmuon` available to a Megatron-LM entry script. Call it before the script
    parses its arguments (patches/pretrain_gpt.patch does). Idempotent."""
    import megatron.training.arguments as arguments

    from .child_processes import die_with_torchrun, install as children_die_with_this_rank

    children_die_with_this_rank()  # Megatron's checkpoint writers (its Manager, --async-save) end with the rank
    die_with_torchrun()  # and the rank with torchrun, which cannot stop it once SIGKILLed
    if "add_megatron_arguments" in _ORIGINALS:
        return
    _ORIGINALS["add_megatron_arguments"] = arguments.add_megatron_arguments
    _ORIGINALS["validate_args"] = arguments.validate_args

    def add_megatron_arguments(parser):
        return add_dmuon_args(_ORIGINALS["add_megatron_arguments"](parser))

    def validate_args(args, defaults={}):  # noqa: B006 (Megatron's signature)
        if getattr(args, "optimizer", None) != "dmuon":
            _route_checkpoint_loads()  # (a DMuon checkpoint may be loaded into Megatron's own optimizer)
            return _ORIGINALS["validate_args"](args, defaults)
        if not mode_traits(args.dmuon_mode).megatron_lm_hook or getattr(args, "yaml_cfg", None):
            _fail("--dmuon-mode megatron_layerwise and --yaml-cfg are not available through the Megatron-LM "
                  "hook; for Megatron's own distributed Muon run --optimizer muon --use-distributed-optimizer")
        _route_checkpoint_loads()
        args.optimizer = "adam"  # Megatron validates the distributed-Adam run DMuon is built on
        try:
            out = _ORIGINALS["validate_args"](args, defaults)
        finally:
            args.optimizer = "dmuon"
        if getattr(args, "rank", 0) == 0:  # Megatron's argument dump was printed during its own validation
            print("> --optimizer dmuon: the argument dump above shows 'optimizer adam', the distributed-Adam run "
                  f"DMuon is built on; DMuon runs (--dmuon-mode {args.dmuon_mode})", flush=True)
        _route(args)
        return out

    arguments.add_megatron_arguments = add_megatron_arguments
    arguments.validate_args = validate_args


def _route(args) -> None:
    """Point Megatron-LM's DDP class, optimizer factory and QK-clip at DMuon for this run."""
    import megatron.training.models.dist_utils as dist_utils
    import megatron.training.training as training

    from .qk_clip import clip_qk

    if "get_megatron_optimizer" not in _ORIGINALS:
        _ORIGINALS["get_megatron_optimizer"] = training.get_megatron_optimizer
    training.get_megatron_optimizer = optimizer_factory_for(args, _ORIGINALS["get_megatron_optimizer"])
    training.clip_qk = clip_qk  # passes every model chunk that is not DMuon's to Megatron's own
    ddp_class = ddp_class_for(args)
    if ddp_class is not None:
        training.DDP = ddp_class
        dist_utils.DistributedDataParallel = ddp_class
    if "training_log" not in _ORIGINALS:
        _ORIGINALS["training_log"] = training.training_log
    training.training_log = _with_dmuon_metrics(_ORIGINALS["training_log"], args)
    if "train" not in _ORIGINALS:
        _ORIGINALS["train"] = training.train
    overlapped = OverlapMode(args.dmuon_overlap_step).overlaps
    training.train = _prioritized(_ORIGINALS["train"]) if overlapped else _ORIGINALS["train"]


def _prioritized(train: Callable) -> Callable:
    """Megatron-LM's training loop on a high-priority stream (runtime/overlapped_step.model_priority_stream):
    the overlapped step's NS then fills what the model's kernels leave of the GPU."""
    from ..runtime.overlapped_step import model_priority_stream

    def prioritized_train(*args, **kwargs):
        with model_priority_stream():
            return train(*args, **kwargs)

    return prioritized_train


def _route_checkpoint_loads() -> None:
    """Routes 7 and 8 (module docstring): the optimizer switch in Megatron-LM's own load."""
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as training

    checkpoint_switch.route_checkpoint_loads(training, "load_checkpoint", 1, checkpointing, lambda args, kwargs: args)


def _fail(message: str) -> None:
    print(f"{sys.argv[0]}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
